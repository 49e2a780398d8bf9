"""Chunk encoding: one tensor's changes in a position range -> one self-describing chunk.

A chunk carries gap-coded positions plus values split into byte planes or rANS tokens, each
stream zstd-compressed (or stored, if zstd does not help). Values are XOR bits, zig-zag
signed ulp differences (exact: the receiver has the old bits; about 0.9 bit per change
cheaper on BF16 deltas), or overwrite values (idempotent: residual conversions and retries).
The encoder picks the gap and value coding per chunk and flags the choice in the header.
With the compiled library, XOR chunks of floats take a fused path (one C call per chunk, or
per parameter slice) that yields the same bytes as the generic path would.
"""

from __future__ import annotations

import numpy as np
import torch

from nemo_dcr_callback.codec import context_encode, digest
from nemo_dcr_callback.codec.format import (
    DEFAULT_CHUNK_SPAN,
    MAX_MEMBERS,
    MAX_NAME,
    DType,
    Kind,
    Layout,
    Stream,
    ValueMode,
    assemble_chunk,
    dtype_info,
    member_table,
)
from nemo_dcr_callback.codec.packing import pack_stream, ranked_modes, scratch, token_stream
from nemo_dcr_callback.codec.streams import (
    GapMode,
    ans_encode,
    encode_gaps,
    gap_bound,
    split_planes,
    tokens,
    ulp_encode,
)
from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.core.rawbits import SparseDelta, bits


def _value_streams(vals: torch.Tensor, vm: ValueMode, layout: Layout, new_values, level: int,
                   tokens_done=None) -> list[Stream]:
    """(raw_len, stored bytes, codec) for each value stream of a coding and layout."""
    ulp = vm == ValueMode.ULP
    if layout == Layout.PLANES:
        count = vals.numel()
        planes = split_planes(ulp_encode(vals, new_values) if ulp else vals)
        out = []
        for b in range(vals.element_size()):
            plane = planes[b * count:(b + 1) * count]
            packed, codec = pack_stream(plane, level)
            out.append((plane.size, packed, codec))
        return out
    tok, esc, _ = tokens_done or tokens(vals, ulp, new_values)
    epacked, ecodec = pack_stream(esc, level)
    return [token_stream(tok, ans_encode(tok)), (esc.size, epacked, ecodec)]


