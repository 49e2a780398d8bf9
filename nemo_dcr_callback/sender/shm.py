"""How a version's deltas reach the worker process: pooled shared-memory segments.

The trainer writes a version's deltas into a segment (`pack`, or the CPU kernel straight into
an `Arena`); the job carries only the segment's name and layout (`ShmPayload`); the worker
views the deltas in place (`attach`, `unpack`). A worker thread gets the deltas themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.core.delta import output_capacity
from nemo_dcr_callback.core.rawbits import BITS_DTYPE, SparseDelta, index_dtype
from nemo_dcr_callback.placement import Placement
from nemo_dcr_callback.sender.shard import ShardSender

# One slice's delta in a segment: (parameter index, count, numel, dtype, [positions, xor, new
# dtypes]) and, in an arena, [the three regions' offsets] (else the arrays follow each other).
# Plain tuples: hundreds of them are pickled per version under the trainer's GIL.
SliceMeta = tuple


@dataclass(frozen=True)
class ShmPayload:
    """A version's deltas in a shared-memory segment: its layout, name and size."""

    meta: list[SliceMeta]
    segment: str
    size: int


class ShmPool:
    """Reusable shared-memory segments that carry each version's deltas to the worker process.
    The trainer writes a version into a free segment (the CPU kernel writes there itself: see
    Arena); the worker reads it in place (no copy out). The segment is free for a later
    version once the worker has reported the version and its undo log, which may view the
    segment, is gone (Publisher._unhold). So a step creates no segment and takes no
    fresh-page faults."""

    def __init__(self):
        self.free: list = []
        self.busy: dict[int, object] = {}

    def take(self, version: int, size: int):
        fits = [s for s in self.free if s.size >= size]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            self.free.remove(seg)
        else:  # headroom, so the next versions (a few % larger or smaller) fit too
            seg = shared_memory.SharedMemory(create=True, size=max(size + size // 4, 1 << 16))
        self.busy[version] = seg
        return seg

    def release(self, version: int) -> None:
        seg = self.busy.pop(version, None)
        if seg is not None:
            self.free.append(seg)

    def close(self) -> None:
        for seg in [*self.free, *self.busy.values()]:
            try:
                seg.close()
            except BufferError:  # a tensor still views it (a caller kept a delta): unmapped at exit
                pass
            seg.unlink()
        self.free, self.busy = [], {}


class Arena:
    """A fixed worst-case layout of one version's deltas in a pooled shared-memory segment: per
    slice, positions, xor and new regions of the kernel's output capacity, which the CPU kernel
    writes straight into. The undo log and the worker both view the segment, so a version's
    deltas are written once (before: copied out of the kernel's scratch, then into shared
    memory: 0.9 ms a rank and step on the demo model). The segment is as large as the shard
    times 8 bytes, but tmpfs holds only the pages written: about the changes' bytes."""

    def __init__(self, sender: ShardSender):
        self.threads = kernels.num_threads()
        self.regions: list[list[tuple[int, torch.dtype, int]]] = []  # per active slice: (offset, dtype, elements) x3
        off = 0
        for pm in sender.active:
            n = pm.hi - pm.lo
            cap = output_capacity(n, self.threads)
            bdt = BITS_DTYPE[sender.baselines[pm.name].element_size()]
            regs = []
            for dt in (index_dtype(n), bdt, bdt):
                off = (off + 63) & ~63  # each region on its own cache line
                regs.append((off, dt, cap))
                off += cap * dt.itemsize
            self.regions.append(regs)
        self.size = max(off, 1)
        self._views: dict[str, list] = {}  # segment name -> per-slice (positions, xor, new) views

    @staticmethod
    def usable(sender: ShardSender) -> bool:
        """Only CPU shards with the compiled kernel write into caller buffers."""
        return kernels.native() is not None and not any(pm.param.is_cuda for pm in sender.active)

    def outputs(self, seg) -> list:
        """Per active slice, the (positions, xor, new) tensors viewing seg: the kernel's outputs."""
        views = self._views.get(seg.name)
        if views is None:
            views = self._views[seg.name] = [
                tuple(torch.frombuffer(seg.buf, dtype=dt, count=cap, offset=o) for o, dt, cap in regs)
                for regs in self.regions]
        return views

    def payload(self, index: dict[int, int], taken: list, seg) -> ShmPayload:
        """The job's payload for deltas the kernel wrote into seg."""
        meta = [(*_meta(index, pm, d), [o for o, _, _ in regs])
                for (pm, d), regs in zip(taken, self.regions, strict=True)]
        return ShmPayload(meta, seg.name, self.size)

    def close(self) -> None:
        self._views.clear()


def _meta(index: dict[int, int], pm, d: SparseDelta) -> SliceMeta:
    """What unpack needs of one slice's delta: parameter index, count, numel, dtypes."""
    return index[id(pm)], d.count, d.numel, str(d.dtype), [str(a.dtype) for a in (d.positions, d.xor, d.new)]


def pack(index: dict[int, int], taken: list, pool: ShmPool | None, version: int) -> ShmPayload | list:
    """The deltas of one version for the worker. A process gets one blob written straight into
    a pooled shared-memory segment (the queue then carries only its name: no feeder thread
    streaming megabytes through a pipe under the trainer's GIL). A thread gets the deltas
    themselves, by parameter index: they are the undo log's own copies, which nothing writes
    until the worker has reported the version."""
    if pool is None:
        return [(index[id(pm)], d) for pm, d in taken]
    meta, arrs = [], []
    for pm, d in taken:
        parts = [d.positions, d.xor, d.new]
        meta.append(_meta(index, pm, d))
        arrs += [a.contiguous().view(torch.uint8).numpy() for a in parts]
    total = sum(a.size for a in arrs)
    seg = pool.take(version, total)
    off = 0
    for a in arrs:
        seg.buf[off:off + a.size] = a
        off += a.size
    return ShmPayload(meta, seg.name, total)


_ATTACHED: dict[str, object] = {}  # worker process: segments by name, attached once


def attach(name: str) -> memoryview:
    """The worker's view of a pooled segment (the trainer owns and unlinks it)."""
    seg = _ATTACHED.get(name)
    if seg is None:  # (the spawned worker shares the trainer's resource tracker: one registration)
        seg = _ATTACHED[name] = shared_memory.SharedMemory(name=name)
    return seg.buf


def unpack(placement: Placement, payload: ShmPayload | list) -> list:
    """(parameter map, delta) pairs of a job's payload. From a segment: tensors viewing it in
    place, valid until the version is reported uploaded."""
    if isinstance(payload, list):  # a thread: the undo log's own deltas (read only here)
        return [(placement.params[i], d) for i, d in payload]
    buf = attach(payload.segment)
    out, off = [], 0
    for i, count, numel, dtype, dts, *at in payload.meta:  # at: the arena's region offsets (else packed in a row)
        arrs = []
        for k, dt in enumerate(dts):
            tdt = getattr(torch, dt.replace("torch.", ""))
            if at:
                off = at[0][k]
            arrs.append(torch.frombuffer(buf, dtype=tdt, count=count, offset=off) if count else
                        torch.empty(0, dtype=tdt))
            off += count * arrs[-1].element_size()
        out.append((placement.params[i], SparseDelta(arrs[0], arrs[1], numel,
                                                     getattr(torch, dtype.replace("torch.", "")), arrs[2])))
    return out
