"""Chunk decoding: verify, decode and apply one chunk.

The checksum is verified first and every field bounds-checked (format.parse_header) before
anything is written, so a corrupt or hostile chunk raises `ChunkError` and leaves the target
untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

import numpy as np
import torch
import zstandard

from nemo_dcr_callback.codec import context
from nemo_dcr_callback.codec.format import (
    RANS,
    ZSTD,
    ChunkError,
    ChunkHeader,
    Kind,
    Layout,
    ValueMode,
    parse_header,
)
from nemo_dcr_callback.codec.streams import (
    GapMode,
    StreamError,
    ans_decode,
    decode_gaps,
    from_format2,
    join_planes,
    join_tokens,
    token_values,
)
from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.core.bitops import scatter, scatter_many
from nemo_dcr_callback.core.rawbits import BITS_DTYPE, OP_OVERWRITE, OP_ULP, OP_XOR, bits, index_dtype

_tls = threading.local()


def _zd() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (zstandard objects are not thread-safe; one per chunk is slow)."""
    d = getattr(_tls, "zd", None)
    if d is None:
        d = _tls.zd = zstandard.ZstdDecompressor()
    return d


def _unzstd(data: memoryview, raw: int) -> np.ndarray:
    """One zstd stream of exactly `raw` bytes; ChunkError on anything else."""
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
    return np.frombuffer(dec, dtype=np.uint8)


def _streams(mv: memoryview, h: ChunkHeader) -> list[np.ndarray]:
    """The chunk's streams, zstd undone (rANS streams stay coded: the layout decodes them;
    a format 2 chunk's get format 3's tables)."""
    out, off = [], h.payload_offset
    for raw, stored, codec in h.streams:
        data = mv[off:off + stored]
        off += stored
        if codec == ZSTD:
            out.append(_unzstd(data, raw))
        elif codec == RANS and h.version == 2:
            out.append(from_format2(data))
        else:
            out.append(np.frombuffer(data, dtype=np.uint8))
    return out


@dataclass
class _Batch:
    """A decoded batch's arrays, shared by its members' DecodedChunks: apply_all writes a run
    of them in one compiled call from pointer arithmetic, without a torch call per member."""
    positions: torch.Tensor  # every member's positions, each relative to its own tensor
    values: torch.Tensor
    starts: np.ndarray  # member i's changes are [starts[i], starts[i + 1])


class DecodedChunk:
    """One tensor's decoded changes. A batch member's positions and values are views of the
    batch's arrays, made only when asked for: apply_all writes a batch without them, and a
    view per member cost more than a small member's writes."""

    __slots__ = ("header", "_positions", "_values", "batch", "index")

    def __init__(self, header: ChunkHeader, positions: torch.Tensor | None, values: torch.Tensor | None,
                 batch: _Batch | None = None, index: int = 0):
        self.header, self._positions, self._values, self.batch, self.index = header, positions, values, batch, index

    def _of_batch(self, arr: torch.Tensor) -> torch.Tensor:
        return arr[int(self.batch.starts[self.index]):int(self.batch.starts[self.index + 1])]

    @property
    def positions(self) -> torch.Tensor:
        """Flat positions (int32/int64), strictly increasing."""
        if self._positions is None:
            self._positions = self._of_batch(self.batch.positions)
        return self._positions

    @property
    def values(self) -> torch.Tensor:
        """In the chunk's coding: XOR bits, zig-zag ulp or new bits."""
        if self._values is None:
            self._values = self._of_batch(self.batch.values)
        return self._values

    @property
    def op(self) -> int:
        h = self.header
        if h.kind == Kind.OVERWRITE:
            return OP_OVERWRITE
        return OP_ULP if h.value_mode == ValueMode.ULP else OP_XOR


_NUMEL, _COUNT, _INDEX_OF, _HEADER = attrgetter("numel"), attrgetter("count"), attrgetter("index"), attrgetter("header")

OldBits = Callable[[ChunkHeader], torch.Tensor]  # a tensor's header -> the receiver's flat tensor


