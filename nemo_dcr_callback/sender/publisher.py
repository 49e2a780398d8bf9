"""The plain-loop API: one call after each optimizer step publishes a version.

    pub = Publisher(model, family=LLAMA, vocab_size=V, store="file:///tmp/run/store")
    for step in ...:
        train_step(...)
        pub.publish(step)          # kernel now; projection, encoding, upload in the background
    pub.close()

`publish` runs the delta kernel synchronously (it must see the weights before the next step
mutates them) and hands the deltas to a background worker (a separate low-priority process
by default, so it never competes for the trainer's GIL; or a thread) that projects, encodes
and uploads them, and on rank 0 seals each version once every rank's manifest is in the
store (no collective). The queued deltas count against a memory budget: past it, `publish`
blocks until the worker catches up (back-pressure). A worker error is raised by the next
`publish`/`flush`/`close`, never dropped: the failed versions' deltas are undone (the
trainer thread owns the baselines) so the next published version covers the gap (XOR deltas
compose) and builds on the last version that was published.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.core.bitops import SparseDelta
from nemo_dcr_callback.placement import Family, Placement, build_placement
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.sender.delta import undo
from nemo_dcr_callback.sender.shard import ShardSender
from nemo_dcr_callback.transport.store import freeze_long_lived, open_store


@dataclass
class PublishStats:
    version: int
    base: int = 0
    params: int = 0
    changed: int = 0
    bytes: int = 0
    chunks: int = 0
    kernel_s: float = 0.0
    encode_s: float = 0.0  # encoding, with the uploads of full parts overlapping it
    upload_s: float = 0.0  # after encoding: the last parts and the manifest
    seal_s: float = 0.0
    commit_s: float = 0.0  # sealed -> decision (acks per the commit policy)
    decision: str = ""
    reason: str = ""
    extra: dict = field(default_factory=dict)


@dataclass
class _WorkerSpec:
    """What the worker needs: the maps without the parameters, and where to write."""

    placement: Placement
    store_url: str
    rank: int
    world: int
    span: int
    level: int
    seal_timeout: float
    nice: int
    policy: commit.CommitPolicy
    base_version: int
    digests: dict[str, int]  # this rank's slice digests at base_version
    part_bytes: int = 4 << 20


DECISION_POLL_S = 0.05  # how often ranks other than 0 first look for a version's decision,
DECISION_MAX_POLL_S = 1.0  # then less and less often, up to this: they are off the refit's path
# (receivers read the decision themselves; a rank only drops or undoes its undo log on it), and
# on S3 each look is a GET, from every rank of the job: 20 a second each at 50 ms throughout


def _lower_priority(nice: int) -> None:
    if nice and hasattr(os, "setpriority"):
        try:  # Linux: a thread is a task with its own nice value; a process, likewise
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass
    if nice >= 19 and hasattr(os, "sched_setscheduler") and threading.current_thread() is threading.main_thread():
        try:  # a worker process runs only on otherwise idle CPU: any training thread preempts it at once
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass


def _worker_loop(spec: _WorkerSpec, jobs, results) -> None:
    """Two stages, each in version order: the upload stage (this thread) encodes each queued
    version and streams its parts and manifest to the store; the commit stage (a thread)
    seals it and runs the joint commit on rank 0, or waits for the decision on other ranks.
    So version k+1 is encoded and uploaded while k waits for receivers' acks. Every outcome is
    reported: ("uploaded", v, stats), ("decided", v, stats) or ("error", v, message)."""
    _lower_priority(spec.nice)
    own_process = threading.current_thread() is threading.main_thread()  # else a thread of the trainer's
    if own_process:  # (in a thread these would set the trainer's intra-op threads and freeze its objects)
        torch.set_num_threads(1)
    store = open_store(spec.store_url)
    if own_process:
        freeze_long_lived()
    results.put(("ready", 0, None))
    sender = ShardSender.__new__(ShardSender)  # encode() needs only the placement and codec options
    sender.placement, sender.span, sender.level = spec.placement, spec.span, spec.level
    digests = {spec.base_version: dict(spec.digests)}  # version -> this rank's slice digests
    status = {spec.base_version: "commit"}  # version -> "commit" | "abort" (shared with the commit stage)
    stage: queue.Queue = queue.Queue()

    def commit_stage() -> None:
        failed = False
        while True:
            item = stage.get()
            if item is None:
                return
            if item[0] == "reset":
                failed = False
                continue
            _, version, base, st = item
            if failed:
                results.put(("error", version, "an earlier version failed"))
                continue
            try:
                t0 = time.perf_counter()
                ok_base = status.get(base) == "commit"
                if spec.rank == 0:
                    if ok_base:
                        rec = commit.seal_version(store, version, base, spec.world, timeout=spec.seal_timeout)
                        st.seal_s = time.perf_counter() - t0
                        d = commit.run_commit(store, rec, spec.policy)
                    else:
                        d = commit.decide(store, version, base, "abort", [], [], f"base version {base} was aborted")
                else:  # off the refit's path (receivers read the decision themselves): poll gently,
                    # each poll is CPU taken from training on a busy host
                    d = commit.await_decision(store, version, spec.seal_timeout + spec.policy.timeout + 60,
                                              poll=DECISION_POLL_S, max_poll=DECISION_MAX_POLL_S)
                st.commit_s = time.perf_counter() - t0 - st.seal_s
                st.decision, st.reason = d["decision"], d["reason"]
                status[version] = d["decision"]
                if d["decision"] == "commit":  # older digests are no longer needed
                    for v in [v for v in digests if v < version]:
                        digests.pop(v, None)
                else:
                    digests.pop(version, None)
                results.put(("decided", version, st))
            except Exception as exc:  # noqa: BLE001 - reported to the trainer
                failed = True
                results.put(("error", version, f"{type(exc).__name__}: {exc}"))

    committer = threading.Thread(target=commit_stage, name="nemo-dcr-commit", daemon=True)
    committer.start()
    failed = False
    parent = os.getppid()
    while True:
        try:
            item = jobs.get(timeout=1.0)
        except queue.Empty:
            if own_process and os.getppid() != parent:  # the training process died: do not linger
                os._exit(1)
            continue
        if item is None:
            stage.put(None)
            committer.join()
            return
        if item[0] == "reset":
            failed = False
            stage.put(("reset",))
            continue
        _, version, base, payload, st = item
        if failed:
            results.put(("error", version, "an earlier version failed"))
            continue
        try:
            if isinstance(payload, list):  # a thread: the undo log's own deltas (read only here)
                taken = [(spec.placement.params[i], d) for i, d in payload]
            else:
                taken = _unpack(spec.placement, payload[0], _attach(payload[1]))
            if status.get(base) != "abort":  # a version on an aborted base is aborted unsent
                t0 = time.perf_counter()
                w = commit.RankWriter(store, version, base, spec.rank, spec.world, part_bytes=spec.part_bytes)
                dig = dict(digests[base])
                ss = sender.encode(taken, emit=w.add, digests=dig)[1]
                _fault_point(spec.rank, version)
                t1 = time.perf_counter()
                w.finish(ss.params, ss.changed, dig)
                digests[version] = dig
                st.params, st.changed, st.bytes, st.chunks = ss.params, ss.changed, ss.bytes, ss.chunks
                st.encode_s, st.upload_s = t1 - t0, time.perf_counter() - t1
            st.base = base
            results.put(("uploaded", version, st))
            stage.put(("v", version, base, st))
        except Exception as exc:  # noqa: BLE001 - reported to the trainer
            failed = True
            results.put(("error", version, f"{type(exc).__name__}: {exc}"))


def _fault_point(rank: int, version: int) -> None:
    """Fault injection (tests/faults): NEMO_DCR_SENDER_FAULT=kill:R:V SIGKILLs rank R's
    training process and its worker once version V's parts are uploaded, before its manifest
    (a node lost mid-upload)."""
    spec = os.environ.get("NEMO_DCR_SENDER_FAULT", "")
    if spec.startswith("kill:"):
        _, r, v = spec.split(":")
        if int(r) == rank and int(v) == version:
            import signal

            if threading.current_thread() is threading.main_thread():  # a worker process
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class _ShmPool:
    """Reusable shared-memory segments that carry each version's deltas to the worker process.
    The trainer writes a version into a free segment (the CPU kernel writes there itself: see
    _Arena); the worker reads it in place (no copy out). The segment is free for a later
    version once the worker has reported the version and its undo log, which may view the
    segment, is gone (Publisher._unhold). So a step creates no segment and takes no
    fresh-page faults."""

    def __init__(self):
        self.free: list = []
        self.busy: dict[int, object] = {}

    def take(self, version: int, size: int):
        from multiprocessing import shared_memory

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


class _Arena:
    """A fixed worst-case layout of one version's deltas in a pooled shared-memory segment: per
    slice, positions, xor and new regions of the kernel's output capacity, which the CPU kernel
    writes straight into. The undo log and the worker both view the segment, so a version's
    deltas are written once (before: copied out of the kernel's scratch, then into shared
    memory: 0.9 ms a rank and step on the demo model). The segment is as large as the shard
    times 8 bytes, but tmpfs holds only the pages written: about the changes' bytes."""

    def __init__(self, sender: ShardSender):
        from nemo_dcr_callback.core import kernels
        from nemo_dcr_callback.core.bitops import BITS_DTYPE, index_dtype
        from nemo_dcr_callback.sender.delta import output_capacity

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
        from nemo_dcr_callback.core import kernels

        return kernels.native() is not None and not any(pm.param.is_cuda for pm in sender.active)

    def outputs(self, seg) -> list:
        views = self._views.get(seg.name)
        if views is None:
            views = self._views[seg.name] = [
                tuple(torch.frombuffer(seg.buf, dtype=dt, count=cap, offset=o) for o, dt, cap in regs)
                for regs in self.regions]
        return views

    def meta(self, index: dict[int, int], taken: list) -> list:
        return [(*_meta(index, pm, d), [o for o, _, _ in regs])
                for (pm, d), regs in zip(taken, self.regions, strict=True)]

    def close(self) -> None:
        self._views.clear()


