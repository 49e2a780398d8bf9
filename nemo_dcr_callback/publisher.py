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

from nemo_dcr_callback import codec, commit
from nemo_dcr_callback.delta import SparseDelta, undo
from nemo_dcr_callback.placement import Family, Placement, build_placement
from nemo_dcr_callback.sender import ShardSender
from nemo_dcr_callback.transport.store import open_store


@dataclass
class PublishStats:
    version: int
    params: int = 0
    changed: int = 0
    bytes: int = 0
    chunks: int = 0
    kernel_s: float = 0.0
    encode_s: float = 0.0
    upload_s: float = 0.0
    seal_s: float = 0.0
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


def _worker_loop(spec: _WorkerSpec, jobs, results) -> None:
    """Encode, upload and (rank 0) seal each queued version; report every outcome."""
    if spec.nice and hasattr(os, "setpriority"):
        try:  # Linux: a thread is a task with its own nice value; a process, likewise
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), spec.nice)
        except OSError:
            pass
    if spec.nice >= 19 and hasattr(os, "sched_setscheduler") and threading.current_thread() is threading.main_thread():
        try:  # a worker process runs only on otherwise idle CPU: any training thread preempts it at once
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass
    torch.set_num_threads(1)
    store = open_store(spec.store_url)
    results.put(("ready", True, None, None))
    sender = ShardSender.__new__(ShardSender)  # encode() needs only the placement and codec options
    sender.placement, sender.span, sender.level = spec.placement, spec.span, spec.level
    failed = False
    while True:
        item = jobs.get()
        if item is None:
            return
        if item[0] == "reset":
            failed = False
            continue
        _, version, base, payload, st = item
        if failed:
            results.put((version, False, "an earlier version failed", None))
            continue
        try:
            taken = _unpack(spec.placement, _from_shm(payload) if isinstance(payload[1], str) else payload)
            t0 = time.perf_counter()
            chunks, ss = sender.encode(taken)
            t1 = time.perf_counter()
            headers = [codec.parse_header(c, verify=False) for c in chunks]
            commit.write_rank(store, version, spec.rank, spec.world, chunks, ss.params, ss.changed, headers)
            t2 = time.perf_counter()
            if spec.rank == 0:
                commit.seal_version(store, version, base, spec.world, timeout=spec.seal_timeout)
            st.seal_s = time.perf_counter() - t2
            st.params, st.changed, st.bytes, st.chunks = ss.params, ss.changed, ss.bytes, ss.chunks
            st.encode_s, st.upload_s = t1 - t0, t2 - t1
            results.put((version, True, None, st))
        except Exception as exc:  # noqa: BLE001 - reported to the trainer
            failed = True
            results.put((version, False, f"{type(exc).__name__}: {exc}", None))


def _pack(index: dict[int, int], taken: list, shm: bool) -> tuple:
    """The deltas of one version as one blob, written straight into a shared-memory segment
    for a worker process (the queue then carries only its name: no per-tensor segments, no
    feeder thread streaming megabytes through a pipe under the trainer's GIL), or as bytes."""
    meta, arrs = [], []
    for pm, d in taken:
        parts = [d.positions, d.xor, d.new]
        meta.append((index[id(pm)], d.count, d.numel, str(d.dtype), [str(a.dtype) for a in parts]))
        arrs += [a.contiguous().view(torch.uint8).numpy() for a in parts]
    if not shm:
        return meta, b"".join(a.tobytes() for a in arrs)
    from multiprocessing import shared_memory

    total = sum(a.size for a in arrs)
    seg = shared_memory.SharedMemory(create=True, size=max(total, 1))
    off = 0
    for a in arrs:
        seg.buf[off:off + a.size] = a
        off += a.size
    name = seg.name
    seg.close()
    return meta, name, total


def _from_shm(payload: tuple[list, str, int]) -> tuple[list, bytes]:
    from multiprocessing import shared_memory

    meta, name, n = payload
    shm = shared_memory.SharedMemory(name=name)
    try:
        return meta, bytes(shm.buf[:n])
    finally:
        shm.close()
        shm.unlink()


def _unpack(placement: Placement, payload: tuple[list, bytes]) -> list:
    meta, blob = payload
    out, off = [], 0
    for i, count, numel, dtype, dts in meta:
        arrs = []
        for dt in dts:
            tdt = getattr(torch, dt.replace("torch.", ""))
            nbytes = count * torch.empty(0, dtype=tdt).element_size()
            arrs.append(torch.frombuffer(bytearray(blob[off:off + nbytes]), dtype=tdt) if nbytes else
                        torch.empty(0, dtype=tdt))
            off += nbytes
        out.append((placement.params[i], SparseDelta(arrs[0], arrs[1], numel,
                                                     getattr(torch, dtype.replace("torch.", "")), arrs[2])))
    return out