# --------------------------------------------------------------------------- one chunk
def _checked_inputs(name: str, info: DType, numel: int, lo: int, hi: int, positions: torch.Tensor | None,
                    values: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """(count, values as raw bits, contiguous positions); ValueError on inconsistent arguments."""
    if not 0 <= lo <= hi <= numel:
        raise ValueError(f"bad range [{lo}, {hi}) for {numel} elements")
    if len(name.encode()) > MAX_NAME:
        raise ValueError("tensor name too long")
    count = (hi - lo) if positions is None else positions.numel()
    if values.numel() != count or values.element_size() != info.width:
        raise ValueError("values do not match positions or dtype width")
    vals = bits(values.contiguous()) if values.numel() else values.reshape(-1)
    return count, vals, None if positions is None else positions.contiguous()


def _gap_candidates(positions: torch.Tensor | None, gap_modes: tuple[GapMode, ...] | None, lo: int, hi: int,
                    count: int) -> tuple[GapMode, ...]:
    """The gap codings worth trying: by mean gap, both in between (DENSE for every position)."""
    if positions is None:
        return (GapMode.DENSE,)
    if gap_modes:
        return gap_modes
    mean_gap = (hi - lo) / max(count, 1)
    return ((GapMode.GAP8,) if mean_gap < 512 else
            (GapMode.GAP8, GapMode.GAP16) if mean_gap < 8192 else (GapMode.GAP16,))


def _fused_applies(kind: Kind, info: DType, positions, new_values, count: int, gap_cands: tuple[GapMode, ...],
                   value_modes, layouts, exhaustive: bool) -> bool:
    """Whether the fused encoder yields this chunk: a sparse XOR chunk of floats with the
    default value and layout candidates (it codes TOKENS with the estimate's choice only)."""
    return (kind == Kind.XOR and positions is not None and new_values is not None and bool(count)
            and info.is_float and info.width > 1 and value_modes is None and layouts is None and not exhaustive
            and GapMode.DENSE not in gap_cands)


def _add_terms(terms: list[int], vals: torch.Tensor, new_values: torch.Tensor, positions: torch.Tensor | None,
               lo: int, hi: int) -> None:
    """Add the changed elements' [old, new] digest sums to terms (the generic path's)."""
    nb = bits(new_values.contiguous())
    pos64 = positions.to(torch.int64).numpy() if positions is not None else np.arange(lo, hi, dtype=np.int64)
    terms[0] = (terms[0] + digest.sum64(nb ^ vals, pos64)) & digest.MASK
    terms[1] = (terms[1] + digest.sum64(nb, pos64)) & digest.MASK


def _best_gaps(positions: torch.Tensor | None, gap_cands: tuple[GapMode, ...], lo: int, hi: int, level: int,
               fused_gap8: np.ndarray | None) -> tuple[GapMode, list[Stream]]:
    """The smallest packed gap stream among the candidates (none for DENSE); fused_gap8 is
    the fused encoder's GAP8 stream, reused rather than coded again."""
    gm, streams = gap_cands[0], []
    for cand in gap_cands:
        if cand == GapMode.DENSE:
            break
        raw = fused_gap8 if fused_gap8 is not None and cand == GapMode.GAP8 else encode_gaps(positions, lo, hi, cand)
        packed, codec = pack_stream(raw, level)
        if not streams or len(packed) < len(streams[0][1]):
            gm, streams = cand, [(raw.size, packed, codec)]
    return gm, streams


def _best_values(vals: torch.Tensor, kind: Kind, info: DType, new_values: torch.Tensor | None,
                 value_modes: tuple[ValueMode, ...] | None, layouts: tuple[Layout, ...] | None, exhaustive: bool,
                 level: int) -> tuple[ValueMode, Layout, list[Stream]]:
    """The value coding, layout and streams of the smallest candidate encoded."""
    if value_modes is None:
        ulp_ok = kind == Kind.XOR and info.is_float and info.width > 1 and new_values is not None
        value_modes = (ValueMode.RAW, ValueMode.ULP) if ulp_ok else (ValueMode.RAW,)
    # One pass makes the tokens of the likely coding (ULP for floats) and the histograms of
    # both, so the estimate needs no second pass over the values.
    nv = bits(new_values.contiguous()) if ValueMode.ULP in value_modes else None
    first = ValueMode.ULP if ValueMode.ULP in value_modes else ValueMode.RAW
    done = tokens(vals, first == ValueMode.ULP, nv)
    hist = done[2]
    modes = ranked_modes(hist, value_modes, info.width, exhaustive)
    if layouts is None:  # PLANES pays only when many values escape the byte tokens
        many_escapes = int(hist[int(modes[0]), 255]) * 16 > max(vals.numel(), 1)
        layouts = (Layout.TOKENS, Layout.PLANES) if exhaustive or many_escapes else (Layout.TOKENS,)
    best = None
    for vm in modes:
        for lay in layouts:
            st = _value_streams(vals, vm, lay, nv, level, done if vm == first else None)
            size = sum(len(p) for _, p, _ in st)
            if best is None or size < best[0]:
                best = (size, vm, lay, st)
    _, vm, lay, streams = best
    return vm, lay, streams


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
    old: torch.Tensor | None = None,
    current: torch.Tensor | None = None,
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
    old: the receiver's bits of [lo, hi) (the tensor before the change): the context-modelled
    coding (codec/context.py) is tried beside the plain one and the smaller kept.
    current: the tensor's bits of [lo, hi) after the change (a sender's baseline once the
    delta is taken), instead of old: the old bits are the current ones except at positions,
    and the context coding is tried only where its estimate (from a sample) wins.
    """
    info = dtype_info(dtype)
    count, vals, positions = _checked_inputs(name, info, numel, lo, hi, positions, values)
    if terms is not None and (kind != Kind.XOR or new_values is None):
        raise ValueError("digest terms need an XOR chunk with its new values")
    gm, vm, lay, streams = _encode_streams(kind, info, lo, hi, count, positions, vals, new_values, value_modes,
                                           layouts, gap_modes, level, exhaustive, terms)
    plain = assemble_chunk(name, kind, info, gm, vm, lay, numel, lo, hi, count, streams)
    if (old is None and current is None) or not context_encode.applies(kind, info, positions, new_values, count):
        return plain
    nv = bits(new_values.contiguous())
    walked = bits((old if old is not None else current).contiguous())
    ctx = context_encode.streams(info, lo, hi, positions, vals, nv, walked, level, is_old=old is not None)
    if ctx is None:
        return plain
    coded = assemble_chunk(name, kind, info, GapMode.GAP8, ctx[0], Layout.TOKENS, numel, lo, hi, count, ctx[2],
                           classes=ctx[1])
    return coded if len(coded) < len(plain) else plain


def _encode_streams(kind: Kind, info: DType, lo: int, hi: int, count: int, positions: torch.Tensor | None,
                    vals: torch.Tensor, new_values: torch.Tensor | None, value_modes, layouts, gap_modes, level: int,
                    exhaustive: bool, terms: list[int] | None) -> tuple[GapMode, ValueMode, Layout, list[Stream]]:
    """The codings chosen and the streams of the changes at positions in [lo, hi)."""
    gap_cands = _gap_candidates(positions, gap_modes, lo, hi, count)
    fused = None
    lib = kernels.native()
    if lib is not None and _fused_applies(kind, info, positions, new_values, count, gap_cands, value_modes,
                                          layouts, exhaustive):
        fused = _fused_xor(lib, positions, vals, bits(new_values.contiguous()), lo, hi,
                           GapMode.GAP8 in gap_cands, terms)
    elif terms is not None and count:
        _add_terms(terms, vals, new_values, positions, lo, hi)
    gm, gap_streams = _best_gaps(positions, gap_cands, lo, hi, level, None if fused is None else fused[0])
    if fused is not None and fused[1] is not None:
        _, vm, ans_b, esc = fused
        epacked, ecodec = pack_stream(esc, level)
        return gm, vm, Layout.TOKENS, gap_streams + [token_stream(None, ans_b, count), (esc.size, epacked, ecodec)]
    vm, lay, val_streams = _best_values(vals, kind, info, new_values, value_modes, layouts, exhaustive, level)
    return gm, vm, lay, gap_streams + val_streams


def encode_batch(dtype: torch.dtype, members: list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]], *,
                 level: int = 1, olds: list[torch.Tensor] | None = None) -> bytes:
    """One XOR chunk for the changes of several small tensors of one dtype: members are
    (name, numel, sorted positions, XOR values, new values). Their position spaces are
    concatenated, so the tensors share one header, one gap stream and one set of value
    streams (one rANS table); a member table names each tensor with its numel and change
    count. For checkpoints of many small tensors (norms, biases, experts), where a chunk
    of its own costs a tensor more in header and tables than its changes."""
    info = dtype_info(dtype)
    if not members or len(members) > MAX_MEMBERS:
        raise ValueError(f"a batch holds 1 to {MAX_MEMBERS} tensors, not {len(members)}")
    pos, vals, nv, off = [], [], [], 0
    for name, numel, p, x, n in members:
        if p.numel() != x.numel() or x.numel() != n.numel() or x.element_size() != info.width:
            raise ValueError(f"batch member {name!r}: positions and values do not match")
        if p.numel() and (int(p[0]) < 0 or int(p[-1]) >= numel):
            raise ValueError(f"batch member {name!r}: positions outside its {numel} elements")
        pos.append(p.to(torch.int64) + off)
        vals.append(bits(x.contiguous()))
        nv.append(bits(n.contiguous()))
        off += numel
    positions = torch.cat(pos)
    if off < 1 << 31:
        positions = positions.to(torch.int32)
    count = positions.numel()
    gm, vm, lay, streams = _encode_streams(Kind.XOR, info, 0, off, count, positions, torch.cat(vals), torch.cat(nv),
                                           None, None, None, level, False, None)
    table = member_table([(name, numel, p.numel()) for name, numel, p, _, _ in members])
    packed, codec = pack_stream(table, max(level, 3))
    head = (len(members), packed, codec, len(table))
    plain = assemble_chunk("", Kind.XOR, info, gm, vm, lay, off, 0, off, count, streams, members=head)
    if olds is None or not context_encode.applies(Kind.XOR, info, positions, nv, count):
        return plain
    old_bits = torch.cat([bits(o.contiguous()).reshape(-1) for o in olds])
    ctx = context_encode.streams(info, 0, off, positions, torch.cat(vals), torch.cat(nv), old_bits, level, is_old=True)
    if ctx is None:
        return plain
    vm, k, streams = ctx
    coded = assemble_chunk("", Kind.XOR, info, GapMode.GAP8, vm, Layout.TOKENS, off, 0, off, count, streams,
                           members=head, classes=k)
    return coded if len(coded) < len(plain) else plain


def _fused_xor(lib, positions: torch.Tensor, vals: torch.Tensor, nv: torch.Tensor, lo: int, hi: int,
               gap8: bool, terms: list[int] | None):
    """dcr_encode_xor: (GAP8 stream or None, value mode, token stream, escapes), with value
    mode None when many values escape (the caller then codes the values the generic way;
    the digest terms are added either way). The gap and escape streams view this thread's
    scratch: valid until its next call."""
    count, w = vals.numel(), vals.element_size()
    gcap = gap_bound(GapMode.GAP8, count, hi - lo) if gap8 else 0
    acap = lib.dcr_ans_bound(count)
    gaps, gptr = scratch("gaps", gcap)
    ans, aptr = scratch("ans", acap)
    esc, eptr = scratch("esc", count * w)
    out, optr = scratch("out", 6, np.int64)  # [gap bytes, rANS bytes, escapes, ulp?] + the digest sums
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


# --------------------------------------------------------------------------- tensors
def split_ranges(positions: torch.Tensor, numel: int, span: int = DEFAULT_CHUNK_SPAN,
                 within: tuple[int, int] | None = None):
    """Yield (lo, hi, start, end): position-range chunks and their slice of positions; within:
    ranges cut at its ends too (a sender that holds only that run of the tensor)."""
    if numel == 0:
        return
    if within is not None:
        a, b = within
        first = (a // span + 1) * span
        inner = torch.arange(first, b, span, dtype=torch.int64) if first < b else torch.empty(0, dtype=torch.int64)
        bounds = torch.cat([torch.tensor([a]), inner, torch.tensor([b])])
    elif numel <= span:  # one range (most tensors): no search
        yield 0, numel, 0, positions.numel()
        return
    else:
        bounds = torch.arange(0, numel + span, span, dtype=torch.int64).clamp_(max=numel)
    idx = torch.searchsorted(positions.to(torch.int64), bounds).tolist()
    b = bounds.tolist()
    for i in range(len(b) - 1):
        if b[i] < b[i + 1]:
            yield b[i], b[i + 1], idx[i], idx[i + 1]


def encode_sparse(name: str, kind: Kind, dtype: torch.dtype, numel: int, positions: torch.Tensor,
                  values: torch.Tensor, new_values: torch.Tensor | None = None, *,
                  span: int = DEFAULT_CHUNK_SPAN, level: int = 1,
                  value_modes: tuple[ValueMode, ...] | None = None, terms: list[int] | None = None,
                  old: torch.Tensor | None = None, current: torch.Tensor | None = None,
                  within: tuple[int, int] | None = None) -> list[bytes]:
    """Chunks for sorted positions of one tensor (split into ranges of `span` positions);
    terms, old and current (the whole tensor before / after the change) as in encode_chunk.
    within: (a, b), the run of the tensor the sender holds: ranges are cut at its ends and
    current holds positions [a, b) only."""
    out = []
    flat_old = None if old is None else old.reshape(-1)
    flat_cur = None if current is None else current.reshape(-1)
    at = 0 if within is None else within[0]
    for lo, hi, s, e in split_ranges(positions, numel, span, within):
        if e > s:
            out.append(encode_chunk(name, kind, dtype, numel, lo, hi, positions[s:e], values[s:e],
                                    None if new_values is None else new_values[s:e],
                                    value_modes=value_modes, level=level, terms=terms,
                                    old=None if flat_old is None else flat_old[lo:hi],
                                    current=None if flat_cur is None else flat_cur[lo - at:hi - at]))
    return out


def encode_delta(name: str, delta: SparseDelta, new_tensor: torch.Tensor | None = None, *,
                 span: int = DEFAULT_CHUNK_SPAN, level: int = 1,
                 value_modes: tuple[ValueMode, ...] | None = None, terms: list[int] | None = None,
                 old: torch.Tensor | None = None, current: torch.Tensor | None = None) -> list[bytes]:
    """XOR chunks for one tensor's delta. The new values (for ulp coding) come from
    delta.new, or are gathered from new_tensor (the tensor's new bits) if given; terms, old
    and current as in encode_sparse."""
    new = delta.new
    if new is None and new_tensor is not None:
        new = bits(new_tensor)[delta.positions.to(torch.int64)]
    return encode_sparse(name, Kind.XOR, delta.dtype, delta.numel, delta.positions, delta.xor, new,
                         span=span, level=level, value_modes=value_modes, terms=terms, old=old, current=current)


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