def _decode(mv: memoryview, h: ChunkHeader, old: OldBits | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, values) of every change the chunk carries (a batch: in its concatenation)."""
    try:
        st = _streams(mv, h)
        idt = index_dtype(h.numel)
        if h.classes:
            return _decode_context(h, st, old, idt)
        if h.gap_mode == GapMode.DENSE:
            pos = torch.arange(h.lo, h.hi, dtype=idt)
        else:
            pos = decode_gaps(st.pop(0), h.gap_mode, h.count, h.lo, h.hi, idt)
        bdt = BITS_DTYPE[h.dtype.width]
        if h.layout == Layout.PLANES:
            vals = join_planes(np.concatenate(st) if st else np.empty(0, np.uint8), h.count, bdt)
        elif h.streams[-2][2] == RANS:
            vals = token_values(st[0], h.count, st[1], bdt)
        else:  # tokens stored as they are (a handful of changes: a rANS table would cost more)
            vals = join_tokens(st[0], st[1], bdt)
    except StreamError as exc:
        raise ChunkError(f"chunk for {h.name or f'{len(h.members)} tensors'!r}: {exc}") from None
    return pos, vals


def _old_view(t: torch.Tensor) -> torch.Tensor:
    """The receiver's old tensor flat: its bits, or its exponent bytes as a GPU receiver
    reads them (context.exponent_bytes)."""
    return t.reshape(-1) if t.dtype == torch.uint8 else bits(t).reshape(-1)


def _decode_context(h: ChunkHeader, st: list[np.ndarray], old: OldBits | None,
                    idt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A context-coded chunk: the classes come from the old bits of its whole range."""
    what = h.name or f"{len(h.members)} tensors"
    if old is None:
        raise ChunkError(f"chunk for {what!r} is context-coded: decoding it needs the receiver's old bits, and "
                         "this path does not pass them")
    # the receiver's tensors as they are (the compiled walk reads their bytes; a bit view per
    # tensor was most of a batch's decode on models of many small tensors)
    if h.members:
        segments = [old(m) for m in h.members]
        for m, t in zip(h.members, segments, strict=True):
            if t.numel() != m.numel:
                raise ChunkError(f"chunk for {what!r}: member {m.name!r} spans {m.numel} positions, the receiver's "
                                 f"tensor holds {t.numel()}")
    else:
        segments = [old(h).reshape(-1)[h.lo:h.hi]]
    held = sum(t.numel() for t in segments)
    if held != h.hi - h.lo:
        raise ChunkError(f"chunk for {what!r} spans {h.hi - h.lo} positions, the receiver's tensor(s) hold {held}")
    k = h.classes
    raw = [s[0] for s in h.streams]
    rans = [s[2] == RANS for s in h.streams]
    cmap, esc = (ans_decode(st[i], raw[i]) if rans[i] else st[i] for i in (0, -1))
    coded = [(st[i], raw[i], rans[i]) for i in range(1, 1 + 2 * k)]
    # the walk numbers positions within the chunk's range; a tensor's chunk after its first
    # starts at lo (a batch's members are cut from the concatenation by decode_parts)
    lo = 0 if h.members else h.lo
    got = context.join_coded(cmap, segments, h.dtype.name, coded[:k], coded[k:], esc, BITS_DTYPE[h.dtype.width], idt,
                             lo)
    if got is None:  # no compiled library: stream by stream
        dec = [ans_decode(s, r) if c else s for s, r, c in coded]
        pos, vals = context.join_old(cmap, [_old_view(t) for t in segments], h.dtype.name, dec[:k], dec[k:], esc,
                                     BITS_DTYPE[h.dtype.width], idt)
        got = (pos + lo if lo else pos), vals
    return got


def decode_chunk(buf: bytes | memoryview, header: ChunkHeader | None = None, old: OldBits | None = None
                 ) -> DecodedChunk:
    """Verify and decode a one-tensor chunk; raises ChunkError on anything malformed (and on a
    batched chunk: decode_parts decodes those).

    Memory is bounded by the header's count (<= numel): callers that know the target check
    the header against it first (apply_chunk does), so a hostile numel never allocates.
    """
    mv = memoryview(buf)
    h = header or parse_header(mv)
    if h.batched:
        raise ChunkError(f"a batched chunk of {len(h.members)} tensors (decode it with decode_parts)")
    pos, vals = _decode(mv, h, old)
    return DecodedChunk(h, pos, vals)


def decode_parts(buf: bytes | memoryview, header: ChunkHeader | None = None, old: OldBits | None = None
                 ) -> list[DecodedChunk]:
    """Verify and decode a chunk into one DecodedChunk per tensor it writes (a batched chunk's
    members, each in its own tensor's positions; else the chunk itself). old: a tensor's
    header -> the receiver's flat tensor, which a context-coded chunk needs (read only)."""
    mv = memoryview(buf)
    h = header or parse_header(mv)
    if not h.batched:
        return [decode_chunk(mv, h, old)]
    pos, vals = _decode(mv, h, old)
    # Vectorized over the members: a batch holds hundreds of small tensors, and a torch op
    # per member cost more than decoding the whole batch.
    ms = h.members
    numels = np.fromiter(map(_NUMEL, ms), np.int64, len(ms))
    counts = np.fromiter(map(_COUNT, ms), np.int64, len(ms))
    ends = np.cumsum(numels)  # members are concatenated in order (the table parser checks it)
    offs = ends - numels
    p = pos.numpy()
    cut = np.searchsorted(p, ends)
    held = np.diff(cut, prepend=0)
    bad = np.flatnonzero(held != counts)
    if bad.size:
        m = ms[int(bad[0])]
        raise ChunkError(f"batched chunk: member {m.name!r} declares {m.count} changes, its range holds "
                         f"{int(held[bad[0]])} (corrupt chunk)")
    # Each member's positions made relative to its own tensor, in place and in the decoder's
    # index type (the batch's: its members are smaller): passes over every change, so as few
    # and as narrow as can be.
    np.subtract(p, np.repeat(offs.astype(p.dtype), counts), out=p)
    b = _Batch(pos, vals, np.concatenate([[0], cut]).astype(np.int64))
    return list(map(DecodedChunk, ms, repeat(None), repeat(None), repeat(b), range(len(ms))))


