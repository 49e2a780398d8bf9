"""The codec stage: self-describing, checksummed chunks of one tensor's changes.

A chunk covers a position range [lo, hi) of one tensor (flat, canonical coordinates) and
carries gap-coded positions plus values split into byte planes, each stream zstd-compressed
(or stored, if zstd does not help). Values are XOR bits, zig-zag signed ulp differences
(exact: the receiver has the old bits; about 0.9 bit per change cheaper on BF16 deltas), or
overwrite values (idempotent: residual conversions and retries). The encoder picks the gap
and value coding per chunk and flags the choice in the header. docs/FORMAT.md is the
byte-level specification; this module is its reference implementation.

Decoding verifies the checksum first and bounds-checks every field before anything is
written, so a corrupt or hostile chunk raises `ChunkError` and leaves the target untouched.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch
import xxhash
import zstandard

from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.codec.streams import (
    GapMode,
    StreamError,
    ans_encode,
    decode_gaps,
    encode_gaps,
    gap_bound,
    join_planes,
    split_planes,
    token_values,
    tokens,
    ulp_encode,
)
from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.core.bitops import (
    BITS_DTYPE,
    OP_OVERWRITE,
    OP_ULP,
    OP_XOR,
    SparseDelta,
    bits,
    index_dtype,
    scatter,
)

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


_tls = threading.local()


def _zc(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "zc", None)
    if cache is None:
        cache = _tls.zc = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _zd() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "zd", None)
    if d is None:
        d = _tls.zd = zstandard.ZstdDecompressor()
    return d


def _pack_stream(raw, level: int) -> tuple[bytes, int]:
    """zstd a stream unless that does not make it smaller (then store it)."""
    if len(raw) == 0:
        return b"", STORED
    comp = _zc(level).compress(raw)
    if len(comp) < len(raw):
        return comp, ZSTD
    return bytes(raw), STORED


def entropy_bits(hist: np.ndarray) -> float:
    """Total order-0 information of the symbols counted in hist, in bits."""
    h = hist[hist > 0].astype(np.float64)
    n = h.sum()
    return float(-(h * np.log2(h / n)).sum()) if n else 0.0


def values_info_bits(values: torch.Tensor) -> float:
    """Order-0 information (bits) of raw values of any width: the value part of the bound."""
    w = values.element_size()
    u = values.contiguous().numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[w])
    if w <= 2:
        return entropy_bits(np.bincount(u, minlength=1 << (8 * w)))
    return entropy_bits(np.unique(u, return_counts=True)[1])


def delta_bound_bits(delta: SparseDelta) -> dict[str, float | None]:
    """Information bound of a delta, in bits: positions (n H(p)), XOR values, and ulp values
    (floats whose new values are known; else None)."""
    info = BY_TORCH.get(delta.dtype)
    ulp_ok = info is not None and info.is_float and info.width > 1
    out: dict[str, float | None] = {"positions": position_bound_bits(delta.count, delta.numel), "xor": 0.0,
                                    "ulp": 0.0 if ulp_ok else None}
    if delta.count:
        out["xor"] = values_info_bits(delta.xor)
        out["ulp"] = values_info_bits(ulp_encode(delta.xor, delta.new)) if ulp_ok and delta.new is not None else None
    return out


def position_bound_bits(count: int, numel: int) -> float:
    """n * H(p): the information in which positions changed (independent changes)."""
    if numel == 0 or count in (0, numel):
        return 0.0
    p = count / numel
    return numel * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


# --------------------------------------------------------------------------- chunks
def _value_streams(vals: torch.Tensor, vm: ValueMode, layout: Layout, new_values, level: int,
                   tokens_done=None) -> list[tuple[int, bytes, int]]:
    """(raw_len, stored bytes, codec) for each value stream of a coding and layout."""
    ulp = vm == ValueMode.ULP
    if layout == Layout.PLANES:
        count = vals.numel()
        planes = split_planes(ulp_encode(vals, new_values) if ulp else vals)
        out = []
        for b in range(vals.element_size()):
            plane = planes[b * count:(b + 1) * count]
            packed, codec = _pack_stream(plane, level)
            out.append((plane.size, packed, codec))
        return out
    tok, esc, _ = tokens_done or tokens(vals, ulp, new_values)
    epacked, ecodec = _pack_stream(esc, level)
    return [(tok.size, ans_encode(tok), RANS), (esc.size, epacked, ecodec)]


def encode_chunk(
    name: str,
    kind: Kind,
    dtype: torch.dtype,
    numel: int,
    lo: int,
    hi: int,
    positions: torch.Tensor | None,
    values: torch.Tensor,
    new_values: torch.Tensor | None = None,
    *,
    value_modes: tuple[ValueMode, ...] | None = None,
    layouts: tuple[Layout, ...] | None = None,
    gap_modes: tuple[GapMode, ...] | None = None,
    level: int = 1,
    exhaustive: bool = False,
    terms: list[int] | None = None,
) -> bytes:
    """Encode the changes of tensor `name` in [lo, hi) as one chunk.

    positions: sorted flat positions in [lo, hi), or None for every position (DENSE).
    values: raw bits (XOR values for Kind.XOR, new bits for Kind.OVERWRITE).
    new_values: the new bits at the same positions; enables ULP coding of XOR chunks.
    Candidates: value coding RAW/ULP (by estimated size: the tokens' order-0 information
    plus escaped values), layout TOKENS/PLANES (PLANES only when many values escape), gap
    coding GAP8/GAP16 (by mean gap, both tried in between); exhaustive=True encodes every
    value candidate and keeps the smallest. The choice is flagged in the header.
    terms (XOR chunks with new_values): [old, new] digest sums (digest.py) of the changed
    elements, added to in place, so a sender moves its digests without a second pass.
    With the compiled library and the default candidates, an XOR chunk of floats takes the
    fused path (dcr_encode_xor: one call for gaps, tokens, rANS and digest terms).
    """
    info = dtype_info(dtype)
    if not 0 <= lo <= hi <= numel:
        raise ValueError(f"bad range [{lo}, {hi}) for {numel} elements")
    if len(name.encode()) > MAX_NAME:
        raise ValueError("tensor name too long")
    count = (hi - lo) if positions is None else positions.numel()
    if values.numel() != count or values.element_size() != info.width:
        raise ValueError("values do not match positions or dtype width")
    vals = bits(values.contiguous()) if values.numel() else values.reshape(-1)
    if positions is not None:
        positions = positions.contiguous()

    # Positions.
    if positions is None:
        gap_cands: tuple[GapMode, ...] = (GapMode.DENSE,)
    elif gap_modes:
        gap_cands = gap_modes
    else:
        mean_gap = (hi - lo) / max(count, 1)
        gap_cands = ((GapMode.GAP8,) if mean_gap < 512 else
                     (GapMode.GAP8, GapMode.GAP16) if mean_gap < 8192 else (GapMode.GAP16,))
    if terms is not None and (kind != Kind.XOR or new_values is None):
        raise ValueError("digest terms need an XOR chunk with its new values")
    fused = None
    lib = kernels.native()
    if (lib is not None and kind == Kind.XOR and positions is not None and new_values is not None and count
            and info.is_float and info.width > 1 and value_modes is None and layouts is None and not exhaustive
            and GapMode.DENSE not in gap_cands):
        fused = _fused_xor(lib, positions, vals, bits(new_values.contiguous()), lo, hi,
                           GapMode.GAP8 in gap_cands, terms)
    elif terms is not None and count:
        nb = bits(new_values.contiguous())
        pos64 = positions.to(torch.int64).numpy() if positions is not None else np.arange(lo, hi, dtype=np.int64)
        terms[0] = (terms[0] + digest.sum64(nb ^ vals, pos64)) & digest.MASK
        terms[1] = (terms[1] + digest.sum64(nb, pos64)) & digest.MASK
    gap_streams: list[tuple[int, bytes, int]] = []
    gm = gap_cands[0]
    for cand in gap_cands:
        if cand == GapMode.DENSE:
            break
        raw = fused[0] if fused is not None and cand == GapMode.GAP8 else encode_gaps(positions, lo, hi, cand)
        packed, codec = _pack_stream(raw, level)
        if not gap_streams or len(packed) < len(gap_streams[0][1]):
            gm, gap_streams = cand, [(raw.size, packed, codec)]
    if fused is not None and fused[1] is not None:
        _, vm, ans_b, esc = fused
        return _fused_chunk(name, info, gm, gap_streams, vm, ans_b, esc, numel, lo, hi, count, level)

    # Values: one pass makes the tokens of the likely coding (ULP for floats) and the
    # histograms of both, then the estimate decides.
    if value_modes is None:
        ulp_ok = kind == Kind.XOR and info.is_float and info.width > 1 and new_values is not None
        value_modes = (ValueMode.RAW, ValueMode.ULP) if ulp_ok else (ValueMode.RAW,)
    nv = bits(new_values.contiguous()) if ValueMode.ULP in value_modes else None
    first = ValueMode.ULP if ValueMode.ULP in value_modes else ValueMode.RAW
    done = tokens(vals, first == ValueMode.ULP, nv)
    hist = done[2]
    est = {vm: entropy_bits(hist[int(vm)]) / 8 + int(hist[int(vm), 255]) * info.width
           for vm in value_modes}
    modes = sorted(value_modes, key=est.get) if exhaustive else [min(value_modes, key=est.get)]
    if layouts is None:
        many_escapes = int(hist[int(modes[0]), 255]) * 16 > max(count, 1)
        layouts = (Layout.TOKENS, Layout.PLANES) if exhaustive or many_escapes else (Layout.TOKENS,)
    best = None
    for vm in modes:
        for lay in layouts:
            st = _value_streams(vals, vm, lay, nv, level, done if vm == first else None)
            size = sum(len(p) for _, p, _ in st)
            if best is None or size < best[0]:
                best = (size, vm, lay, st)
    _, vm, lay, val_streams = best
    return _assemble(name, kind, info, gm, vm, lay, numel, lo, hi, count, gap_streams + val_streams)


def _scratch(role: str, n: int, dtype=np.uint8) -> tuple[np.ndarray, int]:
    """This thread's reusable output buffer `role` for the fused encoder, and its address (its
    outputs are copied or compressed out before the thread's next chunk): no allocation and no
    fresh pages per chunk. numpy with the address kept, not torch: the encoder's Python wrapper
    is paid per chunk (16 -> 10 us on a small chunk with numpy, less with the address kept)."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    got = bufs.get(role)
    if got is None or got[0].size < n:
        a = np.empty(max(n, (1 << 16) // np.dtype(dtype).itemsize), dtype=dtype)  # at least 64 KiB
        got = bufs[role] = (a, a.ctypes.data)
    return got


def _fused_xor(lib, positions: torch.Tensor, vals: torch.Tensor, nv: torch.Tensor, lo: int, hi: int,
               gap8: bool, terms: list[int] | None):
    """dcr_encode_xor: (GAP8 stream or None, value mode, token stream, escapes), with value
    mode None when many values escape (the caller then codes the values the generic way;
    the digest terms are added either way). The gap and escape streams view this thread's
    scratch: valid until its next call."""
    count, w = vals.numel(), vals.element_size()
    gcap = gap_bound(GapMode.GAP8, count, hi - lo) if gap8 else 0
    acap = lib.dcr_ans_bound(count)
    gaps, gptr = _scratch("gaps", gcap)
    ans, aptr = _scratch("ans", acap)
    esc, eptr = _scratch("esc", count * w)
    out, optr = _scratch("out", 6, np.int64)  # [gap bytes, rANS bytes, escapes, ulp?] + the digest sums
    out[4] = out[5] = 0  # the encoder adds the digest sums
    rc = lib.dcr_encode_xor(positions.data_ptr(), int(positions.dtype == torch.int64), vals.data_ptr(),
                            nv.data_ptr(), count, w, lo, hi, int(gap8), gptr, gcap, aptr, acap, eptr, optr,
                            0 if terms is None else optr + 32)
    if rc not in (0, -10):
        raise ValueError(f"positions not sorted within [{lo}, {hi}) ({rc})" if rc == -2 else f"fused encoder: {rc}")
    ng, na, ne, ulp, s_old, s_new = out[:6].tolist()
    if terms is not None:  # (the sums are uint64; tolist reads them signed: the mask takes them back)
        terms[0] = (terms[0] + s_old) & digest.MASK
        terms[1] = (terms[1] + s_new) & digest.MASK
    g = gaps[:ng] if gap8 else None
    if rc == -10:
        return g, None, None, None
    return g, ValueMode(ulp), ans[:na].tobytes(), esc[:ne * w]


def _fused_chunk(name: str, info: DType, gm: GapMode, gap_streams: list, vm: ValueMode, ans: bytes, esc,
                 numel: int, lo: int, hi: int, count: int, level: int) -> bytes:
    """An XOR chunk in the TOKENS layout from the fused encoder's streams (the gap stream(s)
    already packed, the rANS tokens, the escapes zstd-packed here)."""
    epacked, ecodec = _pack_stream(esc, level)
    return _assemble(name, Kind.XOR, info, gm, vm, Layout.TOKENS, numel, lo, hi, count,
                     gap_streams + [(count, ans, RANS), (esc.size, epacked, ecodec)])


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
    spos, sp = _scratch("slice_pos", count, np.int64)
    _, sxp = _scratch("slice_xor", count * w)
    _, snp = _scratch("slice_new", count * w)
    gaps, gp = _scratch("slice_gaps", gcap)
    ans, ap = _scratch("slice_ans", acap)
    esc, ep = _scratch("slice_esc", count * w)
    rec, rp = _scratch("slice_rec", _REC * chunks, np.int64)
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
        chunk = _fused_chunk(names[cid], info, GapMode.GAP8, [(g.size, *_pack_stream(g, level))], ValueMode(ulp),
                             ans[ao:ao + al].tobytes(), esc[eo * w:(eo + ne) * w], int(numels[cid]), lo, hi, c, level)
        if not out or out[-1][0] != cid:
            out.append((cid, [], 0, [0, 0]))
        cid, cs, total, terms = out[-1]
        cs.append(chunk)
        terms[0], terms[1] = (terms[0] + s_old) & digest.MASK, (terms[1] + s_new) & digest.MASK
        out[-1] = (cid, cs, total + c, terms)
    return out


def _assemble(name: str, kind: Kind, info: DType, gm: GapMode, vm: ValueMode, lay: Layout, numel: int, lo: int,
              hi: int, count: int, streams: list[tuple[int, bytes, int]]) -> bytes:
    name_b = name.encode()
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, int(kind), info.code, int(gm), int(vm), int(lay),
                      len(name_b), numel, lo, hi, count, len(streams))
    parts = [head, *(_STREAM.pack(r, len(p), c) for r, p, c in streams), name_b, *(p for _, p, _ in streams)]
    parts.append(_SUM.pack(checksum(*parts)))  # the body's checksum without joining it first: one copy, not two
    return b"".join(parts)


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
    # (limit on raw length, exact?, allowed codecs) for every stream, in order.
    specs = [] if gm == GapMode.DENSE else [(gap_bound(gm, count, hi - lo), False, (STORED, ZSTD))]
    if lay == Layout.PLANES:
        specs += [(count, True, (STORED, ZSTD))] * info.width
    else:
        specs += [(count, True, (RANS,)), (count * info.width, False, (STORED, ZSTD))]
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


def _streams(mv: memoryview, h: ChunkHeader) -> list[np.ndarray]:
    out, off = [], h.payload_offset
    for raw, stored, codec in h.streams:
        data = mv[off:off + stored]
        off += stored
        if codec == ZSTD:
            try:
                # a frame that declares more than the header's raw size is refused before
                # anything is allocated (a crafted size must not become a huge allocation)
                declared = zstandard.frame_content_size(data)
                if declared > raw:
                    raise ChunkError(f"zstd stream declares {declared} bytes, the header {raw}")
                dec = _zd().decompress(data, max_output_size=raw)
            except (zstandard.ZstdError, MemoryError) as exc:
                raise ChunkError(f"zstd stream corrupt: {type(exc).__name__} {exc}") from None
            if len(dec) != raw:
                raise ChunkError("zstd stream has the wrong length")
            out.append(np.frombuffer(dec, dtype=np.uint8))
        else:  # stored, or rANS (decoded by the layout's own decoder)
            out.append(np.frombuffer(data, dtype=np.uint8))
    return out


@dataclass
class DecodedChunk:
    header: ChunkHeader
    positions: torch.Tensor  # flat positions (int32/int64), strictly increasing
    values: torch.Tensor  # in the chunk's coding: XOR bits, zig-zag ulp or new bits

    @property
    def op(self) -> int:
        h = self.header
        if h.kind == Kind.OVERWRITE:
            return OP_OVERWRITE
        return OP_ULP if h.value_mode == ValueMode.ULP else OP_XOR


def decode_chunk(buf: bytes | memoryview, header: ChunkHeader | None = None) -> DecodedChunk:
    """Verify and decode a chunk; raises ChunkError on anything malformed.

    Memory is bounded by the header's count (<= numel): callers that know the target check
    the header against it first (apply_chunk does), so a hostile numel never allocates.
    """
    mv = memoryview(buf)
    h = header or parse_header(mv)
    try:
        st = _streams(mv, h)
        idt = index_dtype(h.numel)
        if h.gap_mode == GapMode.DENSE:
            pos = torch.arange(h.lo, h.hi, dtype=idt)
        else:
            pos = decode_gaps(st.pop(0), h.gap_mode, h.count, h.lo, h.hi, idt)
        bdt = BITS_DTYPE[h.dtype.width]
        if h.layout == Layout.PLANES:
            vals = join_planes(np.concatenate(st) if st else np.empty(0, np.uint8), h.count, bdt)
        else:
            vals = token_values(st[0], h.count, st[1], bdt)
    except StreamError as exc:
        raise ChunkError(f"chunk for {h.name!r}: {exc}") from None
    return DecodedChunk(h, pos, vals)


def check_target(h: ChunkHeader, target: torch.Tensor, name: str | None) -> None:
    if name is not None and h.name != name:
        raise ChunkError(f"chunk is for tensor {h.name!r}, not {name!r}")
    if target.dtype != h.dtype.torch:
        raise ChunkError(f"chunk for {h.name!r} carries {h.dtype.name}, target is {target.dtype}")
    if target.numel() != h.numel:
        raise ChunkError(f"chunk for {h.name!r} spans {h.numel} elements, target has {target.numel()}")


def apply_decoded(d: DecodedChunk, target: torch.Tensor) -> None:
    """Write a decoded (hence verified) chunk into target in place."""
    scatter(target, d.positions, d.values, d.op)


def apply_chunk(buf: bytes | memoryview, target: torch.Tensor, name: str | None = None) -> ChunkHeader:
    """Verify, decode and apply one chunk to target (flat canonical tensor) in place.

    Raises ChunkError, with target untouched, on any corruption or mismatch.
    """
    h = parse_header(buf)
    check_target(h, target, name)
    apply_decoded(decode_chunk(buf, h), target)
    return h


# ---------------------------------------------------------------- tensor helpers
def split_ranges(positions: torch.Tensor, numel: int, span: int = DEFAULT_CHUNK_SPAN):
    """Yield (lo, hi, start, end): position-range chunks and their slice of positions."""
    if numel == 0:
        return
    if numel <= span:  # one range (most tensors): no search
        yield 0, numel, 0, positions.numel()
        return
    bounds = torch.arange(0, numel + span, span, dtype=torch.int64).clamp_(max=numel)
    idx = torch.searchsorted(positions.to(torch.int64), bounds).tolist()
    b = bounds.tolist()
    for i in range(len(b) - 1):
        if b[i] < b[i + 1]:
            yield b[i], b[i + 1], idx[i], idx[i + 1]


def encode_sparse(name: str, kind: Kind, dtype: torch.dtype, numel: int, positions: torch.Tensor,
                  values: torch.Tensor, new_values: torch.Tensor | None = None, *,
                  span: int = DEFAULT_CHUNK_SPAN, level: int = 1,
                  value_modes: tuple[ValueMode, ...] | None = None, terms: list[int] | None = None) -> list[bytes]:
    """Chunks for sorted positions of one tensor (split into ranges of `span` positions);
    terms as in encode_chunk."""
    out = []
    for lo, hi, s, e in split_ranges(positions, numel, span):
        if e > s:
            out.append(encode_chunk(name, kind, dtype, numel, lo, hi, positions[s:e], values[s:e],
                                    None if new_values is None else new_values[s:e],
                                    value_modes=value_modes, level=level, terms=terms))
    return out


def encode_delta(name: str, delta: SparseDelta, new_tensor: torch.Tensor | None = None, *,
                 span: int = DEFAULT_CHUNK_SPAN, level: int = 1,
                 value_modes: tuple[ValueMode, ...] | None = None, terms: list[int] | None = None) -> list[bytes]:
    """XOR chunks for one tensor's delta. The new values (for ulp coding) come from
    delta.new, or are gathered from new_tensor (the tensor's new bits) if given; terms as in
    encode_chunk."""
    new = delta.new
    if new is None and new_tensor is not None:
        new = bits(new_tensor)[delta.positions.to(torch.int64)]
    return encode_sparse(name, Kind.XOR, delta.dtype, delta.numel, delta.positions, delta.xor, new,
                         span=span, level=level, value_modes=value_modes, terms=terms)


def encode_overwrite(name: str, tensor: torch.Tensor, positions: torch.Tensor | None = None, *,
                     span: int = DEFAULT_CHUNK_SPAN, level: int = 1) -> list[bytes]:
    """Overwrite chunks carrying the tensor's bits at positions (None: every position)."""
    nb = bits(tensor)
    n = nb.numel()
    out = []
    if positions is None:
        for lo in range(0, n, span):
            hi = min(n, lo + span)
            out.append(encode_chunk(name, Kind.OVERWRITE, tensor.dtype, n, lo, hi, None, nb[lo:hi], level=level))
        return out
    return encode_sparse(name, Kind.OVERWRITE, tensor.dtype, n, positions, nb[positions.to(torch.int64)],
                         span=span, level=level)
