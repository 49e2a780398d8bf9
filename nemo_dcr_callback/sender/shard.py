"""The sender side on one training rank: baselines, delta, placement, chunks.

`ShardSender.take(version)` runs right after an optimizer step. For every parameter slice
this rank sends (placement decides: main replica only, data-parallel ranks split the flat
range), it takes the delta against the slice's baseline with the fused kernel and advances
the baseline to the current bits. `Encoder.encode` (which the background worker runs)
projects the changed positions into canonical coordinates and encodes XOR chunks.
Parameters whose canonical bits are not a copy of the training bits (an fp32 norm served as
bf16, a zero-centred gamma) go the residual way: converted on this rank, diffed against a
canonical residual baseline, sent as overwrite chunks.

The deltas taken are the undo log, the only one, kept here by version: `settle(v)` drops it
up to v once the joint commit has committed v; `roll_back(v)` restores the baselines, bit for
bit, to before v (v aborted or failed: it and every later version are undone).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import context, digest
from nemo_dcr_callback.codec.format import DEFAULT_CHUNK_SPAN
from nemo_dcr_callback.core import cuda_kernels, kernels
from nemo_dcr_callback.core.delta import Scratch, take_delta, undo
from nemo_dcr_callback.core.rawbits import SparseDelta, bits
from nemo_dcr_callback.placement.maps import ParamMap, Placement
from nemo_dcr_callback.sender.mirror import Key, Mirror


@dataclass
class StepStats:
    params: int = 0  # elements this rank sent for
    changed: int = 0
    chunks: int = 0
    bytes: int = 0
    residual_changed: int = 0
    per_tensor: dict[str, int] = field(default_factory=dict)  # canonical name -> changed


def _take(cur: torch.Tensor, base: torch.Tensor, scratch: Scratch, side: cuda_kernels.SideStream,
          out=None, threads: int | None = None) -> SparseDelta:
    """CPU shards: the compiled CPU kernel (into `out` if given). CUDA shards: the CUDA kernel
    on a side stream, the compacted output in pinned host memory (ready to encode when this
    returns)."""
    if cur.is_cuda:
        return side.take(cur, base)
    return take_delta(cur, base, keep_new=True, scratch=scratch, out=out, threads=threads)


def context_possible(mode: str, store, link_mbit: float | None = None) -> bool:
    """Can context coding happen on this store at all? auto without a link rate codes only while
    uploads queue, and a store that uploads in the caller (no pool: a file store) never queues:
    then the worker keeps no mirror (its host copy, and moving it each version, would cost for
    nothing). With the receivers' link rate auto measures against that, on any store."""
    return mode == "on" or (mode == "auto" and (bool(link_mbit) or getattr(store, "executor", None) is not None))


def context_gate(mode: str, writer, link_mbit: float | None = None, world: int = 1) -> Callable[[], bool]:
    """Whether to try context coding now (config.CONTEXT_MODES), given the upload's RankWriter
    and the receivers' link (Mbit/s, shared by the world ranks; None: the upload's backlog)."""
    if mode == "auto":
        if link_mbit:
            # two parts: one on the link and one waiting, so the link does not idle while the
            # next part (context-coded: slower) is encoded
            share = link_mbit * 1e6 / 8 / max(world, 1)
            return lambda: writer.ahead(share) >= 2 * writer.part_bytes
        return lambda: writer.backlog() >= writer.part_bytes
    return (lambda: True) if mode == "on" else (lambda: False)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.cpu() if t.is_cuda else t