def check_target(h: ChunkHeader, target: torch.Tensor, name: str | None) -> None:
    """ChunkError unless the chunk is for this tensor (name, dtype, element count)."""
    if name is not None and h.name != name:
        raise ChunkError(f"chunk is for tensor {h.name!r}, not {name!r}")
    if target.dtype != h.dtype.torch:
        raise ChunkError(f"chunk for {h.name!r} carries {h.dtype.name}, target is {target.dtype}")
    if target.numel() != h.numel:
        raise ChunkError(f"chunk for {h.name!r} spans {h.numel} elements, target has {target.numel()}")


def apply_decoded(d: DecodedChunk, target: torch.Tensor) -> None:
    """Write a decoded (hence verified) chunk into target in place."""
    scatter(target, d.positions, d.values, d.op)


def apply_all(decoded: list[DecodedChunk], targets: list[torch.Tensor]) -> None:
    """apply_decoded for each (decoded chunk, target) pair. A run of one batch's members goes
    to the compiled scatter in one call, its pointers computed from the batch's arrays; the
    rest through core.bitops.scatter_many. A checkpoint's hundreds of small tensors made the
    torch and ctypes calls per tensor cost more than their writes."""
    if len(decoded) != len(targets):
        raise ValueError(f"{len(decoded)} decoded chunks for {len(targets)} targets")
    lib = kernels.native()
    rest: list[int] = []
    i, n = 0, len(decoded)
    while i < n:
        b = decoded[i].batch
        j = i + 1
        while j < n and decoded[j].batch is b and b is not None:
            j += 1
        if b is None or lib is None or j - i < 2 or not _run_to_native(lib, decoded, targets, i, j, b):
            rest += range(i, j)
        i = j
    if rest:
        scatter_many([(targets[k], decoded[k].positions, decoded[k].values, decoded[k].op) for k in rest])


def _run_to_native(lib, decoded: list[DecodedChunk], targets: list[torch.Tensor], i: int, j: int, b: _Batch) -> bool:
    """decoded[i:j], members of batch b, into their targets in one call; False (nothing
    written) where a target is not a contiguous host tensor of the batch's width."""
    w = b.values.element_size()
    ts = targets[i:j]
    if not all(t.is_cpu and t.is_contiguous() and t.element_size() == w for t in ts):
        return False
    m = j - i
    run = decoded[i:j]
    idx = np.fromiter(map(_INDEX_OF, run), np.int64, m)
    numels = np.fromiter(map(torch.Tensor.numel, ts), np.int64, m)
    if np.any(numels != np.fromiter(map(_NUMEL, map(_HEADER, run)), np.int64, m)):
        return False  # the per-member path refuses it with the tensor named
    ptrs = np.fromiter(map(torch.Tensor.data_ptr, ts), np.int64, m)
    start = b.starts[idx]
    pos_ptrs = b.positions.data_ptr() + start * b.positions.element_size()
    val_ptrs = b.values.data_ptr() + start * w
    counts = b.starts[idx + 1] - start
    rc = lib.dcr_scatter_many(m, ptrs.ctypes.data, numels.ctypes.data, pos_ptrs.ctypes.data, val_ptrs.ctypes.data,
                              counts.ctypes.data, w, int(b.positions.dtype == torch.int64), decoded[i].op)
    if rc < 0:
        raise ChunkError(f"batched chunk: the compiled scatter refused its positions ({rc})")
    return True


def apply_chunk(buf: bytes | memoryview, target: torch.Tensor, name: str | None = None) -> ChunkHeader:
    """Verify, decode and apply one chunk to target (flat canonical tensor) in place.

    Raises ChunkError, with target untouched, on any corruption or mismatch.
    """
    h = parse_header(buf)
    if h.batched:
        raise ChunkError(f"a batched chunk of {len(h.members)} tensors, not one tensor's (apply its parts)")
    check_target(h, target, name)
    apply_decoded(decode_chunk(buf, h), target)
    return h
