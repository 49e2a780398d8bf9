"""Context-modelled coding: code what the receiver cannot guess from the bits it holds.

The order-0 coding treats every position alike, but an optimizer step of about lr moves a
small float past half an ulp far more often than a large one, and the receiver knows every
old value. So positions are split into classes by the old value's exponent, and each class
is coded on its own: the changed positions as gaps in that class's own position order (so
a class that changes 1 in 3 and one that changes 1 in 1000 each get their own gap
statistics), and the changed values' tokens with that class's own table. The decoder reads
the old exponent at every position of the chunk's range to rebuild the classes, the cost
this coding pays for its size (docs/FORMAT.md, docs/PERFORMANCE.md).

Streams of a context-coded chunk, in order: the class map (the class of each exponent
value: 2^E bytes), per class its gap stream (GAP8 over the class's positions), per class its
token stream (byte tokens of the values, as in the TOKENS layout), then the escapes of all
values in position order.
"""

from __future__ import annotations

import numpy as np
import torch

from nemo_dcr_callback.codec.streams import (
    ANS_ERRORS,
    GAP_ERRORS,
    GapMode,
    StreamError,
    decode_gaps,
    encode_gaps,
    escape_width,
    join_tokens,
)
from nemo_dcr_callback.core import kernels

MAX_CLASSES = 16
# the sender's class choice looks at SAMPLE_BLOCK positions of every SAMPLE_EVERY (1/16)
SAMPLE_BLOCK, SAMPLE_EVERY = 4096, 65536
# (shift, bits) of the exponent field per float width: BF16 and F16 differ at width 2
_EXPONENT = {"BF16": (7, 8), "F16": (10, 5), "F32": (23, 8)}


def supported(dtype_name: str) -> bool:
    return dtype_name in _EXPONENT


def exponent_field(dtype_name: str) -> tuple[int, int]:
    """(shift, bits) of a float dtype's exponent field."""
    return _EXPONENT[dtype_name]


def map_size(dtype_name: str) -> int:
    return 1 << _EXPONENT[dtype_name][1]


def exponents(old_bits: torch.Tensor, dtype_name: str) -> np.ndarray:
    """The exponent field of every old value (sign dropped), as small integers (uint8 input:
    exponent_bytes' output, already that)."""
    if old_bits.dtype == torch.uint8:
        return old_bits.numpy()
    shift, nbits = _EXPONENT[dtype_name]
    u = old_bits.numpy().view({2: np.uint16, 4: np.uint32}[old_bits.element_size()])
    return ((u >> shift) & ((1 << nbits) - 1)).astype(np.uint8)


_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def exponent_bytes(t: torch.Tensor) -> torch.Tensor:
    """The exponent field of every value of a tensor, flat, one byte each, computed where the
    tensor lives: what a GPU receiver copies to the host for the decoder's walk (half the
    bytes of its BF16 bits, a quarter of FP32's), which decodes from it as from the bits."""
    if t.dtype not in _NAMES:
        raise ValueError(f"no exponent field to read in a {t.dtype} tensor")
    shift, nbits = _EXPONENT[_NAMES[t.dtype]]
    u = t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])
    return torch.bitwise_and(torch.bitwise_right_shift(u, shift), (1 << nbits) - 1).to(torch.uint8)


# the numbers of classes tried per chunk, fewest first (the first is one class: the plain cost)
CANDIDATES = (1, 2, 3, 4, 6, 8, 12, MAX_CLASSES)
# A class's tables as the estimate counts them, in bytes: its two streams' fixed parts (a
# table's first byte and bitmap, four rANS states) and per token that occurs its frequency.
# Tuned, not derived: the smallest versions of the refit benchmark's policy at 1% and 3%.
CLASS_BYTES, FREQ_BYTES = 80, 1.1
# More than 8 classes leave the decoder's walk that counts every class at once (about a fifth
# slower at 3%), so they are chosen only where they save this share of the best estimate with
# at most 8.
WIDE_GAIN = 0.03


