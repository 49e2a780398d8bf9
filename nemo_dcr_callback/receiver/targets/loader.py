"""LoaderTarget: a live model whose own loader places weights (vLLM-style
`load_weights(iterable of (name, tensor))`, which may rename, fuse or split tensors).

Per canonical tensor, the model's loader is called on a scratch tensor under a dispatch mode
that turns every copy from it into model storage into the chunk's operation: the model's own
code decides where each element goes. A copy of a contiguous part of the scratch into
contiguous model storage (a rename, a fused qkv's slice, a row split) takes the changes that
fall in that part straight to the destination (the compiled sparse scatter: the scratch is
never written); a copy of a strided part (a column shard) or into a strided destination (a
transposed parameter) locates each change by its index in the view, still sparse; only
overlapping or broadcast views fill the scratch densely first (zeros with the changes, or a
sentinel for overwrites) and combine it whole (XOR, ulp addition, or overwrite of the
entries not holding the sentinel). Which names the loader moves as plain copies (the
condition for all three) is learned once, at start-up, by a no-op pass that watches the
loader's copies; other names are refused with a clear error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.core.bitops import scatter, ulp_add_reference
from nemo_dcr_callback.core.rawbits import BITS_DTYPE, OP_OVERWRITE, OP_ULP, OP_XOR, bits

LoadFn = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


def _span(positions: torch.Tensor, off: int, n: int) -> tuple[int, int]:
    """The slice of sorted positions that falls in [off, off + n)."""
    lo, hi = torch.searchsorted(positions, torch.tensor([off, off + n], dtype=positions.dtype)).tolist()
    return lo, hi


def _nested(t: torch.Tensor) -> bool:
    """Is t a view that can be located by dividing out its strides, largest first (narrow,
    step slicing and permutations of a contiguous tensor: no overlap, no broadcast)?"""
    dims = sorted(((n, st) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1), key=lambda x: -x[1])
    if any(st <= 0 for _, st in dims):
        return False
    return all(dims[k][1] >= dims[k + 1][0] * dims[k + 1][1] for k in range(len(dims) - 1))


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _View(NamedTuple):
    """One plain copy the loader makes: the part of the canonical tensor it reads (offset,
    shape and strides in the flat canonical tensor) and the model storage it writes."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    contiguous: bool
    dst: torch.Tensor


class _Watch(TorchDispatchMode):
    """Records, for every copy into model storage, whether it is a plain copy of a view of
    the scratch buffer (same dtype): the condition for turning it into an XOR."""

    def __init__(self, model_storages: set[int], scratch: torch.Tensor):
        super().__init__()
        self.model, self.scratch = model_storages, _storage_key(scratch)
        self.copies = 0
        self.plain = True
        self.views: list[_View] = []  # where each plain copy put which part of the scratch
        self.fills: list[torch.Tensor] = []  # model storage set to a constant

    def overlapping_fill(self) -> bool:
        """Does a constant fill touch bytes a copy writes (then the fill, run again at each
        apply, would wipe what the copy's delta assumes is there)?"""
        def span(t: torch.Tensor) -> tuple[int, int, int]:
            extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
            return _storage_key(t), t.data_ptr(), t.data_ptr() + extent * t.element_size()

        fills = [span(f) for f in self.fills]
        return any(k == fk and a < fb and fa < b for v in self.views for k, a, b in [span(v.dst)]
                   for fk, fa, fb in fills)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if dst is not None and func._schema.is_mutable and _storage_key(dst) in self.model:
            if func is torch.ops.aten.copy_.default:
                src = args[1]
                self.copies += 1
                if _storage_key(src) != self.scratch or src.dtype != dst.dtype or src.shape != dst.shape:
                    self.plain = False
                else:
                    self.views.append(_View(src.storage_offset(), tuple(src.shape), tuple(src.stride()),
                                            src.is_contiguous(), dst))
            elif func is torch.ops.aten.fill_.Scalar:
                # a constant, the same at every load (vLLM zeroes a padded vocab's rows, or an
                # empty slice past them): harmless unless it hits what a copy writes (_learn)
                if dst.numel():
                    self.fills.append(dst)
            else:
                self.plain = False  # the loader writes model storage by some other op
            return dst  # a watch pass writes nothing
        return func(*args, **kwargs)


class _Scratch:
    """One canonical tensor's changes of one op, standing behind the scratch tensor the
    loader is given. The scratch is filled (densely) only if a copy needs it whole."""

    def __init__(self, name: str, op: int, ds: list[codec.DecodedChunk], shape, dtype: torch.dtype):
        self.name, self.op, self.ds = name, op, ds
        self.buf = torch.empty(shape, dtype=dtype)  # untouched pages until densified
        self.sentinel: int | None = None
        self.dense = False

    def densify(self) -> None:
        flat = bits(self.buf)
        if self.op == OP_OVERWRITE:
            self.sentinel = LoaderTarget._sentinel(flat.dtype, self.ds)
            flat.fill_(self.sentinel)
        else:
            flat.zero_()
        for d in self.ds:
            flat[d.positions.to(torch.int64)] = d.values
        self.dense = True


