"""The slice encoder: every chunk of one parameter slice's XOR delta from one compiled call
(dcr_encode_slice: the placement's affine maps, the span ranges and the fused encoder), for
the Megatron sender's worker (sender/shard.py Encoder). Apart from encode.py, which encodes
one tensor's range at a time: the same chunk bytes, without Python per segment and chunk.
"""

from __future__ import annotations

import numpy as np
import torch

from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.codec.format import DType, Kind, Layout, Stream, ValueMode, assemble_chunk, dtype_info
from nemo_dcr_callback.codec.packing import pack_stream, scratch, token_stream
from nemo_dcr_callback.codec.streams import GapMode


def _fused_chunk(name: str, info: DType, gm: GapMode, gap_streams: list[Stream], vm: ValueMode, ans: bytes, esc,
                 numel: int, lo: int, hi: int, count: int, level: int) -> bytes:
    """An XOR chunk in the TOKENS layout from the fused encoder's streams (the gap stream(s)
    already packed, the rANS tokens, the escapes zstd-packed here)."""
    epacked, ecodec = pack_stream(esc, level)
    return assemble_chunk(name, Kind.XOR, info, gm, vm, Layout.TOKENS, numel, lo, hi, count,
                          gap_streams + [token_stream(None, ans, count), (esc.size, epacked, ecodec)])


_REC = 13  # dcr_encode_slice's record per chunk (see the C source)


def encode_xor_slice(lib, positions: torch.Tensor, add: int, xor: torch.Tensor, new: torch.Tensor,
                     dtype: torch.dtype, table: np.ndarray, names: list[str], numels: np.ndarray, span: int,
                     level: int) -> list[tuple[int, list[bytes], int, list[int]]] | None:
    """Every chunk of one parameter slice's XOR delta from one compiled call (dcr_encode_slice:
    the placement's affine maps, the span ranges and the fused encoder), per canonical tensor
    in the order Placement.project gives them: [(canonical index, chunks, changes, [old, new]
    digest sums)], byte for byte the chunks and terms of Placement.project plus encode_sparse
    (the worker's path without Python per segment and chunk). positions:
    the slice's sorted local positions (+ add); table: ParamMap.segment_table(); names and
    numels: its canonical tensors. None where the slice needs the generic coding (a chunk with
    a mean gap of 512 or more, or many escaped values) or a buffer would not do. The chunks
    come back together, so a slice's first chunk is uploaded once the whole slice is encoded
    (the Python path handed each chunk on as it was done): at about 11 GB/s of dense input
    per core at 5% changed, a 1 GB slice is about 0.1 s later."""
    info = dtype_info(dtype)
    positions, xor, new = positions.contiguous(), xor.contiguous(), new.contiguous()
    count, w = xor.numel(), info.width
    chunks = int(sum(-(-int(n) // span) for n in numels))  # at most
    gcap = count + int(numels.sum()) // 255 + 2 * chunks + 16  # the sum of the chunks' gap_bound
    acap = count + count // 2 + 704 * chunks  # the sum of their rANS bounds
    _, sp = scratch("slice_pos", count, np.int64)
    _, sxp = scratch("slice_xor", count * w)
    _, snp = scratch("slice_new", count * w)
    gaps, gp = scratch("slice_gaps", gcap)
    ans, ap = scratch("slice_ans", acap)
    esc, ep = scratch("slice_esc", count * w)
    rec, rp = scratch("slice_rec", _REC * chunks, np.int64)
    n = lib.dcr_encode_slice(positions.data_ptr(), int(positions.dtype == torch.int64), count, add, xor.data_ptr(),
                             new.data_ptr(), w, table.shape[0], table.ctypes.data, len(names), numels.ctypes.data,
                             span, sp, sxp, snp, count, gp, gcap, ap, acap, ep, count, rp, chunks)
    if n in (-11, -1):
        return None
    if n < 0:
        raise ValueError(f"slice encoder: positions out of order or outside the slice's segments ({n})")
    out: list = []  # the C call writes each canonical tensor's chunks in a row
    for cid, lo, hi, c, ulp, go, gl, ao, al, eo, ne, s_old, s_new in rec[:_REC * n].reshape(n, _REC).tolist():
        g = gaps[go:go + gl]
        chunk = _fused_chunk(names[cid], info, GapMode.GAP8, [(g.size, *pack_stream(g, level))], ValueMode(ulp),
                             ans[ao:ao + al].tobytes(), esc[eo * w:(eo + ne) * w], int(numels[cid]), lo, hi, c, level)
        if not out or out[-1][0] != cid:
            out.append((cid, [], 0, [0, 0]))
        cid, cs, total, terms = out[-1]
        cs.append(chunk)
        terms[0], terms[1] = (terms[0] + s_old) & digest.MASK, (terms[1] + s_new) & digest.MASK
        out[-1] = (cid, cs, total + c, terms)
    return out
