"""The chunk format: header layout, enums, the dtype table, checksums and header parsing.

docs/FORMAT.md is the byte-level specification; this module owns the header in both
directions (`assemble_chunk` writes it, `parse_header` verifies it) so the two cannot drift.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import torch
import xxhash

from nemo_dcr_callback.codec.streams import GapMode, gap_bound
from nemo_dcr_callback.core.bitops import bits

MAGIC = b"DCRC"
FORMAT_VERSION = 1
DEFAULT_CHUNK_SPAN = 1 << 24  # positions per chunk: 32 MiB of BF16 per chunk at most


class ChunkError(ValueError):
    """A chunk that is corrupt, truncated, hostile or meant for another tensor."""


class Kind(IntEnum):
    XOR = 1  # value is combined with the receiver's bits (XOR or ulp difference)
    OVERWRITE = 2  # value replaces the receiver's bits (idempotent)


class ValueMode(IntEnum):
    RAW = 0  # the XOR bits (Kind.XOR) or the new bits (Kind.OVERWRITE)
    ULP = 1  # zig-zag (key(new) - key(old)) in the monotone integer order of the float


class Layout(IntEnum):
    PLANES = 0  # one stream per value byte (low byte first), zstd each
    TOKENS = 1  # a byte token per value (min(v, 255), rANS-coded) + escaped full values


@dataclass(frozen=True)
class DType:
    code: int
    name: str  # safetensors dtype string
    torch: torch.dtype
    width: int
    is_float: bool


DTYPES = [
    DType(1, "BF16", torch.bfloat16, 2, True),
    DType(2, "F16", torch.float16, 2, True),
    DType(3, "F32", torch.float32, 4, True),
    DType(4, "F64", torch.float64, 8, False),  # 8-byte values: XOR only
    DType(5, "I8", torch.int8, 1, False),
    DType(6, "U8", torch.uint8, 1, False),
    DType(7, "I16", torch.int16, 2, False),
    DType(8, "I32", torch.int32, 4, False),
    DType(9, "I64", torch.int64, 8, False),
    DType(10, "BOOL", torch.bool, 1, False),
    DType(11, "F8_E4M3", torch.float8_e4m3fn, 1, False),
    DType(12, "F8_E5M2", torch.float8_e5m2, 1, False),
]
BY_CODE = {d.code: d for d in DTYPES}
BY_NAME = {d.name: d for d in DTYPES}
BY_TORCH = {d.torch: d for d in DTYPES}


def dtype_info(dtype: torch.dtype | str) -> DType:
    """The format's entry for a torch dtype or safetensors dtype name; ValueError if unsupported."""
    table = BY_NAME if isinstance(dtype, str) else BY_TORCH
    if dtype not in table:
        raise ValueError(f"unsupported dtype {dtype}")
    return table[dtype]


# magic, version, kind, dtype, gap mode, value mode, layout, (pad), name length,
# numel, lo, hi, count, number of streams
_HEAD = struct.Struct("<4sHBBBBBxHQQQQB")
_STREAM = struct.Struct("<QQB")  # raw length, stored length, stream codec
STORED, ZSTD, RANS = 0, 1, 2  # stream codecs
_SUM = struct.Struct("<Q")
MAX_NAME = 4096

Stream = tuple[int, bytes, int]  # (raw length, stored bytes, codec) of one encoded stream


@dataclass(frozen=True)
class ChunkHeader:
    name: str
    kind: Kind
    dtype: DType
    gap_mode: GapMode
    value_mode: ValueMode
    layout: Layout
    numel: int
    lo: int
    hi: int
    count: int
    streams: tuple[tuple[int, int, int], ...]  # (raw_len, stored_len, codec)
    payload_offset: int


def checksum(*parts) -> int:
    """The chunk checksum (xxh3-64) of the parts' concatenation, without joining them."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """Digest of a tensor's raw bits (xxh3-128, hex): proves a receiver holds exact bits."""
    b = bits(t.contiguous()) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return xxhash.xxh3_128_hexdigest(memoryview(b.numpy()).cast("B"))


def assemble_chunk(name: str, kind: Kind, info: DType, gm: GapMode, vm: ValueMode, lay: Layout, numel: int,
                   lo: int, hi: int, count: int, streams: list[Stream]) -> bytes:
    """Header, stream table, name, payloads and checksum: the chunk's bytes."""
    name_b = name.encode()
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, int(kind), info.code, int(gm), int(vm), int(lay),
                      len(name_b), numel, lo, hi, count, len(streams))
    parts = [head, *(_STREAM.pack(r, len(p), c) for r, p, c in streams), name_b, *(p for _, p, _ in streams)]
    parts.append(_SUM.pack(checksum(*parts)))  # the body's checksum without joining it first: one copy, not two
    return b"".join(parts)


