"""The codec stage: self-describing, checksummed chunks of one tensor's changes.

A chunk covers a position range [lo, hi) of one tensor (flat, canonical coordinates) and
carries gap-coded positions plus values coded as XOR bits, ulp differences or overwrite
values, each stream compressed. docs/FORMAT.md is the byte-level specification; this package
is its reference implementation:

  format   header layout, enums, dtype table, checksum, header parsing and chunk splitting
  encode   changes -> chunks (the generic path, the fused compiled encoder, context coding)
  slices   a parameter slice's chunks from one compiled call (the Megatron sender's path)
  decode   chunks -> verified positions and values, applied to a tensor (a batched chunk:
           one set per tensor it holds)
  bounds   information bounds a delta's size is measured against
  streams  the stream transforms under the chunk (gaps, planes, tokens, rANS)
  digest   additive tensor digests a receiver checks after a version

Callers use `codec.X`: the public names are re-exported here.
"""

from __future__ import annotations

from nemo_dcr_callback.codec import digest, streams
from nemo_dcr_callback.codec.bounds import delta_bound_bits, entropy_bits, position_bound_bits, values_info_bits
from nemo_dcr_callback.codec.decode import (
    DecodedChunk,
    apply_all,
    apply_chunk,
    apply_decoded,
    check_target,
    decode_chunk,
    decode_parts,
)
from nemo_dcr_callback.codec.encode import (
    encode_batch,
    encode_chunk,
    encode_delta,
    encode_overwrite,
    encode_sparse,
    split_ranges,
)
from nemo_dcr_callback.codec.format import (
    BY_CODE,
    BY_NAME,
    BY_TORCH,
    DEFAULT_CHUNK_SPAN,
    DTYPES,
    FORMAT_VERSION,
    MAGIC,
    MAX_NAME,
    RANS,
    STORED,
    ZSTD,
    ChunkError,
    ChunkHeader,
    DType,
    Kind,
    Layout,
    ValueMode,
    checksum,
    chunk_end,
    dtype_info,
    parse_header,
    split_chunks,
    tensor_digest,
)
from nemo_dcr_callback.codec.slices import encode_xor_slice
from nemo_dcr_callback.codec.streams import GapMode

__all__ = [
    "BY_CODE", "BY_NAME", "BY_TORCH", "DEFAULT_CHUNK_SPAN", "DTYPES", "FORMAT_VERSION", "MAGIC", "MAX_NAME",
    "RANS", "STORED", "ZSTD", "ChunkError", "ChunkHeader", "DType", "DecodedChunk", "GapMode", "Kind", "Layout",
    "ValueMode", "apply_all", "apply_chunk", "apply_decoded", "check_target", "checksum", "chunk_end", "decode_chunk",
    "decode_parts", "encode_batch",
    "delta_bound_bits", "digest", "dtype_info", "encode_chunk", "encode_delta", "encode_overwrite",
    "encode_sparse", "encode_xor_slice", "entropy_bits", "parse_header", "position_bound_bits", "split_chunks",
    "split_ranges", "streams", "tensor_digest", "values_info_bits",
]