def _meta(index: dict[int, int], pm, d: SparseDelta) -> tuple:
    """What _unpack needs of one slice's delta: parameter index, count, numel, dtypes."""
    return index[id(pm)], d.count, d.numel, str(d.dtype), [str(a.dtype) for a in (d.positions, d.xor, d.new)]


def _pack(index: dict[int, int], taken: list, pool: _ShmPool | None, version: int) -> tuple | list:
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
    return meta, seg.name, total


_ATTACHED: dict[str, object] = {}  # worker process: segments by name, attached once


def _attach(name: str) -> memoryview:
    """The worker's view of a pooled segment (the trainer owns and unlinks it)."""
    seg = _ATTACHED.get(name)
    if seg is None:  # (the spawned worker shares the trainer's resource tracker: one registration)
        from multiprocessing import shared_memory

        seg = _ATTACHED[name] = shared_memory.SharedMemory(name=name)
    return seg.buf


def _unpack(placement: Placement, meta: list, buf) -> list:
    """Tensors viewing buf (a shared-memory segment) in place: valid until the version is
    reported uploaded."""
    out, off = [], 0
    for i, count, numel, dtype, dts, *at in meta:  # at: the arena's region offsets (else packed in a row)
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


class Publisher:
    def __init__(self, model, *, family: Family, vocab_size: int, store, rank: int | None = None,
                 world: int | None = None, dp_rank: int | None = None, dp_size: int | None = None,
                 max_pending_bytes: int = 1 << 30, span: int = codec.DEFAULT_CHUNK_SPAN, level: int = 1,
                 seal_timeout: float = 600.0, base_version: int = 0, worker: str = "process", nice: int = 19,
                 policy: commit.CommitPolicy | None = None, part_bytes: int = 4 << 20, baseline: str = "gpu",
                 resume: bool = False):
        import torch.distributed as dist

        self.store = open_store(store) if isinstance(store, str) else store
        self.rank = dist.get_rank() if rank is None and dist.is_initialized() else (rank or 0)
        self.world = dist.get_world_size() if world is None and dist.is_initialized() else (world or 1)
        if dp_rank is None or dp_size is None:
            try:
                from megatron.core import parallel_state as ps

                dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            except (ImportError, AssertionError, AttributeError):
                dp_rank, dp_size = 0, 1
        self.placement = build_placement(model, family, vocab_size, dp_rank=dp_rank, dp_size=dp_size)
        self.sender = ShardSender(self.placement, span=span, level=level, baseline=baseline)
        self.version_offset = 0  # version numbers continue after whatever the store holds
        self.resumed_from: int | None = None
        if resume:
            base_version = self._resume(base_version)
        self.policy = policy or commit.CommitPolicy()
        self._index = {id(pm): i for i, pm in enumerate(self.placement.params)}
        self.max_pending = max_pending_bytes
        self.last_version = base_version  # the newest version queued (the base of the next one)
        self.last_committed = base_version
        self._inflight: dict[int, tuple[list, int]] = {}  # version -> (taken deltas, bytes): the undo log
        self._pending = 0
        self._holds: dict[int, set[str]] = {}  # version -> what still reads its shared-memory segment
        self._error: str | None = None
        self._failed: set[int] = set()
        self.history: list[PublishStats] = []  # committed versions
        self.aborted: list[PublishStats] = []
        light = Placement([replace(pm, param=None) for pm in self.placement.params], self.placement.canonical,
                          self.placement.dtype)
        spec = _WorkerSpec(light, self.store.url, self.rank, self.world, span, level, seal_timeout, nice, self.policy,
                           base_version, self.sender.digests(), part_bytes)
        self._process = worker == "process"
        self._shm = _ShmPool() if self._process else None
        self._arena = _Arena(self.sender) if self._process and _Arena.usable(self.sender) else None
        if worker == "process":
            ctx = torch.multiprocessing.get_context("spawn")
            self._jobs, self._results = ctx.Queue(), ctx.Queue()
            self._worker = ctx.Process(target=_worker_loop, args=(spec, self._jobs, self._results),
                                       name=f"nemo-dcr-publisher-{self.rank}", daemon=True)
        elif worker == "thread":
            self._jobs, self._results = queue.Queue(), queue.Queue()
            self._worker = threading.Thread(target=_worker_loop, args=(spec, self._jobs, self._results),
                                            name="nemo-dcr-publisher", daemon=True)
        else:
            raise ValueError(f"worker must be 'process' or 'thread', not {worker!r}")
        self._worker.start()
        # Start-up (a spawned interpreter importing torch) happens here, not during training.
        ready = self._results.get(timeout=300)
        if ready[0] != "ready":
            raise RuntimeError(f"nemo-dcr publisher worker did not start: {ready}")

    def _resume(self, base_version: int) -> int:
        """A job restarted (from a training checkpoint, after a crash): rebase on the store's
        last committed version, rebuilt from its keyframe and committed deltas, so the first
        delta takes receivers from what they hold to the restored weights; versions a dead
        sender left undecided are aborted (rank 0). Receivers never reload anything."""
        last, newest, dangling = commit.resume_point(self.store)
        if newest == 0 and last == 0:
            return base_version  # a fresh store: nothing to resume
        from nemo_dcr_callback.receiver.follow import reconstruct

        if self.rank == 0 and dangling:
            commit.abort_dangling(self.store, dangling, "the senders restarted")
        self.sender.rebase(reconstruct(self.store, last))
        self.version_offset, self.resumed_from = newest, last
        if self.rank == 0:
            print(f"nemo-dcr: resuming after version {last} (aborted unfinished {dangling or 'none'}); "
                  f"next version {newest + 1}", flush=True)
        return last

    def next_version(self) -> int:
        return max(self.last_version, self.version_offset) + 1

    # -------------------------------------------------------------- trainer side
    def publish(self, version: int) -> PublishStats:
        """Take this step's delta and queue it as `version` (> the last one)."""
        self._drain(block=False)
        self._raise()
        if version <= self.last_version:
            raise ValueError(f"version {version} is not after {self.last_version}")
        t0 = time.perf_counter()
        if self._arena is not None:  # the kernel writes into this version's segment
            seg = self._shm.take(version, self._arena.size)
            taken = self.sender.take(self._arena.outputs(seg), self._arena.threads)
        else:
            taken = self.sender.take()
        self.sender.commit()  # the baseline moves now; the undo log below restores it on abort or failure
        st = PublishStats(version=version, base=self.last_version, kernel_s=time.perf_counter() - t0)
        if self._arena is not None:
            payload = self._arena.meta(self._index, taken), seg.name, self._arena.size
        else:
            payload = _pack(self._index, taken, self._shm, version)
        size = sum(d.count * (d.positions.element_size() + 2 * d.xor.element_size()) for _, d in taken)
        while len(self._failed) < len(self._inflight) and self._pending + size > self.max_pending:
            self._drain(block=True, timeout=1.0)  # back-pressure
        self._raise()
        self._inflight[version] = (taken, size)
        self._holds[version] = {"worker", "undo"}
        self._pending += size
        self._jobs.put(("job", version, self.last_version, payload, st))
        self.last_version = version
        return st

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued version is decided (committed or aborted)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._failed) < len(self._inflight):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("publisher flush timed out")
            self._drain(block=True, timeout=1.0)
        self._raise()

    def close(self) -> None:
        """Flush, stop the worker and leave this rank's per-version figures in the store
        (stats/rank-NNNNN.json: kernel, encode, upload, seal and commit times, bytes, changes)."""
        import json

        try:
            self.flush()
        finally:
            self._jobs.put(None)
            self._worker.join(timeout=30)
            if self._shm is not None:
                self._inflight.clear()
                if self._arena is not None:
                    self._arena.close()
                self._shm.close()
        self.store.put(f"stats/rank-{self.rank:05d}.json", json.dumps([asdict(h) for h in self.history]).encode())

    def _undo_from(self, version: int) -> None:
        """Restore the baselines to before `version`: undo it and every later in-flight one."""
        for v in sorted((v for v in self._inflight if v >= version), reverse=True):
            taken, size = self._inflight.pop(v)
            self._pending -= size
            self._failed.discard(v)
            for pm, d in reversed(taken):
                undo(self.sender.baselines[pm.name], d)
            self._unhold(v, "undo")

    def _unhold(self, version: int, why: str) -> None:
        """A version's segment is held by the worker (until its first report: done reading) and
        by the undo log (until committed or undone, which may come first: an abort undoes the
        later versions the worker may still be encoding). Free when both have let go."""
        held = self._holds.get(version)
        if held is None:
            return
        held.discard(why)
        if not held:
            del self._holds[version]
            if self._shm is not None:
                self._shm.release(version)

    def _drain(self, block: bool, timeout: float | None = None) -> None:
        """Take the worker's reports (in version order per stage). A commit drops the
        version's undo log; an abort restores the baselines to the last committed version
        (the next version then carries the aborted changes too: XOR deltas compose); a
        failure is kept until _raise."""
        while len(self._failed) < len(self._inflight):
            try:
                kind, version, info = self._results.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            self._unhold(version, "worker")  # the worker is done reading this version's deltas
            if version not in self._inflight:
                continue  # already undone (a later version of an aborted chain)
            if kind == "decided" and info.decision == "commit":
                _, size = self._inflight.pop(version)
                self._unhold(version, "undo")
                self._pending -= size
                self.history.append(info)
                self.last_committed = version
            elif kind == "decided":
                self.aborted.append(info)
                self._undo_from(version)
                self.last_version = self.last_committed
                if self.rank == 0:
                    print(f"dcr: version {version} aborted ({info.reason}); baselines back at version "
                          f"{self.last_committed}", flush=True)
            elif kind == "error":
                self._failed.add(version)
                self._error = self._error or f"version {version}: {info}"

    def _raise(self) -> None:
        """After a failure: wait for every in-flight version's report (all later ones fail
        too), undo their deltas newest first, so the baselines are back at the last committed
        version, and let the worker take jobs again."""
        if self._error is None:
            return
        while len(self._failed) < len(self._inflight):
            self._drain(block=True, timeout=1.0)
        if self._inflight:
            self._undo_from(min(self._inflight))
        self._failed.clear()
        self._pending = 0
        err, self._error = self._error, None
        self.last_version = self.last_committed
        self._jobs.put(("reset",))
        raise RuntimeError(f"nemo-dcr publisher failed: {err}")