class Publisher:
    def __init__(self, model, *, family: Family, vocab_size: int, store, rank: int | None = None,
                 world: int | None = None, dp_rank: int | None = None, dp_size: int | None = None,
                 max_pending_bytes: int = 1 << 30, span: int = codec.DEFAULT_CHUNK_SPAN, level: int = 1,
                 seal_timeout: float = 600.0, base_version: int = 0, worker: str = "process", nice: int = 19):
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
        self.sender = ShardSender(self.placement, span=span, level=level)
        self._index = {id(pm): i for i, pm in enumerate(self.placement.params)}
        self.max_pending = max_pending_bytes
        self.last_version = base_version  # the version receivers hold before the next one
        self._last_good = base_version
        self._inflight: dict[int, tuple[list, int]] = {}  # version -> (taken deltas, bytes)
        self._pending = 0
        self._error: str | None = None
        self._failed: set[int] = set()
        self.history: list[PublishStats] = []
        light = Placement([replace(pm, param=None) for pm in self.placement.params], self.placement.canonical,
                          self.placement.dtype)
        spec = _WorkerSpec(light, self.store.url, self.rank, self.world, span, level, seal_timeout, nice)
        self._process = worker == "process"
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

    # -------------------------------------------------------------- trainer side
    def publish(self, version: int) -> PublishStats:
        """Take this step's delta and queue it as `version` (> the last one)."""
        self._drain(block=False)
        self._raise()
        if version <= self.last_version:
            raise ValueError(f"version {version} is not after {self.last_version}")
        t0 = time.perf_counter()
        taken = self.sender.take()
        self.sender.commit()  # the baseline moves now; a failed upload undoes it (see _raise)
        st = PublishStats(version=version, kernel_s=time.perf_counter() - t0)
        payload = _pack(self._index, taken, self._process)
        size = sum(d.count * (d.positions.element_size() + 2 * d.xor.element_size()) for _, d in taken)
        while len(self._failed) < len(self._inflight) and self._pending + size > self.max_pending:
            self._drain(block=True, timeout=1.0)  # back-pressure
        self._raise()
        self._inflight[version] = (taken, size)
        self._pending += size
        self._jobs.put(("job", version, self.last_version, payload, st))
        self.last_version = version
        return st

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued version is uploaded (and sealed on rank 0)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._failed) < len(self._inflight):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("publisher flush timed out")
            self._drain(block=True, timeout=1.0)
        self._raise()

    def close(self) -> None:
        """Flush, stop the worker and leave this rank's per-version figures in the store
        (stats/rank-NNNNN.json: kernel, encode, upload and seal times, bytes, changes)."""
        import json

        try:
            self.flush()
        finally:
            self._jobs.put(None)
            self._worker.join(timeout=30)
        self.store.put(f"stats/rank-{self.rank:05d}.json", json.dumps([asdict(h) for h in self.history]).encode())

    def _drain(self, block: bool, timeout: float | None = None) -> None:
        """Take the worker's reports (they come in version order): successes join the
        history; failures are kept in flight until _raise undoes them."""
        while len(self._failed) < len(self._inflight):
            try:
                version, ok, err, st = self._results.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            if version not in self._inflight:
                continue
            if ok:
                _, size = self._inflight.pop(version)
                self._pending -= size
                self.history.append(st)
                self._last_good = version
            else:
                self._failed.add(version)
                self._error = self._error or f"version {version}: {err}"
            block = False

    def _raise(self) -> None:
        """After a failure: wait for every in-flight version's report (all later ones fail
        too), undo their deltas newest first, so the baselines are back at the last published
        version, and let the worker take jobs again."""
        if self._error is None:
            return
        while len(self._failed) < len(self._inflight):
            self._drain(block=True, timeout=1.0)
        for v in sorted(self._inflight, reverse=True):
            taken, _ = self._inflight.pop(v)
            for pm, d in reversed(taken):
                undo(self.sender.baselines[pm.name], d)
        self._failed.clear()
        self._pending = 0
        err, self._error = self._error, None
        self.last_version = self._last_good
        self._jobs.put(("reset",))
        raise RuntimeError(f"nemo-dcr publisher failed: {err}")