def _stream_specs(gm: GapMode, lay: Layout, info: DType, count: int, span: int) -> list[tuple[int, bool, tuple]]:
    """(limit on raw length, exact?, allowed codecs) for every stream a header must declare, in order."""
    specs = [] if gm == GapMode.DENSE else [(gap_bound(gm, count, span), False, (STORED, ZSTD))]
    if lay == Layout.PLANES:
        specs += [(count, True, (STORED, ZSTD))] * info.width
    else:
        specs += [(count, True, (RANS,)), (count * info.width, False, (STORED, ZSTD))]
    return specs


def parse_header(buf: bytes | memoryview, verify: bool = True) -> ChunkHeader:
    """Verify the checksum and every header field; raise ChunkError naming the problem."""
    mv = memoryview(buf)
    if len(mv) < _HEAD.size + _SUM.size:
        raise ChunkError(f"truncated chunk ({len(mv)} bytes)")
    if bytes(mv[:4]) != MAGIC:
        raise ChunkError("not a nemo-dcr chunk (bad magic)")
    _, ver, kind, dcode, gm, vm, lay, nlen, numel, lo, hi, count, nstreams = _HEAD.unpack_from(mv)
    if ver != FORMAT_VERSION:
        raise ChunkError(f"unsupported chunk format version {ver} (this build reads {FORMAT_VERSION})")
    if verify and _SUM.unpack_from(mv, len(mv) - _SUM.size)[0] != checksum(mv[:-_SUM.size]):
        raise ChunkError("chunk checksum mismatch (corrupt or truncated)")
    try:
        kind, gm, vm, lay = Kind(kind), GapMode(gm), ValueMode(vm), Layout(lay)
    except ValueError as exc:
        raise ChunkError(f"bad chunk header field: {exc}") from None
    if dcode not in BY_CODE:
        raise ChunkError(f"unknown dtype code {dcode}")
    info = BY_CODE[dcode]
    if vm == ValueMode.ULP and (kind != Kind.XOR or not info.is_float):
        raise ChunkError("ulp coding on a non-float or overwrite chunk")
    if not (lo <= hi <= numel) or count > hi - lo:
        raise ChunkError(f"bad range [{lo}, {hi}) / count {count} for {numel} elements")
    if gm == GapMode.DENSE and count != hi - lo:
        raise ChunkError("dense chunk does not cover its range")
    specs = _stream_specs(gm, lay, info, count, hi - lo)
    if nstreams != len(specs):
        raise ChunkError(f"chunk has {nstreams} streams, expected {len(specs)}")
    off = _HEAD.size
    streams = []
    for s, (limit, exact, codecs) in enumerate(specs):
        if off + _STREAM.size > len(mv):
            raise ChunkError("truncated stream table")
        raw, stored, codec = _STREAM.unpack_from(mv, off)
        off += _STREAM.size
        if codec not in codecs or (codec == STORED and raw != stored):
            raise ChunkError(f"stream {s}: bad codec {codec}")
        if raw != limit if exact else raw > limit:
            raise ChunkError(f"stream {s} declares {raw} bytes (limit {limit})")
        streams.append((raw, stored, codec))
    if nlen > MAX_NAME or off + nlen > len(mv):
        raise ChunkError("bad tensor name length")
    try:
        name = bytes(mv[off:off + nlen]).decode()
    except UnicodeDecodeError:
        raise ChunkError("tensor name is not UTF-8") from None
    off += nlen
    if off + sum(s[1] for s in streams) + _SUM.size != len(mv):
        raise ChunkError("chunk length does not match its stream table (truncated or padded)")
    return ChunkHeader(name, kind, info, gm, vm, lay, numel, lo, hi, count, tuple(streams), off)


def chunk_end(mv: memoryview, off: int) -> int | None:
    """Where the chunk starting at `off` ends (its header and stream table give its length),
    or None while those are not all there yet; ChunkError if no chunk starts at `off`."""
    if len(mv) - off < 4:
        return None
    if bytes(mv[off:off + 4]) != MAGIC:
        raise ChunkError(f"no chunk at offset {off} (corrupt)")
    if len(mv) - off < _HEAD.size:
        return None
    *_, nlen, _numel, _lo, _hi, _count, nstreams = _HEAD.unpack_from(mv, off)
    end = off + _HEAD.size + nstreams * _STREAM.size
    if end > len(mv):
        return None
    stored = sum(_STREAM.unpack_from(mv, off + _HEAD.size + i * _STREAM.size)[1] for i in range(nstreams))
    return end + nlen + stored + _SUM.size


def split_chunks(blob: bytes | memoryview) -> list[memoryview]:
    """The chunks of a blob of chunks written back to back (a part object): each one's length
    comes from its own header and stream table; parse_header still verifies every chunk."""
    mv = memoryview(blob)
    out, off = [], 0
    while off < len(mv):
        end = chunk_end(mv, off)
        if end is None:
            raise ChunkError(f"truncated chunk header at offset {off} of {len(mv)}")
        if end > len(mv):
            raise ChunkError(f"chunk at offset {off} runs past the end ({end} > {len(mv)} bytes: truncated)")
        out.append(mv[off:end])
        off = end
    return out
