"""The sender's side of context-modelled coding (codec/context.py): a chunk's streams coded per
class of the old value's exponent, from the range's old bits or a sender's current ones.
With the compiled library one call (dcr_ctx_encode) makes the class choice, the walk and
every class's streams; the numpy path is its reference."""

from __future__ import annotations

import numpy as np
import torch

from nemo_dcr_callback.codec import context
from nemo_dcr_callback.codec.format import RANS, STORED, DType, Kind, Stream, ValueMode
from nemo_dcr_callback.codec.packing import pack_stream, ranked_modes, scratch, token_stream
from nemo_dcr_callback.codec.streams import ans_encode, tokens
from nemo_dcr_callback.core import kernels


def applies(kind: Kind, info: DType, positions, new_values, count: int) -> bool:
    """Can this chunk be context-coded at all (XOR changes of a float dtype, new values given)?"""
    return (kind == Kind.XOR and positions is not None and new_values is not None and count > 0
            and context.supported(info.name))


# the context coding is built only where its estimate is at most this share of one class's
# (about the plain coding's): the walk over the range costs about as much as the delta pass
MIN_GAIN = 0.97


def streams(info: DType, lo: int, hi: int, positions: torch.Tensor, vals: torch.Tensor, nv: torch.Tensor,
            walked: torch.Tensor, level: int, is_old: bool) -> tuple[ValueMode, int, list[Stream]] | None:
    """(value coding, classes, streams) of the context-modelled coding of the changes at
    positions in [lo, hi), from the range's old bits (is_old) or its current (new) ones: they
    differ only at the positions, where the old values are new ^ xor. The classes are chosen
    from a sample of the range; None where the estimate says one class would do (the plain
    coding wins, and the walk over the range is not paid)."""
    if walked.numel() != hi - lo:
        raise ValueError(f"{'old' if is_old else 'current'} bits cover {walked.numel()} positions, the range "
                         f"{hi - lo}")
    done = tokens(vals, True, nv)
    vm = ranked_modes(done[2], (ValueMode.RAW, ValueMode.ULP), info.width, False)[0]
    tok, esc, _ = done if vm == ValueMode.ULP else tokens(vals, False, nv)
    lib = kernels.native()
    if lib is not None and walked.is_cpu and walked.is_contiguous() and positions.is_contiguous():
        got = _native(lib, info, lo, hi, positions, vals.contiguous(), nv.contiguous(), walked, tok, is_old, level)
        if got is None:
            return None
        cls_map, gaps, toks = got
        return vm, len(toks), _pack(cls_map, gaps, toks, esc, level)
    size = context.map_size(info.name)
    p = positions.to(torch.int64).numpy() - lo
    e_old = context.exponents(nv ^ vals, info.name)
    e_new = e_old if is_old else context.exponents(nv, info.name)
    n = context.sampled_counts(walked, info.name)
    if not is_old:
        n += np.bincount(e_old, minlength=size)[:size] - np.bincount(e_new, minlength=size)[:size]
    cls_map, est, one = context.choose_classes(np.maximum(n, 0), e_old, tok, size)
    if est > MIN_GAIN * one:
        return None
    old = walked
    if not is_old:
        old = walked.clone()
        old[torch.from_numpy(p)] = nv ^ vals
    k, gaps, toks = context.split(p, tok, cls_map, context.exponents(old, info.name))
    return vm, k, _pack(cls_map, [gap_stream(g, level) for g in gaps],
                        [token_stream(t, ans_encode(t)) for t in toks], esc, level)


def _native(lib, info: DType, lo: int, hi: int, positions: torch.Tensor, vals: torch.Tensor, nv: torch.Tensor,
            walked: torch.Tensor, tok: np.ndarray, is_old: bool, level: int
            ) -> tuple[np.ndarray, list[Stream], list[Stream]] | None:
    """dcr_ctx_encode: (class map, per class its gap stream, per class its token stream), or
    None where one class would do."""
    n, count = hi - lo, positions.numel()
    shift, nbits = context.exponent_field(info.name)
    block, every = context.sample_plan(n)
    cap = 20480 + 3 * count + 2 * (n // 255) + 64
    out, optr = scratch("ctx", cap)
    meta, mptr = scratch("ctx_meta", 1 + 4 * context.MAX_CLASSES, np.int64)
    est, eptr = scratch("ctx_est", 2, np.float64)
    cls_map = np.zeros(1 << nbits, dtype=np.uint8)
    tok = np.ascontiguousarray(tok, dtype=np.uint8)
    rc = lib.dcr_ctx_encode(walked.data_ptr(), n, info.width, shift, nbits, int(is_old), positions.data_ptr(),
                            int(positions.dtype == torch.int64), count, lo, vals.data_ptr(), nv.data_ptr(),
                            tok.ctypes.data, MIN_GAIN, block, every, cls_map.ctypes.data, eptr,
                            optr, cap, mptr)
    if rc == 1:
        return None
    if rc != 0:
        raise ValueError("context coding: positions out of order or bits that disagree with the new values"
                         if rc == -1 else f"context encoder: {rc}")
    k = int(meta[0])
    gaps, toks, at = [], [], 0
    for j in range(k):
        g_raw, g_rans, m, t_len = (int(x) for x in meta[1 + 4 * j:5 + 4 * j])
        raw, coded = out[at:at + g_raw], out[at + g_raw:at + g_raw + g_rans]
        at += g_raw + g_rans
        gaps.append(gap_stream(raw, level, coded.tobytes() if g_rans else None))
        toks.append((m, out[at:at + t_len].tobytes(), RANS if t_len < m else STORED))
        at += t_len
    return cls_map, gaps, toks


# a gap stream this long or longer takes rANS without zstd tried beside it (rANS's table costs
# more than zstd's only on short streams)
GAP_ZSTD_TRIED = 1 << 16


def gap_stream(g: np.ndarray, level: int, coded: bytes | None = b"") -> Stream:
    """A class's GAP8 bytes rANS-coded, or packed where that is smaller; coded: their rANS
    coding where already made (None: not smaller than the bytes themselves)."""
    if coded == b"":
        coded = ans_encode(g) if g.size else None
    if coded is not None and g.size >= GAP_ZSTD_TRIED and len(coded) < g.size:
        return (g.size, coded, RANS)
    packed, codec = pack_stream(g, level)
    return (g.size, coded, RANS) if coded is not None and len(coded) < len(packed) else (g.size, packed, codec)


def _pack(cls_map: np.ndarray, gaps: list[Stream], toks: list[Stream], esc: np.ndarray,
          level: int) -> list[Stream]:
    """A context-coded chunk's streams: the class map, each class's gaps, each class's tokens,
    the escapes (codec/context.py)."""
    return [(cls_map.size, *pack_stream(cls_map, level)), *gaps, *toks, (esc.size, *pack_stream(esc, level))]