def _rows_bits(h: np.ndarray) -> np.ndarray:
    """The order-0 information of each row of a matrix of histograms, in bits."""
    tot = h.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(h > 0, h * np.log2(np.where(h > 0, h, 1) / np.where(tot > 0, tot, 1)), 0.0)
    return -t.sum(axis=1)


def choose_classes(n: np.ndarray, exp_changed: np.ndarray, tok: np.ndarray, size: int
                   ) -> tuple[np.ndarray, float, float]:
    """(class of each exponent value, estimated bits of that coding, estimated bits with one
    class): exponents grouped by their change rate in this chunk (log-odds cut into even
    steps), n: positions per exponent (counted or estimated from a sample). The number of
    classes is the one whose estimate is smallest: each class's positions (n H(p)) and tokens
    (order 0), plus its two tables. One class is about what the plain coding costs."""
    c = np.bincount(exp_changed, minlength=size)[:size].astype(np.float64)
    n = np.maximum(n, c)  # a sample may miss an exponent that changed
    present = n > 0
    if not present.any():
        return np.zeros(size, dtype=np.uint8), 0.0, 0.0
    logit = np.log2((c + 0.5) / (n - c + 0.5))[present]
    th = np.bincount(exp_changed.astype(np.int64) * 256 + tok, minlength=size * 256).reshape(size, 256)
    th = th[present].astype(np.float64)  # (exponents that occur) x tokens
    # Every candidate at once (this runs per chunk): each exponent's class under each number of
    # classes (log-odds cut into even steps, then numbered densely: a class with no position
    # would cost streams for nothing), all candidates' classes numbered one after another.
    k = np.array(CANDIDATES)[:, None]
    lo, hi = logit.min(), logit.max()
    if hi - lo < 1e-9:
        raw = np.zeros((k.size, logit.size), dtype=np.int64)
    else:
        raw = np.minimum(((logit - lo) / (hi - lo) * k).astype(np.int64), k - 1)
    rows = np.arange(k.size)[:, None]
    used = np.zeros((k.size, MAX_CLASSES), dtype=bool)
    used[rows, raw] = True
    dense = np.cumsum(used, axis=1) - 1
    cls = dense[rows, raw]  # candidate x exponent -> class
    kk = used.sum(axis=1)
    start = np.concatenate([[0], np.cumsum(kk)[:-1]])
    gid = (cls + start[:, None]).ravel()
    total = int(kk.sum())
    nk = np.bincount(gid, weights=np.tile(n[present], k.size), minlength=total)
    ck = np.bincount(gid, weights=np.tile(c[present], k.size), minlength=total)
    member = np.zeros((total, logit.size))
    member[gid, np.tile(np.arange(logit.size), k.size)] = 1.0
    tk = member @ th  # every class's token histogram
    per_class = _rows_bits(np.stack([ck, nk - ck], axis=1)) + _rows_bits(tk) \
        + 8 * (CLASS_BYTES + FREQ_BYTES * np.count_nonzero(tk, axis=1))  # its positions, tokens, tables
    cost = np.add.reduceat(per_class, start)
    best = int(np.argmin(cost))
    narrow = np.flatnonzero(kk <= 8)
    narrow = int(narrow[np.argmin(cost[narrow])])  # one class is always a candidate
    if kk[best] > 8 and cost[best] > (1 - WIDE_GAIN) * cost[narrow]:
        best = narrow
    out = np.zeros(size, dtype=np.uint8)
    out[present] = cls[best]
    return out, float(cost[best]), float(cost[0])


def sample_plan(n: int) -> tuple[int, int]:
    """(block, every) of the class choice's sample of n positions: SAMPLE_BLOCK positions of
    every SAMPLE_EVERY, or every position of a short range (the compiled encoder takes the same)."""
    return SAMPLE_BLOCK, SAMPLE_EVERY if n >= 4 * SAMPLE_EVERY else SAMPLE_BLOCK