class _Combine(TorchDispatchMode):
    """Turns the loader's copies into model storage into XOR / ulp-add / overwrite, chosen by
    the scratch tensor the copy comes from: sparse where both sides are contiguous, else
    through the densified scratch."""

    def __init__(self, model_storages: set[int], scratches: dict[int, _Scratch], counts: dict[str, int],
                 terms: dict[str, list[int]] | None = None, segments: frozenset | set = frozenset(),
                 sparse: bool = True):
        super().__init__()
        self.model, self.scratches, self.counts, self.sparse = model_storages, scratches, counts, sparse
        # digest terms (name -> [before, after]) gathered by the copies that are a segment
        # (name, canonical offset, destination address) of LoaderTarget._contiguous_segments
        self.terms, self.segments = terms, segments

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and _storage_key(args[0]) in self.model:
            dst, src = args[0], args[1]
            sc = self.scratches[_storage_key(src)]
            plain = self.sparse and dst.dtype == src.dtype and dst.shape == src.shape
            if plain and dst.is_contiguous() and src.is_contiguous():
                self._sparse(sc, dst, src)
            elif plain and _nested(src) and _nested(dst):
                self._strided(sc, dst, src)
            else:
                self._dense(sc, dst, src)
            return dst
        return func(*args, **kwargs)

    def _strided(self, sc: _Scratch, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A strided part of the scratch (a column shard: narrow along a later dimension) or a
        strided destination (a transposed parameter): each change in src's region is located
        by its index in src's dimensions, and written at the same index of dst's storage."""
        dims = sorted((i for i in range(src.dim()) if src.shape[i] > 1), key=lambda i: -src.stride(i))
        off = src.storage_offset() - sc.buf.storage_offset()
        extent = 1 + sum((src.shape[i] - 1) * src.stride(i) for i in dims)
        whole = dst.as_strided((dst.untyped_storage().nbytes() // dst.element_size(),), (1,), 0)
        for d in sc.ds:
            lo, hi = _span(d.positions, off, extent)
            if hi <= lo:
                continue
            rel = d.positions[lo:hi].to(torch.int64) - off
            at = torch.full_like(rel, dst.storage_offset())
            inside = torch.ones_like(rel, dtype=torch.bool)
            for i in dims:
                idx = rel // src.stride(i)
                rel = rel - idx * src.stride(i)
                inside &= idx < src.shape[i]
                at += idx * dst.stride(i)
            inside &= rel == 0
            at, order = torch.sort(at[inside])
            if at.numel():
                scatter(whole, at, d.values[lo:hi][inside][order], d.op)
        self.counts["strided"] += 1

    def _sparse(self, sc: _Scratch, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The changes in src's range of the scratch, scattered into dst at the same offsets."""
        off, n = src.storage_offset() - sc.buf.storage_offset(), src.numel()
        flat = dst.view(-1)
        acc = self.terms.setdefault(sc.name, [0, 0]) if (
            self.terms is not None and (sc.name, off, flat.data_ptr()) in self.segments) else None
        for d in sc.ds:
            pos, vals = d.positions, d.values
            if off or n != sc.buf.numel():  # a part of the tensor (positions are sorted)
                lo, hi = _span(pos, off, n)
                pos, vals = pos[lo:hi], vals[lo:hi]
            if not pos.numel():
                continue
            if acc is not None:  # the terms in canonical positions, in the same pass
                b, a = digest.scatter_terms(flat, pos, vals, d.op, offset=off)
                acc[0], acc[1] = (acc[0] + b) & digest.MASK, (acc[1] + a) & digest.MASK
            else:
                scatter(flat, pos - off if off else pos, vals, d.op)
        self.counts["sparse"] += 1

    def _dense(self, sc: _Scratch, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not sc.dense:
            sc.densify()
        bdt = BITS_DTYPE[dst.element_size()]
        d, s = dst.view(bdt), src.view(bdt)
        if sc.op == OP_XOR:
            d.bitwise_xor_(s)
        elif sc.op == OP_ULP:  # only where the scratch holds a difference (zero elsewhere)
            mask = s != 0
            d[mask] = ulp_add_reference(d[mask], s[mask])
        else:
            d.copy_(torch.where(s == sc.sentinel, d, s))
        self.counts["dense"] += 1


class LoaderTarget:
    """A live model updated through its own loader (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, load_fn: LoadFn, shapes: dict[str, tuple[torch.Size, torch.dtype]],
                 scratch_bytes: int = 256 << 20, sparse: bool = True):
        self.model, self.load_fn = model, load_fn
        self.sparse = sparse  # False: every copy through the dense scratch (the benchmark's comparison)
        self.shapes = shapes  # canonical name -> (shape, dtype), e.g. from the checkpoint's index
        self.scratch_bytes = scratch_bytes  # loader calls are batched up to this much scratch
        self.storages = {_storage_key(p) for p in model.parameters()} | {_storage_key(b) for b in model.buffers()}
        self._views: dict[str, list[_View]] = {}
        self.plain = self._learn()
        self.copies = {"sparse": 0, "strided": 0, "dense": 0}  # the loader's copies combined each way, so far
        self._segments = {n: self._contiguous_segments(n) for n in self._views}
        # tensors the model holds all of (the rest cannot be digested, and are not read back)
        self._whole = {n for n in self._views if self._segments[n] is not None or self._covered(n)}
        self._segment_keys = {(n, off, flat.data_ptr()) for n, segs in self._segments.items() if segs
                              for off, _, flat in segs}
        # where the model's weights live, if not on the host: the follower reads old bits for
        # context-coded chunks there (as exponent bytes) rather than copying whole tensors back
        devices = {p.device for p in model.parameters()} - {torch.device("cpu")}
        self.device: torch.device | None = devices.pop() if len(devices) == 1 else None

    def _buffer(self, name: str) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        return torch.zeros(shape, dtype=dtype)

    def _learn(self) -> dict[str, bool]:
        plain = {}
        with torch.no_grad():
            for name in self.shapes:
                buf = self._buffer(name)
                w = _Watch(self.storages, buf)
                with w:
                    self.load_fn([(name, buf)])
                plain[name] = w.plain and w.copies > 0 and not w.overlapping_fill()
                if plain[name]:
                    self._views[name] = w.views
        return plain

    # ------------------------------------------------------------ digests
    # The follower checks each version's per-tensor digests (digest.py) in canonical
    # coordinates; the model keeps the tensor wherever its loader put it. The copies the watch
    # pass saw say where: canonical part -> model storage.
    def _contiguous_segments(self, name: str) -> list[tuple[int, int, torch.Tensor]] | None:
        """(offset, length, flat model storage) covering the canonical tensor once, if every
        copy is contiguous on both sides (renames, fused slices, row splits); else None."""
        views = self._views[name]
        if not all(v.contiguous and v.dst.is_contiguous() for v in views):
            return None
        segs, end = [], 0
        for v in sorted(views, key=lambda v: v.offset):
            n = math.prod(v.shape)
            if v.offset >= end:  # a part copied to two places (a tied copy) is read from the first
                if v.offset > end:
                    return None  # a gap: some elements go nowhere
                segs.append((v.offset, n, v.dst.reshape(-1)))
                end = v.offset + n
            elif v.offset + n > end:
                return None  # partly overlapping copies
        return segs if end == self.numel(name) else None

    def names(self) -> list[str]:
        return list(self.shapes)

    def numel(self, name: str) -> int:
        return int(torch.Size(self.shapes[name][0]).numel())

    def _covered(self, name: str) -> bool:
        """Do the loader's copies of this tensor reach every element of it?"""
        return bool(self.held(name).all())

    def canonical(self, name: str, device: torch.device | None = None) -> torch.Tensor | None:
        """The canonical tensor as the model holds it now (a copy, read through the loader's
        copies; on the host unless `device` is given), or None if they do not cover it."""
        return self._gather(name, device) if name in self._whole else None

    def _gather(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        """The canonical tensor's elements the model holds, read through the loader's copies
        (zero where it holds none; a tensor held whole is not cleared first)."""
        out = (torch.empty if name in self._whole else torch.zeros)(self.numel(name), dtype=self.shapes[name][1],
                                                                    device=device)
        with torch.no_grad():
            for v in self._views.get(name, []):
                out.as_strided(v.shape, v.stride, v.offset).copy_(v.dst)
        return out

    def compare(self, dense: dict[str, torch.Tensor]) -> dict:
        """The model's weights, read back in canonical coordinates, against a dense state (an
        oracle: e.g. the trainer's export), bit for bit: the tensors checked and those that
        differ (tensors the model holds only part of are skipped)."""
        checked, differ = 0, []
        for name, want in sorted(dense.items()):
            got = self.canonical(name)
            if got is None:
                continue
            checked += 1
            if not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).contiguous().view(torch.uint8)):
                differ.append(name)
        return {"checked": checked, "differ": differ}

    def held(self, name: str) -> torch.Tensor:
        """Which canonical elements the model holds (a bool per element): all of them unless
        the loader keeps a shard (tensor parallelism)."""
        seen = torch.zeros(self.numel(name), dtype=torch.bool)
        for v in self._views.get(name, []):
            seen.as_strided(v.shape, v.stride, v.offset).fill_(True)
        return seen

    def partial_digest(self, name: str, owned: torch.Tensor | None = None) -> int:
        """The digest terms of the canonical elements the model holds (of those in `owned`, a
        bool per element, if given): the ranks of a tensor-parallel group sum theirs to the
        tensor's digest, each element counted by exactly one rank."""
        mask = self.held(name) if owned is None else owned
        pos = torch.nonzero(mask).reshape(-1)
        return digest.sum64(self._gather(name)[pos], positions=pos)

    def destinations(self, names) -> set[int]:
        """The model storages (untyped_storage().data_ptr()) the loader writes these canonical
        tensors into: the layers an apply touched."""
        return {_storage_key(v.dst) for n in names for v in self._views.get(n, [])}

    def digest_of(self, name: str) -> int | None:
        """The digest of the canonical tensor as the model holds it, or None if the model does
        not hold all of it (then it is not checked)."""
        segs = self._segments.get(name)
        if segs is not None:
            return sum(digest.sum64(flat, base=off) for off, _, flat in segs) & digest.MASK
        t = self.canonical(name)
        return None if t is None else digest.sum64(t)

    def check(self, h: codec.ChunkHeader) -> None:
        if h.name not in self.shapes:
            raise codec.ChunkError(f"receiver has no tensor {h.name!r} (wrong model?)")
        shape, dtype = self.shapes[h.name]
        if dtype != h.dtype.torch or int(torch.Size(shape).numel()) != h.numel:
            raise codec.ChunkError(f"chunk for {h.name!r} is {h.dtype.name} x {h.numel}, the model's is "
                                   f"{dtype} x {torch.Size(shape).numel()}")
        if not self.plain[h.name]:
            raise codec.ChunkError(f"the model's loader transforms {h.name!r} (not a plain copy): "
                                   "in-place delta application is refused for it")

    def apply(self, decoded: list[codec.DecodedChunk]) -> None:
        self._apply(decoded, None)

    def apply_with_terms(self, decoded: list[codec.DecodedChunk]) -> dict[str, tuple[int, int]]:
        """apply() with the digest terms (per tensor, before and after) of the touched
        elements in canonical positions: from the sparse copies themselves where the tensor is
        held in contiguous segments, else read densely (canonical()) before and after. Tensors
        the model does not hold whole get none (the follower does not check them)."""
        names = {d.header.name for d in decoded} & self._whole
        dense = {n: self.canonical(n) for n in names if self._segments[n] is None or not self.sparse}
        terms: dict[str, list[int]] = {n: [0, 0] for n in names if n not in dense}
        self._apply(decoded, terms)
        for n, before in dense.items():
            after = self.canonical(n)
            b = sum(digest.sum64_at(before, d.positions) for d in decoded if d.header.name == n)
            a = sum(digest.sum64_at(after, d.positions) for d in decoded if d.header.name == n)
            terms[n] = [b & digest.MASK, a & digest.MASK]
        return {n: (b, a) for n, (b, a) in terms.items()}

    def _apply(self, decoded: list[codec.DecodedChunk], terms: dict[str, list[int]] | None) -> None:
        """One scratch tensor per (name, op); the loader is called on batches of them
        (bounded by scratch_bytes) under one dispatch mode."""
        groups: dict[tuple[str, int], list[codec.DecodedChunk]] = {}
        for d in decoded:
            groups.setdefault((d.header.name, d.op), []).append(d)
        batch: list[tuple[str, torch.Tensor]] = []
        scratches: dict[int, _Scratch] = {}
        size = 0
        with torch.no_grad():
            for (name, op), ds in groups.items():
                sc = _Scratch(name, op, ds, *self.shapes[name])
                scratches[_storage_key(sc.buf)] = sc
                batch.append((name, sc.buf))
                size += sc.buf.numel() * sc.buf.element_size()
                if size >= self.scratch_bytes:
                    self._load(batch, scratches, terms)
                    batch, scratches, size = [], {}, 0
            if batch:
                self._load(batch, scratches, terms)

    def _load(self, batch, scratches, terms) -> None:
        with _Combine(self.storages, scratches, self.copies, terms, self._segment_keys, self.sparse):
            self.load_fn(batch)

    @staticmethod
    def _sentinel(bdt: torch.dtype, ds: list[codec.DecodedChunk]) -> int:
        """A bit pattern no overwrite value uses (a NaN payload first)."""
        used = set(torch.cat([d.values for d in ds]).tolist()) if ds else set()
        for cand in (0x7FC1, 0x7FA5, 0x7F81, -1, -2) if bdt == torch.int16 else (0x7FC00001, -1, -2):
            if cand not in used:
                return cand
        raise codec.ChunkError("no free sentinel for an overwrite chunk")
