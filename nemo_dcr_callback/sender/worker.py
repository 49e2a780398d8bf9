"""The Publisher's background worker: a low-priority process (or a thread of the trainer's).

Two stages, each in version order: the upload stage (the worker's main thread) encodes each
queued version and streams its parts and manifest to the store; the commit stage (a thread)
seals it and runs the joint commit on rank 0, or waits for the decision on other ranks. So
version k+1 is encoded and uploaded while k waits for receivers' acks. Every job is answered
(messages.py): Uploaded, then Decided, or Failed; after a failure every later job fails too
until the trainer, having undone them, sends Reset.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from dataclasses import dataclass

import torch

from nemo_dcr_callback import faults
from nemo_dcr_callback.config import PART_BYTES, CommitPolicy
from nemo_dcr_callback.placement import Placement
from nemo_dcr_callback.protocol import commit, upload
from nemo_dcr_callback.sender.messages import Decided, Failed, Job, PublishStats, Ready, Reset, Stop, Uploaded
from nemo_dcr_callback.sender.mirror import Mirror
from nemo_dcr_callback.sender.shard import Encoder, context_gate
from nemo_dcr_callback.sender.shm import unpack
from nemo_dcr_callback.transport.patient import PatientStore
from nemo_dcr_callback.transport.store import freeze_long_lived, open_store

DECISION_POLL_S = 0.05  # how often ranks other than 0 first look for a version's decision,
DECISION_MAX_POLL_S = 1.0  # then less and less often, up to this: they are off the refit's path
# (receivers read the decision themselves; a rank only drops or undoes its undo log on it), and
# on S3 each look is a GET, from every rank of the job: 20 a second each at 50 ms throughout


@dataclass
class WorkerSpec:
    """What the worker needs: the maps without the parameters, and where to write."""

    placement: Placement
    store_url: str
    rank: int
    world: int
    span: int
    level: int
    seal_timeout: float
    nice: int
    policy: CommitPolicy
    base_version: int
    digests: dict[str, int]  # this rank's slice digests at base_version
    part_bytes: int = PART_BYTES
    # context coding: the new bits of the runs this rank owns whole at base_version
    # (ShardSender.context_runs; mirror.py); None: plain coding only. context: when to try it
    # (config.CONTEXT_MODES)
    context_runs: dict | None = None
    context: str = "auto"
    link_mbit: float | None = None  # the receivers' link, for context="auto" (config.CONTEXT_MODES)
    store_patience_s: float = 300.0  # a failing store is retried this long (transport/patient.py)


@dataclass(frozen=True)
class _Staged:
    """A version uploaded, for the commit stage (failed: why its upload failed, already
    reported; rank 0 still writes its abort, or the other ranks would wait for a decision)."""

    version: int
    base: int
    stats: PublishStats
    failed: str | None = None


def lower_priority(nice: int) -> None:
    """Run the calling thread (a worker process: the whole process) at this nice value; at 19,
    in a process, only on otherwise idle CPU."""
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


def _error(version: int, exc: Exception) -> Failed:
    return Failed(version, f"{type(exc).__name__}: {exc}")


class _Worker:
    """The two stages' shared state: this rank's slice digests per version (each version's
    encoding starts from its base's) and each version's decision (a version on an aborted
    base is aborted unsent)."""

    def __init__(self, spec: WorkerSpec, store, results):
        self.spec, self.store, self.results = spec, store, results
        mirror = None if spec.context_runs is None else Mirror(spec.context_runs, spec.base_version)
        self.encoder = Encoder(spec.placement, spec.span, spec.level, mirror)
        self.digests = {spec.base_version: dict(spec.digests)}  # version -> this rank's slice digests
        self.status = {spec.base_version: "commit"}  # version -> "commit" | "abort"
        self.behind: list[str] = []  # receivers the last decision marked lagging (run_commit)
        self.staged: queue.Queue = queue.Queue()  # upload stage -> commit stage

    # ------------------------------------------------------------ upload stage
    def upload(self, job: Job) -> None:
        """Encode job's version and stream its parts, then its manifest, to the store."""
        spec, st = self.spec, job.stats
        taken = unpack(spec.placement, job.payload)
        if self.status.get(job.base) != "abort":  # a version on an aborted base is aborted unsent
            t0 = time.perf_counter()
            w = upload.RankWriter(self.store, job.version, job.base, spec.rank, spec.world, part_bytes=spec.part_bytes)
            dig = dict(self.digests[job.base])
            mirror = self.encoder.mirror
            if mirror is not None:
                mirror.begin(job.version, job.base)
            gate = context_gate(spec.context, w, spec.link_mbit, spec.world)
            try:
                ss = self.encoder.encode(taken, emit=w.add, digests=dig, context_now=gate)[1]
            except BaseException:
                if mirror is not None:
                    mirror.end(False)
                raise
            if mirror is not None:
                mirror.end(True)
            faults.point("sender.parts_uploaded", rank=spec.rank, version=job.version)
            t1 = time.perf_counter()
            w.finish(ss.params, ss.changed, dig)
            self.digests[job.version] = dig
            st.params, st.changed, st.bytes, st.chunks = ss.params, ss.changed, ss.bytes, ss.chunks
            st.encode_s, st.upload_s = t1 - t0, time.perf_counter() - t1
        st.base = job.base

    def upload_stage(self, jobs, own_process: bool) -> None:
        """Take jobs until Stop; then let the commit stage finish."""
        failed = False
        parent = os.getppid()
        while True:
            try:
                item = jobs.get(timeout=1.0)
            except queue.Empty:
                if own_process and os.getppid() != parent:  # the training process died: do not linger
                    os._exit(1)
                continue
            if isinstance(item, Stop):
                self.staged.put(item)
                return
            if isinstance(item, Reset):
                failed = False
                self.staged.put(item)
                continue
            if failed:
                self.results.put(Failed(item.version, "an earlier version failed"))
                self.staged.put(_Staged(item.version, item.base, item.stats, "an earlier version failed"))
                continue
            try:
                self.upload(item)
                self.results.put(Uploaded(item.version, item.stats))
                self.staged.put(_Staged(item.version, item.base, item.stats))
            except Exception as exc:  # noqa: BLE001 - reported to the trainer
                failed = True
                self.results.put(_error(item.version, exc))
                self.staged.put(_Staged(item.version, item.base, item.stats, f"{type(exc).__name__}: {exc}"))

    # ------------------------------------------------------------ commit stage
    def decide(self, version: int, base: int, st: PublishStats) -> dict:
        """Rank 0 seals the version and runs the joint commit (or aborts it: its base was
        aborted); other ranks wait for the decision."""
        spec = self.spec
        t0 = time.perf_counter()
        if spec.rank == 0:
            if self.status.get(base) == "commit":
                rec = commit.seal_version(self.store, version, base, spec.world, timeout=spec.seal_timeout)
                st.seal_s = time.perf_counter() - t0
                d = commit.run_commit(self.store, rec, spec.policy, behind=self.behind)
                self.behind = d["lagging"]
            else:
                d = commit.decide(self.store, version, base, "abort", [], [], f"base version {base} was aborted")
        else:  # off the refit's path (receivers read the decision themselves): poll gently,
            # each poll is CPU taken from training on a busy host. Rank 0 may wait out a store
            # outage first (its patience): a shorter wait failed rank 1 while rank 0 rode one out
            wait_s = spec.seal_timeout + spec.policy.timeout + spec.store_patience_s + 60
            d = commit.await_decision(self.store, version, wait_s,
                                      poll=DECISION_POLL_S, max_poll=DECISION_MAX_POLL_S)
        st.commit_s = time.perf_counter() - t0 - st.seal_s
        st.decision, st.reason = d["decision"], d["reason"]
        return d

    def settle(self, version: int, decision: str) -> None:
        self.status[version] = decision
        if self.encoder.mirror is not None:
            self.encoder.mirror.settle(version, decision)
        if decision == "commit":  # older digests are no longer needed
            for v in [v for v in self.digests if v < version]:
                self.digests.pop(v, None)
        else:
            self.digests.pop(version, None)

    def commit_stage(self) -> None:
        """Decide each uploaded version, in order, until Stop."""
        failed = False
        while True:
            item = self.staged.get()
            if isinstance(item, Stop):
                return
            if isinstance(item, Reset):
                failed = False
                continue
            if item.failed is not None:  # (reported by the upload stage)
                self.give_up(item, f"its upload failed on rank {self.spec.rank}: {item.failed}")
                continue
            if failed:
                self.give_up(item, "an earlier version failed")
                self.results.put(Failed(item.version, "an earlier version failed"))
                continue
            try:
                d = self.decide(item.version, item.base, item.stats)
            except Exception as exc:  # noqa: BLE001 - reported to the trainer
                # rank 0 that cannot decide (its seal timed out: a rank's manifest lost; the commit
                # failed) aborts the version instead: every rank and receiver learns it now, and
                # training goes on as after any abort. Only if even that fails is it a failure;
                # and the `wait` policy's timeout is one by design (nothing decided: PROTOCOL.md)
                why = f"rank 0 could not decide it ({type(exc).__name__}: {exc})"
                d = None if isinstance(exc, commit.CommitTimeout) else self.give_up(item, why)
                if d is None:
                    failed = True
                    self.results.put(_error(item.version, exc))
                    continue
                item.stats.decision, item.stats.reason = d["decision"], d["reason"]
            self.settle(item.version, d["decision"])
            self.results.put(Decided(item.version, item.stats))

    def give_up(self, item: _Staged, why: str) -> dict | None:
        """Rank 0: write the abort of a version it will not decide otherwise (best effort), so
        the other ranks and the receivers are not left waiting out their timeouts for a decision
        that would never come. Returns the decision that stands (None: none could be written,
        or not rank 0)."""
        if self.spec.rank != 0:
            return None
        try:
            return commit.decide(self.store, item.version, item.base, "abort", [], [], why[:500])
        except Exception as exc:  # noqa: BLE001 - the store is failing too: the timeouts take over
            print(f"dcr rank 0: could not abort version {item.version} ({why}): {exc}", flush=True)
            return None


def run_worker(spec: WorkerSpec, jobs, results) -> None:
    """The worker's entry point (a spawned process's target, or a thread's)."""
    lower_priority(spec.nice)
    own_process = threading.current_thread() is threading.main_thread()  # else a thread of the trainer's
    if own_process:  # (in a thread these would set the trainer's intra-op threads and freeze its objects)
        torch.set_num_threads(1)
        # a SIGTERM to the job's process group is the trainer's to act on: it flushes through
        # this worker, then stops it (Publisher.close); orphaned, it leaves on its own (upload_stage)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    # an outage shorter than the patience holds the uploads (and, through the memory budget,
    # the trainer) instead of failing versions until training stops
    store = PatientStore(open_store(spec.store_url), spec.store_patience_s, who=f"dcr rank {spec.rank}")
    if own_process:
        freeze_long_lived()
    results.put(Ready())
    w = _Worker(spec, store, results)
    committer = threading.Thread(target=w.commit_stage, name="nemo-dcr-commit", daemon=True)
    committer.start()
    w.upload_stage(jobs, own_process)
    committer.join()
