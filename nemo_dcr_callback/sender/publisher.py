"""The plain-loop API: one call after each optimizer step publishes a version.

    pub = Publisher(model, family=LLAMA, vocab_size=V, store="file:///tmp/run/store")
    for step in ...:
        train_step(...)
        pub.publish(step)          # kernel now; projection, encoding, upload in the background
    pub.close()

`publish` runs the delta kernel synchronously (it must see the weights before the next step
mutates them) and hands the deltas to a background worker (worker.py: a separate
low-priority process by default, so it never competes for the trainer's GIL; or a thread)
that projects, encodes and uploads them, and on rank 0 seals each version once every rank's
manifest is in the store (no collective). The queued deltas count against a memory budget:
past it, `publish` blocks until the worker catches up (back-pressure). A worker error is
raised by the next `publish`/`flush`/`close`, never dropped: the failed versions' deltas are
undone (the trainer thread owns the baselines and their one undo log, ShardSender.undo_log)
so the next published version covers the gap (XOR deltas compose) and builds on the last
version that was committed.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

from nemo_dcr_callback.config import PublisherConfig
from nemo_dcr_callback.launcher import collective_device
from nemo_dcr_callback.placement import Family, Placement, build_placement
from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.protocol.rebuild import reconstruct
from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.sender.messages import Decided, Failed, Job, PublishStats, Ready, Report, Reset, Stop
from nemo_dcr_callback.sender.shard import ShardSender, context_possible
from nemo_dcr_callback.sender.shm import Arena, ShmPool, pack
from nemo_dcr_callback.sender.worker import DECISION_MAX_POLL_S, DECISION_POLL_S, WorkerSpec, run_worker
from nemo_dcr_callback.transport.patient import PatientStore
from nemo_dcr_callback.transport.store import open_store

__all__ = ["DECISION_MAX_POLL_S", "DECISION_POLL_S", "PublishStats", "Publisher", "PublisherConfig", "Stopping"]

STATS_KEPT = 10_000  # versions whose figures a Publisher keeps (history, aborted; stats/ at close)


class Stopping(RuntimeError):
    """A stop was asked for (SIGTERM) while a step waited for room in the queue: the step is
    not published, and the trainer leaves instead of waiting on decisions that may never come
    (a peer rank dead, the store down)."""


class Publisher:
    """Publishes this rank's shards of `model` to `store` (a URL or an open store), one version
    per publish() call. rank/world default to torch.distributed's, dp_rank/dp_size to
    Megatron's data-parallel group; base_version is the version the weights are at."""

    def __init__(self, model, *, family: Family, vocab_size: int, store, config: PublisherConfig | None = None,
                 rank: int | None = None, world: int | None = None, dp_rank: int | None = None,
                 dp_size: int | None = None, base_version: int = 0, **options):
        cfg = self.config = replace(config or PublisherConfig(), **options)
        self.rank = dist.get_rank() if rank is None and dist.is_initialized() else (rank or 0)
        # the trainer's own writes (keyframes, exports, stats) ride out an outage as the worker's do
        store = open_store(store) if isinstance(store, str) else store
        self.store = store if isinstance(store, PatientStore) else PatientStore(store, cfg.store_patience_s,
                                                                                who=f"dcr rank {self.rank}")
        self.world = dist.get_world_size() if world is None and dist.is_initialized() else (world or 1)
        if dp_rank is None or dp_size is None:
            try:
                # start-up cost: megatron.core takes ~2 s to import; a plain torch model works without it
                from megatron.core import parallel_state as ps

                dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            except (ImportError, AssertionError, AttributeError):
                dp_rank, dp_size = 0, 1
        self.placement = build_placement(model, family, vocab_size, dp_rank=dp_rank, dp_size=dp_size)
        self.sender = ShardSender(self.placement, span=cfg.span, level=cfg.level, baseline=cfg.baseline)
        self.version_offset = 0  # version numbers continue after whatever the store holds
        self.resumed_from: int | None = None
        if cfg.resume:
            base_version = self._resume(base_version)
        self.policy = cfg.policy
        self._index = {id(pm): i for i, pm in enumerate(self.placement.params)}
        self.max_pending = cfg.max_pending_bytes
        self.last_version = base_version  # the newest version queued (the base of the next one)
        self.last_committed = base_version
        self._inflight: dict[int, int] = {}  # version -> its deltas' bytes, queued and not yet decided
        self._pending = 0
        self._holds: dict[int, set[str]] = {}  # version -> what still reads its shared-memory segment
        self._error: str | None = None
        self._failed: set[int] = set()
        # Ranks other than 0 learn a version's decision when their worker reads it, each at its
        # own time; the base of the next version must be the same on every rank. So only rank
        # 0 acts on an abort at once, and tells the others at each publish (_agree): a rank that
        # rolled back on its own report published on the last committed version while rank 0
        # was still on the chain (or the reverse), the seal refused the version ("ranks
        # disagree") and the job stopped, or every version after an abort aborted until a
        # restart (the chaos soak: 250 versions).
        self._agreeing = self.world > 1 and dist.is_initialized() and dist.get_world_size() == self.world
        self._deferred: set[int] = set()  # aborts reported here, not yet acted on (ranks != 0)
        # the newest STATS_KEPT versions' figures (committed; aborted): a run publishes for days
        self.history: deque[PublishStats] = deque(maxlen=STATS_KEPT)
        self.aborted: deque[PublishStats] = deque(maxlen=STATS_KEPT)
        # set by the trainer (the callback: Lightning's SIGTERM flag); a back-pressure wait checks it
        self.stop_requested: Callable[[], bool] = lambda: False
        self._process = cfg.worker == "process"
        self._shm = ShmPool() if self._process else None
        self._arena = Arena(self.sender) if self._process and Arena.usable(self.sender) else None
        self._start_worker(base_version)

    def _start_worker(self, base_version: int) -> None:
        """Start the worker with the maps (not the parameters) and wait until it is up."""
        cfg = self.config
        light = Placement([replace(pm, param=None) for pm in self.placement.params], self.placement.canonical,
                          self.placement.dtype)
        runs = self.sender.context_runs() if context_possible(cfg.context, self.store, cfg.link_mbit) else None
        spec = WorkerSpec(light, self.store.url, self.rank, self.world, cfg.span, cfg.level, cfg.seal_timeout,
                          cfg.nice, self.policy, base_version, self.sender.digests(), cfg.part_bytes, runs,
                          cfg.context, cfg.link_mbit, cfg.store_patience_s)
        if self._process:
            ctx = torch.multiprocessing.get_context("spawn")
            self._jobs, self._results = ctx.Queue(), ctx.Queue()
            self._worker = ctx.Process(target=run_worker, args=(spec, self._jobs, self._results),
                                       name=f"nemo-dcr-publisher-{self.rank}", daemon=True)
        else:
            self._jobs, self._results = queue.Queue(), queue.Queue()
            self._worker = threading.Thread(target=run_worker, args=(spec, self._jobs, self._results),
                                            name="nemo-dcr-publisher", daemon=True)
        self._worker.start()
        # Start-up (a spawned interpreter importing torch) happens here, not during training.
        ready = self._results.get(timeout=300)
        if not isinstance(ready, Ready):
            raise RuntimeError(f"nemo-dcr publisher worker did not start: {ready}")

    def _resume(self, base_version: int) -> int:
        """A job restarted (from a training checkpoint, after a crash): rebase on the store's
        last committed version, rebuilt from its keyframe and committed deltas, so the first
        delta takes receivers from what they hold to the restored weights; versions a dead
        sender left undecided are aborted (rank 0). Receivers never reload anything."""
        last, newest, dangling = commit.resume_point(self.store)
        if newest == 0 and last == 0:
            return base_version  # a fresh store: nothing to resume
        if self.rank == 0 and dangling:
            commit.abort_dangling(self.store, dangling, "the senders restarted", base=last)
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
        self._drain(block=False, defer_aborts=self._agreeing and self.rank != 0)
        self._raise()
        if self._agreeing:
            self._agree()
        if version <= self.last_version:
            raise ValueError(f"version {version} is not after {self.last_version}")
        t0 = time.perf_counter()
        if self._arena is not None:  # the kernel writes into this version's segment
            seg = self._shm.take(version, self._arena.size)
            taken = self.sender.take(version, self._arena.outputs(seg), self._arena.threads)
        else:
            taken = self.sender.take(version)  # the baselines advance; the sender logs the undo until decided
        st = PublishStats(version=version, base=self.last_version, kernel_s=time.perf_counter() - t0)
        if self._arena is not None:
            payload = self._arena.payload(self._index, taken, seg)
        else:
            payload = pack(self._index, taken, self._shm, version)
        size = sum(d.count * (d.positions.element_size() + 2 * d.xor.element_size()) for _, d in taken)
        while (self._undecided()
               and self._pending + size > self.max_pending):  # back-pressure
            if self.stop_requested():
                raise Stopping(f"dcr rank {self.rank}: a stop was asked for while version {version} waited for "
                               f"room in the queue ({len(self._inflight)} versions undecided); not published")
            self._drain(block=True, timeout=1.0, defer_aborts=self._agreeing and self.rank != 0)
        self._raise()
        self._inflight[version] = size
        self._holds[version] = {"worker", "undo"}
        self._pending += size
        self._jobs.put(Job(version, self.last_version, payload, st))
        self.last_version = version
        return st

    def _agree(self) -> None:
        """Every rank takes rank 0's view of the decisions before taking this step's delta (a
        broadcast of two numbers: the last committed version, and the base rank 0 publishes on).
        Where rank 0 rolled back after an abort, the others roll back to the same version now,
        whether or not their own worker has read the decision yet."""
        view = torch.tensor([self.last_committed, self.last_version], dtype=torch.int64, device=collective_device())
        dist.broadcast(view, src=0)
        committed, base = (int(x) for x in view.tolist())
        if self.rank == 0:
            return
        for v in sorted(v for v in self._inflight if v <= committed and v not in self._deferred):
            self._pending -= self._inflight.pop(v)  # committed: rank 0 saw the decision first
            self.sender.settle(v)
            self._unhold(v, "undo")
        self.last_committed = max(self.last_committed, committed)
        if base == committed and self.last_version > base:  # rank 0 rolled back to it
            self._roll_back(base + 1)
            self.last_version = base
        self._deferred = {v for v in self._deferred if v in self._inflight}

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued version is decided (committed or aborted)."""
        for v in sorted(self._deferred):  # (every rank flushes: every rank ends on the last commit)
            if v in self._inflight:
                self._roll_back(v)
                self.last_version = self.last_committed
        self._deferred.clear()
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._failed) < len(self._inflight):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("publisher flush timed out")
            self._drain(block=True, timeout=1.0)
        self._raise()

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the worker and leave this rank's per-version figures in the store
        (stats/rank-NNNNN.json: kernel, encode, upload, seal and commit times, bytes, changes).

        timeout: at an exception or a stop, how long to wait for undecided versions. A peer
        rank that died never seals its part, so a full flush waited out the seal timeout per
        version while the launcher's SIGKILL came first (the chaos soak: 30 s per trainer kill).
        Versions left undecided are aborted by the next start (commit.resume_point); nothing
        the receivers hold depends on them."""
        left: list[int] = []
        try:
            try:
                self.flush(timeout)
            except TimeoutError:
                left = sorted(self._inflight)
                print(f"dcr rank {self.rank}: {len(left)} version(s) undecided after {timeout:.0f} s "
                      f"({left[0]}..{left[-1]}): left to the next start, which aborts them", flush=True)
        finally:
            self._jobs.put(Stop())
            self._worker.join(timeout=30 if timeout is None else max(1.0, timeout / 4))
            if self._worker.is_alive() and hasattr(self._worker, "kill"):
                self._worker.kill()  # (mid-commit: the decision is the store's, the next start reads it)
                self._worker.join(5)
            if self._shm is not None:
                self._inflight.clear()
                self.sender.undo_log.clear()  # (its deltas view the segments freed below)
                if self._arena is not None:
                    self._arena.close()
                self._shm.close()
        stats = json.dumps([asdict(h) for h in self.history]).encode()
        if timeout is None:
            self.store.put(keys.stats_key(self.rank), stats)
            return
        try:  # leaving in a hurry: once, without the store's patience
            self.store.impatient.put(keys.stats_key(self.rank), stats)
        except StoreError as exc:
            print(f"dcr rank {self.rank}: figures not written at exit ({exc})", flush=True)

    def _roll_back(self, version: int) -> None:
        """Restore the baselines to before `version`: undo it and every later in-flight one."""
        self.sender.roll_back(version)
        for v in [v for v in self._inflight if v >= version]:
            self._pending -= self._inflight.pop(v)
            self._failed.discard(v)
            self._deferred.discard(v)
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

    def _drain(self, block: bool, timeout: float | None = None, defer_aborts: bool = False) -> None:
        """Take the worker's reports (in version order per stage). A commit settles the
        version (its undo is dropped); an abort restores the baselines to the last committed version
        (the next version then carries the aborted changes too: XOR deltas compose); a
        failure is kept until _raise."""
        while self._undecided():
            try:
                msg: Report = self._results.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            version = msg.version
            self._unhold(version, "worker")  # the worker is done reading this version's deltas
            if version not in self._inflight:
                continue  # already undone (a later version of an aborted chain)
            if isinstance(msg, Decided) and msg.stats.decision == "commit":
                self._pending -= self._inflight.pop(version)
                self.sender.settle(version)
                self._unhold(version, "undo")
                self.history.append(msg.stats)
                self.last_committed = version
            elif isinstance(msg, Decided) and defer_aborts:
                self.aborted.append(msg.stats)
                self._deferred.add(version)  # acted on when rank 0 says so (_agree), or at flush
            elif isinstance(msg, Decided):
                self.aborted.append(msg.stats)
                self._roll_back(version)
                self.last_version = self.last_committed
                if self.rank == 0:
                    print(f"dcr: version {version} aborted ({msg.stats.reason}); baselines back at version "
                          f"{self.last_committed}", flush=True)
            elif isinstance(msg, Failed):
                self._failed.add(version)
                self._error = self._error or f"version {version}: {msg.message}"

    def _undecided(self) -> bool:
        """Are versions in flight that this rank has no outcome for yet? (A failed one is
        done; an abort deferred until rank 0 confirms it (_agree) is known.)"""
        return len(self._failed) + len(self._deferred) < len(self._inflight)

    def _raise(self) -> None:
        """After a failure: wait for every in-flight version's report (all later ones fail
        too), undo their deltas newest first, so the baselines are back at the last committed
        version, and let the worker take jobs again."""
        if self._error is None:
            return
        while self._undecided():
            self._drain(block=True, timeout=1.0)
        if self._inflight:
            self._roll_back(min(self._inflight))
        self._failed.clear()
        self._pending = 0
        err, self._error = self._error, None
        self.last_version = self.last_committed
        self._jobs.put(Reset())
        raise RuntimeError(f"nemo-dcr publisher failed: {err}")
