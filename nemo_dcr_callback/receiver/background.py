"""A follower that runs in the background of a serving engine: listing, fetching, checking,
decoding, acking and waiting for the joint commit happen on a thread of their own while the
engine keeps generating; only the apply itself is handed to the thread that owns the weights
(`apply_ready`, called at a step boundary), so serving pauses for the apply alone.

The handoff is a target wrapper: when the background Follower applies a version, the decoded
chunks are queued and the Follower waits until the serving thread has applied them (with the
digest terms), then checks the digests and moves on as it would in the foreground.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass, field

from nemo_dcr_callback import codec
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.store import StoreError, backoff
from nemo_dcr_callback.receiver.follow import Applied, Follower
from nemo_dcr_callback.receiver.targets import StateDictTarget


class Stopped(RuntimeError):
    """The background follower was stopped while a version waited to be applied."""


@dataclass
class _Job:
    decoded: list[codec.DecodedChunk]
    applied: threading.Event = field(default_factory=threading.Event)  # the serving thread applied it
    settled: threading.Event = field(default_factory=threading.Event)  # the follower checked it (or refused)
    terms: dict | None = None
    error: BaseException | None = None


class _Handoff:
    """The Follower's target: everything is the real target's, except that applying queues the
    chunks for the serving thread and waits for it."""

    def __init__(self, inner, owner: BackgroundFollower):
        self._inner, self._owner = inner, owner

    def __getattr__(self, name):  # check, names, digest_of, ...: the real target's
        return getattr(self._inner, name)

    def apply_with_terms(self, decoded: list[codec.DecodedChunk]) -> dict:
        job = _Job(decoded)
        self._owner._current = job
        self._owner._jobs.put(job)
        while not job.applied.wait(0.1):
            if self._owner._stop.is_set():
                raise Stopped("stopped before the version was applied")
        if job.error is not None:
            raise job.error
        return job.terms

    def apply(self, decoded: list[codec.DecodedChunk]) -> None:
        self.apply_with_terms(decoded)


@dataclass
class Update:
    """What one apply_ready call did (the serving thread's view)."""

    version: int  # the version held now
    applied: list[int]
    load_s: float  # the serving thread's pause: the applies themselves
    fetch_s: float  # fetch, checks and decode of the versions applied (in the background)
    refused: str | None  # why the next version was refused, if it was
    changed: set[str]  # canonical tensors the applies wrote


class BackgroundFollower:
    """Runs a Follower (same arguments) on a daemon thread; `apply_ready()` on the thread that
    owns the weights applies what the follower has ready. The target must have
    `apply_with_terms` (LoaderTarget, StateDictTarget)."""

    def __init__(self, store, target, version: int = 0, *, idle_poll_s: float = 0.2, **options):
        if options.get("journal") is not None:
            raise ValueError("a background follower cannot journal (the journal writes on the follower's thread)")
        target = StateDictTarget(target) if isinstance(target, dict) else target
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._stop = threading.Event()
        self._current: _Job | None = None
        self._refusal_seq = 0  # refusals so far (a refused version is refused again at each retry)
        self._last_refusal: str | None = None
        self._told: BaseException | None = None  # the last refusal the Follower reported itself
        self._applied: list[Applied] = []
        self._lock = threading.Lock()
        self.target = target
        # digests of what the engine holds are checked here, on the caller's thread, before
        # anything runs in the background (a wrong model is refused by the attach)
        self.follower = Follower(store, _Handoff(target, self), version, **options)
        self.follower.on_refuse = self._refused
        self.store = store
        self.idle_poll_s = idle_poll_s
        self.error: BaseException | None = None  # what stopped the thread, if anything did
        self._thread = threading.Thread(target=self._run, name="nemo-dcr-follow", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self.follower.version

    # ------------------------------------------------------------ background
    def _refused(self, v: int, exc: BaseException) -> None:
        self._told = exc
        with self._lock:
            self._refusal_seq += 1
            self._last_refusal = f"version {v}: {exc}"
        self._release()

    def _settle(self, a: Applied) -> None:
        with self._lock:
            self._applied.append(a)
        self._release()

    def _release(self) -> None:
        """The follower is done with the version handed over (applied and checked, or not)."""
        job, self._current = self._current, None
        if job is not None:
            job.settled.set()

    def _run(self) -> None:
        f = self.follower
        pause = f.poll_s
        warned = False
        while not self._stop.is_set():
            applied = []
            try:
                applied = f.poll(on_apply=self._settle)
                warned = False
            except Stopped:
                return
            except codec.ChunkError as exc:  # refused (no receiver id; or a part streamed in): tried again later
                if exc is not self._told:
                    self._refused(f.version + 1, exc)
                pause = self.idle_poll_s
            except StoreError as exc:
                if not warned:
                    print(f"nemo-dcr receiver: store unavailable ({exc}); retrying", file=sys.stderr, flush=True)
                    warned = True
                pause = self.idle_poll_s
            except BaseException as exc:  # noqa: BLE001 - kept for the serving thread to raise
                self.error = exc
                self._release()
                return
            streaming = bool(f._parts)
            pause = f.poll_s if applied or streaming else backoff(pause, f.poll_s, self.idle_poll_s)
            self._stop.wait(pause)

    # ------------------------------------------------------------ serving thread
    def ready_version(self) -> int:
        """The newest version apply_ready can apply without waiting."""
        return self.version + (1 if self._jobs.qsize() else 0)

    def sealed_after(self, v: int) -> int:
        """The newest version sealed in the store after v (v if none)."""
        newest = v
        for x in commit.list_versions(self.store):
            if x > newest and commit.read_record(self.store, x) is not None:
                newest = x
        return newest

    def apply_ready(self, until: int | None = None, wait: bool = True, timeout: float = 600.0) -> Update:
        """Apply, here, the versions the background has ready. wait: first wait for every
        version sealed now (or up to `until`) to be ready, decided and applied; a refusal or an
        aborted version ends the wait. Without wait, only what is ready now is applied."""
        held0 = self.version
        seq0 = self._refusal_seq
        goal = held0 if not wait else (until if until is not None else self.sealed_after(held0))
        deadline = time.monotonic() + timeout
        load_s, changed = 0.0, set()
        while True:
            if self.error is not None:
                raise RuntimeError(f"the background follower stopped: {self.error}") from self.error
            if until is not None and self.version >= until:
                break  # (the next version may be ready already: it stays for the next call)
            try:
                job = self._jobs.get(timeout=0.05 if wait else 0)
            except queue.Empty:
                job = None
            if job is not None:
                t0 = time.perf_counter()
                try:
                    job.terms = self.target.apply_with_terms(job.decoded)
                except BaseException as exc:  # noqa: BLE001 - the follower raises it (nothing more applied)
                    job.error = exc
                load_s += time.perf_counter() - t0
                changed.update(d.header.name for d in job.decoded)
                job.applied.set()
                if not job.settled.wait(timeout=60):
                    raise RuntimeError("the background follower did not settle an applied version")
                continue
            if not wait:
                break
            v = self.version
            if v >= goal or self._refusal_seq > seq0:
                break
            if all(_aborted(self.store, x) for x in range(v + 1, goal + 1)):
                break  # every version up to the goal aborted: nothing to wait for (one aborted
                # before the goal is skipped: the next version's base is the last committed)
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {v + 1} was not ready within {timeout:.0f} s (holding {v})")
        with self._lock:
            done = [a for a in self._applied if a.version > held0]
            refused = self._last_refusal if self._refusal_seq > seq0 else None
        return Update(self.version, [a.version for a in done], load_s, sum(a.fetch_s for a in done), refused,
                      changed)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _aborted(store, v: int) -> bool:
    d = commit.read_decision(store, v)
    return d is not None and d["decision"] != "commit"