def sampled_counts(cur_bits: torch.Tensor, dtype_name: str) -> np.ndarray:
    """Positions per exponent value of a range's bits, estimated from a sample (the class
    choice needs only their proportions; the decoder never sees them). The numpy encoder's;
    the compiled one (dcr_ctx_encode) samples the same positions itself."""
    size = map_size(dtype_name)
    n = cur_bits.numel()
    block, every = sample_plan(n)
    idx = torch.arange(0, n, every).reshape(-1, 1) + torch.arange(block).reshape(1, -1)
    idx = idx.reshape(-1)
    idx = idx[idx < n]
    counts = np.bincount(exponents(cur_bits.reshape(-1)[idx], dtype_name), minlength=size)[:size].astype(np.float64)
    return counts * (n / max(idx.numel(), 1))


def _class_order(cls_all: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions grouped by class, each class's in increasing order; where each class starts)."""
    order = np.argsort(cls_all, kind="stable")  # a radix sort on bytes: linear in the range
    counts = np.bincount(cls_all, minlength=k)[:k]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return order, starts


def split(positions: np.ndarray, tok: np.ndarray, cls_map: np.ndarray, exp_all: np.ndarray
          ) -> tuple[int, list[np.ndarray], list[np.ndarray]]:
    """(number of classes, per class the GAP8 stream of its changes in its own position order,
    per class the tokens of its changes)."""
    k = int(cls_map.max()) + 1
    cls_all = cls_map[exp_all]
    order, starts = _class_order(cls_all, k)
    rank = np.empty(cls_all.size, dtype=np.int64)
    rank[order] = np.arange(cls_all.size, dtype=np.int64)
    cls_c = cls_all[positions]
    counts = np.bincount(cls_all, minlength=k)
    gaps, toks = [], []
    for j in range(k):
        sel = cls_c == j
        r = rank[positions[sel]] - starts[j]
        gaps.append(encode_gaps(torch.from_numpy(r), 0, int(counts[j]), GapMode.GAP8))
        toks.append(np.ascontiguousarray(tok[sel]))
    return k, gaps, toks


def join(cls_map: np.ndarray, exp_all: np.ndarray, gap_streams: list[np.ndarray], tok_streams: list[np.ndarray],
         esc: np.ndarray, bits_dtype: torch.dtype, idt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, values) from a context-coded chunk's streams (rANS undone) and the old
    exponents of its whole range; StreamError on anything that does not add up."""
    k = len(tok_streams)
    if cls_map.size and int(cls_map.max()) >= k:
        raise StreamError(f"class map names class {int(cls_map.max())} of {k}")
    cls_all = cls_map[exp_all]
    order, starts = _class_order(cls_all, k)
    counts = np.bincount(cls_all, minlength=k)
    pos, tok = [], []
    for j in range(k):
        c = tok_streams[j].size
        if c > counts[j]:
            raise StreamError(f"class {j} declares {c} changes among {int(counts[j])} positions")
        r = decode_gaps(gap_streams[j], GapMode.GAP8, c, 0, int(counts[j]), torch.int64).numpy()
        pos.append(order[starts[j] + r])
        tok.append(tok_streams[j])
    p = np.concatenate(pos) if pos else np.empty(0, np.int64)
    perm = np.argsort(p, kind="stable")
    values = join_tokens(np.concatenate(tok)[perm] if tok else np.empty(0, np.uint8), esc, bits_dtype)
    return torch.from_numpy(p[perm]).to(idt), values


def _check_map(cls_map: np.ndarray, dtype_name: str, k: int) -> None:
    if cls_map.size != map_size(dtype_name):
        raise StreamError(f"class map has {cls_map.size} entries, not {map_size(dtype_name)}")
    if cls_map.size and int(cls_map.max()) >= k:
        raise StreamError(f"class map names class {int(cls_map.max())} of {k}")


def join_old(cls_map: np.ndarray, segments: list[torch.Tensor], dtype_name: str, gap_streams: list[np.ndarray],
             tok_streams: list[np.ndarray], esc: np.ndarray, bits_dtype: torch.dtype,
             idt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """join() from the old bits of the chunk's range themselves (segments: flat bit views,
    one after another; a batch's members), their rANS undone: the decoder without the
    compiled library (join_coded's reference). It concatenates the segments and sorts the
    whole range by class, far slower than a copy (docs/PERFORMANCE.md)."""
    _check_map(cls_map, dtype_name, len(tok_streams))
    old_bits = torch.cat([t.reshape(-1) for t in segments]) if len(segments) != 1 else segments[0]
    return join(cls_map, exponents(old_bits, dtype_name), gap_streams, tok_streams, esc, bits_dtype, idt)


# A class's coded stream as the chunk holds it (zstd undone): its bytes, its raw length, rANS-coded?
Coded = tuple[np.ndarray, int, bool]


def join_coded(cls_map: np.ndarray, segments: list[torch.Tensor], dtype_name: str, gap_streams: list[Coded],
               tok_streams: list[Coded], esc: np.ndarray, bits_dtype: torch.dtype,
               idt: torch.dtype, lo: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """join_old from the classes' streams still rANS-coded, in one compiled call (rANS, GAP8,
    the walk and the values: dcr_ctx_decode); None where the compiled path does not apply
    (the caller then decodes stream by stream). segments: the receiver's tensors of the
    range, flat, of the chunk's dtype or its exponent bytes (uint8). Positions come out + lo, as idt."""
    lib = kernels.native()
    k = len(tok_streams)
    if lib is None:
        return None
    ptrs, lens = [], []
    for t in segments:  # (one loop: a batch holds hundreds of small tensors)
        if not t.is_cpu or not t.is_contiguous():
            return None
        ptrs.append(t.data_ptr())
        lens.append(t.numel())
    width = segments[0].element_size()
    if any(t.element_size() != width for t in segments):
        return None
    _check_map(cls_map, dtype_name, k)
    desc = np.zeros(8 * k, dtype=np.int64)
    for j in range(k):
        (g, g_raw, g_rans), (t, t_raw, t_rans) = gap_streams[j], tok_streams[j]
        desc[8 * j:8 * j + 8] = (g.ctypes.data, g.size, g_raw, int(g_rans), t.ctypes.data, t.size, t_raw, int(t_rans))
    total = sum(t[1] for t in tok_streams)
    pos = np.empty(total + 64, dtype=np.int64)  # the walk stores 8 positions at a time
    values = torch.empty(total, dtype=bits_dtype)
    populations = np.zeros(k, dtype=np.int64)
    err = np.zeros(2, dtype=np.int64)
    cmap = np.ascontiguousarray(cls_map, dtype=np.uint8)
    esc = np.ascontiguousarray(esc)
    w = escape_width(esc, bits_dtype)
    shift, nbits = _EXPONENT[dtype_name]
    if segments[0].dtype == torch.uint8:  # exponent bytes (exponent_bytes), not bits
        shift = 0
    ptrs, lens = np.array(ptrs, dtype=np.uint64), np.array(lens, dtype=np.int64)
    rc = lib.dcr_ctx_decode(ptrs.ctypes.data, lens.ctypes.data, len(segments), width, shift,
                            nbits, cmap.ctypes.data, k, desc.ctypes.data, esc.ctypes.data, esc.size // w, w,
                            pos.ctypes.data, values.data_ptr(), populations.ctypes.data, err.ctypes.data, lo,
                            int(idt == torch.int32))
    if rc < 0:
        j, code = int(err[0]), int(err[1])
        raise StreamError({
            -1: f"class {j}'s gap stream: {ANS_ERRORS.get(code, f'rANS error {code}')}",
            -2: f"class {j}'s gap stream: {GAP_ERRORS.get(code, f'gap decode error {code}')}",
            -3: f"class {j}'s token stream: {ANS_ERRORS.get(code, f'rANS error {code}')}",
            -4: f"class {j} declares {tok_streams[j][1] if 0 <= j < k else '?'} changes among "
                f"{int(populations[j]) if 0 <= j < k else '?'} positions",
            -5: f"the classes' ranks name {j} positions for {total} changes",
            -6: "escape count does not match the token stream",
        }.get(rc, f"context streams do not add up ({rc})"))
    if idt == torch.int32:  # narrowed in place: the first 4 * total bytes
        return torch.from_numpy(pos.view(np.int32)[:total]), values
    return torch.from_numpy(pos[:total]), values