def _gather(t: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    """The slices of t that went to one canonical tensor (a view when there is one)."""
    return t[parts[0][0]:parts[0][1]] if len(parts) == 1 else torch.cat([t[a:b] for a, b in parts])


def canonical_values(pm: ParamMap, dtype: torch.dtype) -> torch.Tensor:
    """This rank's slice of a parameter as canonical values (the residual conversion)."""
    x = pm.param.detach().reshape(-1)[pm.lo:pm.hi]
    if pm.rule.transform == "plus_one":
        x = x.float() + 1.0
    return x.to(dtype)


class Encoder:
    """Projection and encoding of the deltas taken: needs only the maps (not the parameters)
    and the codec's options, so the background worker builds one from the placement alone."""

    # XOR slices of float parameters go through the compiled slice encoder (codec.encode_xor_slice:
    # projection, chunking and encoding in one call, the same chunks); False: the Python path.
    fused_slices: bool = True

    def __init__(self, placement: Placement, span: int = DEFAULT_CHUNK_SPAN, level: int = 1,
                 mirror: Mirror | None = None):
        self.placement, self.span, self.level = placement, span, level
        self.mirror = mirror  # the new bits of the runs this rank owns whole: context coding (mirror.py)

    def encode(self, taken: list[tuple[ParamMap, SparseDelta]], emit: Callable[[bytes], None] | None = None,
               digests: dict[str, int] | None = None,
               context_now: Callable[[], bool] | None = None) -> tuple[list[bytes], StepStats]:
        """Projection and encoding (may run in a background thread): canonical chunks, each
        passed to `emit` as soon as it is encoded (a slice through the compiled slice encoder:
        once the slice is) and then not returned, or returned. `digests` (canonical name ->
        this rank's slice digest) is moved forward by the changes. With a mirror, a slice's
        runs are context-coded where context_now() (asked per slice; None: always) says so;
        the mirror moves either way."""
        chunks: list[bytes] = []
        st = StepStats()
        lib = kernels.native() if self.fused_slices else None

        def deliver(name: str, out: list[bytes], n: int) -> None:
            st.chunks += len(out)
            st.bytes += sum(map(len, out))
            if emit is None:
                chunks.extend(out)
            else:
                for c in out:
                    emit(c)
            st.per_tensor[name] = st.per_tensor.get(name, 0) + n

        mirror = self.mirror
        for pm, d in taken:
            st.params += pm.hi - pm.lo
            st.changed += d.count
            if pm.residual:
                st.residual_changed += d.count
            if d.count == 0:
                continue
            runs = mirror is not None and not pm.residual and any(mirror.get(pm.name, c) for c in pm.canon)
            ctx = runs and (context_now is None or context_now())
            if (lib is not None and not ctx and not pm.residual and d.xor.element_size() > 1 and d.new is not None
                    and pm.dtype.is_floating_point and not d.positions.is_cuda):
                got = codec.encode_xor_slice(lib, d.positions, pm.lo, d.xor, d.new, pm.dtype, pm.segment_table(),
                                             pm.canon, self.placement.numels(pm), self.span, self.level)
                if got is not None:
                    for cid, out, n, terms in got:
                        if digests is not None:
                            digests[pm.canon[cid]] = digest.move(digests.get(pm.canon[cid], 0), terms)
                        deliver(pm.canon[cid], out, n)
                    if runs:  # coded plain, but the copy follows every version
                        self._advance(pm, d)
                    continue
            for pr in Placement.project(pm, d.positions.numpy(), add=pm.lo):
                pos = torch.from_numpy(pr.positions)
                xor, new = _gather(d.xor, pr.parts), _gather(d.new, pr.parts)
                numel = self.placement.numel(pr.name)
                if pm.residual:
                    if digests is not None:
                        digests[pr.name] = digest.update_xor(digests.get(pr.name, 0), pr.positions, new, xor)
                    out = codec.encode_sparse(pr.name, codec.Kind.OVERWRITE, pm.canon_dtype, numel, pos, new,
                                              span=self.span, level=self.level)
                else:  # the encoder adds the changes' digest terms as it goes (no second pass)
                    terms = None if digests is None else [0, 0]
                    run = mirror.get(pm.name, pr.name) if runs else None
                    if run is not None:  # the run moves to this version's bits (coded from them or not)
                        mirror.advance((pm.name, pr.name), pos - run[0], bits(new))
                    if run is None or not ctx:
                        out = codec.encode_sparse(pr.name, codec.Kind.XOR, pm.dtype, numel, pos, xor, new,
                                                  span=self.span, level=self.level, terms=terms)
                    else:
                        a, cur = run
                        out = codec.encode_sparse(pr.name, codec.Kind.XOR, pm.dtype, numel, pos, xor, new,
                                                  span=self.span, level=self.level, terms=terms, current=cur,
                                                  within=(a, a + cur.numel()))
                    if terms is not None:
                        digests[pr.name] = digest.move(digests.get(pr.name, 0), terms)
                deliver(pr.name, out, pos.numel())
        return chunks, st

    def _advance(self, pm: ParamMap, d: SparseDelta) -> None:
        """Move the mirror's runs of pm to the new bits of a delta coded without it."""
        for pr in Placement.project(pm, d.positions.numpy(), add=pm.lo):
            run = self.mirror.get(pm.name, pr.name)
            if run is not None:
                self.mirror.advance((pm.name, pr.name), torch.from_numpy(pr.positions) - run[0],
                                    bits(_gather(d.new, pr.parts)))


class ShardSender:
    """This rank's baselines and the undo log of the versions taken and not yet settled."""

    def __init__(self, placement: Placement, *, span: int = DEFAULT_CHUNK_SPAN, level: int = 1,
                 baseline: str = "gpu"):
        self.placement = placement
        self.encoder = Encoder(placement, span, level)
        self.active = [pm for pm in placement.params if pm.hi > pm.lo]
        self.baselines: dict[str, torch.Tensor] = {}
        for pm in self.active:
            if pm.residual:
                self.baselines[pm.name] = canonical_values(pm, pm.canon_dtype).clone()
            else:
                self.baselines[pm.name] = pm.param.detach().reshape(-1)[pm.lo:pm.hi].clone()
        self.undo_log: dict[int, list[tuple[ParamMap, SparseDelta]]] = {}  # version -> deltas taken
        self._scratch = Scratch()
        self._side = cuda_kernels.SideStream()
        self.use_baseline(baseline)

    def use_baseline(self, where: str) -> None:
        """Where the baselines of CUDA shards live: "gpu", or "pinned" host memory that the
        kernel reads and writes through UVA (no GPU memory held; the pass is PCIe-bound)."""
        cuda_kernels.check_baseline_option(where)
        for pm in self.active:
            if pm.param.is_cuda:
                like = None if pm.residual else self._current(pm)
                self.baselines[pm.name] = cuda_kernels.place_baseline(self.baselines[pm.name], where, like)

    def rebase(self, canonical: dict[str, torch.Tensor]) -> None:
        """Set every baseline to the bits of the canonical tensors (the receivers' version):
        each owned element is read at its canonical position (the placement's projection).
        A sender restarted from a training checkpoint rebases on the last committed version,
        so its first delta takes receivers from there to the restored weights."""
        self.undo_log.clear()
        for pm in self.active:
            base = self.baselines[pm.name]
            host = _host(base).clone()
            hb = bits(host)
            for pr in Placement.project(pm, np.arange(pm.lo, pm.hi, dtype=np.int64)):
                src = bits(canonical[pr.name].contiguous()).reshape(-1)
                vals = src[torch.from_numpy(np.ascontiguousarray(pr.positions)).to(torch.int64)]
                off = 0
                for a, b in pr.parts:
                    hb[a:b] = vals[off:off + b - a]
                    off += b - a
            base.copy_(host)

    def _current(self, pm: ParamMap) -> torch.Tensor:
        if pm.residual:
            return canonical_values(pm, pm.canon_dtype)
        return pm.param.detach().reshape(-1)[pm.lo:pm.hi]

    def take(self, version: int, outs: list | None = None,
             threads: int | None = None) -> list[tuple[ParamMap, SparseDelta]]:
        """The synchronous part, right after the optimizer step: one fused kernel pass per
        owned slice; the baselines advance to the current bits and the deltas are logged as
        `version`'s undo. outs: per active slice, (positions, xor, new) buffers the CPU kernel
        writes into (delta.take_delta's `out`, sized for `threads`), which the deltas then view."""
        if version in self.undo_log:
            raise ValueError(f"version {version} was taken already")
        taken = []
        for k, pm in enumerate(self.active):
            d = _take(self._current(pm).contiguous(), self.baselines[pm.name], self._scratch, self._side,
                      None if outs is None else outs[k], threads)
            taken.append((pm, d))
        self.undo_log[version] = taken
        return taken

    def encode(self, taken: list[tuple[ParamMap, SparseDelta]], emit: Callable[[bytes], None] | None = None,
               digests: dict[str, int] | None = None,
               context_now: Callable[[], bool] | None = None) -> tuple[list[bytes], StepStats]:
        return self.encoder.encode(taken, emit, digests, context_now)

    def step(self, version: int) -> tuple[list[bytes], StepStats]:
        """take() and encode() in one call (tests and benchmarks; the Publisher encodes in
        its worker)."""
        return self.encode(self.take(version))

    def settle(self, version: int) -> None:
        """The joint commit committed `version`: its undo (and any older) is no longer needed."""
        for v in [v for v in self.undo_log if v <= version]:
            del self.undo_log[v]

    def roll_back(self, version: int | None = None) -> list[int]:
        """Restore the baselines to before `version` (None: the oldest logged): undo it and
        every later version, newest first. Returns the versions undone."""
        undone = sorted((v for v in self.undo_log if version is None or v >= version), reverse=True)
        for v in undone:
            for pm, d in reversed(self.undo_log.pop(v)):
                undo(self.baselines[pm.name], d)
        return undone

    def digests(self) -> dict[str, int]:
        """Additive digests (digest.py) of this rank's slice of every canonical tensor it
        sends, at the current baselines, in canonical positions: slices of all ranks sum to
        the tensor's digest. O(shard) once at start; versions update them from their changes."""
        out: dict[str, int] = {}
        for pm in self.active:
            base = _host(self.baselines[pm.name])
            for pr in Placement.project(pm, np.arange(pm.lo, pm.hi, dtype=np.int64)):
                out[pr.name] = (out.get(pr.name, 0) + digest.sum64(_gather(base, pr.parts), pr.positions)) & digest.MASK
        return out

    def context_runs(self) -> dict[Key, tuple[int, torch.Tensor]]:
        """The worker's context copy (mirror.py) at the current baselines: for each canonical
        tensor a slice reaches as one contiguous run, where the run starts and its bits (a
        copy, on the host). O(shard) once, when the worker starts. The runs are views of one
        buffer per element size: a worker process gets them as one shared segment, not one file
        descriptor per run (thousands for a mixture of experts)."""
        found: list[tuple[Key, int, torch.Tensor]] = []
        for pm in self.active:
            if pm.residual or not context.supported(codec.dtype_info(pm.dtype).name):
                continue
            base = None
            for pr in Placement.project(pm, np.arange(pm.lo, pm.hi, dtype=np.int64)):
                p = pr.positions
                if p.size and int(p[-1]) - int(p[0]) + 1 == p.size:
                    base = _host(self.baselines[pm.name]) if base is None else base
                    found.append(((pm.name, pr.name), int(p[0]), bits(_gather(base, pr.parts))))
        out: dict[Key, tuple[int, torch.Tensor]] = {}
        for dt in {b.dtype for _, _, b in found}:
            mine = [f for f in found if f[2].dtype == dt]
            buf = torch.cat([b.reshape(-1) for _, _, b in mine])  # (a copy: the baselines move on)
            off = 0
            for key, a, b in mine:
                out[key] = (a, buf[off:off + b.numel()])
                off += b.numel()
        return out

    def coverage(self) -> dict[str, np.ndarray]:
        """Every canonical position this rank is responsible for (tests count them)."""
        out: dict[str, list[np.ndarray]] = {}
        for pm in self.active:
            for pr in Placement.project(pm, np.arange(pm.lo, pm.hi, dtype=np.int64)):
                out.setdefault(pr.name, []).append(pr.positions)
        return {k: np.concatenate(v) for k, v in out.items()}


__all__ = ["Encoder", "ShardSender", "StepStats"]
