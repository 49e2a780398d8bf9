"""The plain-loop API: one call after each optimizer step publishes a version.

    pub = Publisher(model, family=LLAMA, vocab_size=V, store="file:///tmp/run/store")
    for step in ...:
        train_step(...)
        pub.publish(step)          # kernel now; projection, encoding, upload in the background
    pub.close()

`publish` runs the delta kernel synchronously (it must see the weights before the next step
mutates them) and hands the deltas to a background thread that projects, encodes and
uploads them. The pending deltas count against a memory budget: past it, `publish` blocks
until the worker catches up (back-pressure). A worker error is raised by the next
`publish`/`flush`/`close`, never dropped; the failed versions' deltas are undone so the next
published version covers them (XOR deltas compose). Rank 0 seals each version once every
rank's manifest is in the store: no collective is involved.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from nemo_dcr_callback import codec, commit
from nemo_dcr_callback.placement import Family, build_placement
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


class Publisher:
    def __init__(self, model, *, family: Family, vocab_size: int, store, rank: int | None = None,
                 world: int | None = None, dp_rank: int | None = None, dp_size: int | None = None,
                 max_pending_bytes: int = 1 << 30, span: int = codec.DEFAULT_CHUNK_SPAN, level: int = 1,
                 seal_timeout: float = 600.0, base_version: int = 0):
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
        self.max_pending = max_pending_bytes
        self.seal_timeout = seal_timeout
        self.last_version = base_version  # the version receivers hold before the next one
        self._last_good = base_version
        self._q: queue.Queue = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self.history: list[PublishStats] = []
        self._worker = threading.Thread(target=self._run, name="nemo-dcr-publisher", daemon=True)
        self._worker.start()

    # -------------------------------------------------------------- trainer side
    def publish(self, version: int) -> PublishStats:
        """Take this step's delta and queue it as `version` (> the last one)."""
        self._raise()
        if version <= self.last_version:
            raise ValueError(f"version {version} is not after {self.last_version}")
        t0 = time.perf_counter()
        taken = self.sender.take()
        self.sender.commit()  # the baseline moves now; on a worker error _fail() undoes it
        st = PublishStats(version=version, kernel_s=time.perf_counter() - t0)
        size = sum(d.count * (d.positions.element_size() + 2 * d.xor.element_size()) for _, d in taken)
        with self._cv:
            while self._pending > 0 and self._pending + size > self.max_pending and self._error is None:
                self._cv.wait(timeout=1.0)  # back-pressure
            self._pending += size
        self._q.put((version, self.last_version, taken, size, st))
        self.last_version = version
        return st

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued version is uploaded (and sealed on rank 0)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending > 0 and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("publisher flush timed out")
                self._cv.wait(timeout=left if left is not None else 1.0)
        self._raise()

    def close(self) -> None:
        """Flush, stop the worker and leave this rank's per-version figures in the store
        (stats/rank-NNNNN.json: kernel, encode, upload and seal times, bytes, changes)."""
        import json
        from dataclasses import asdict

        self.flush()
        self._q.put(None)
        self._worker.join(timeout=30)
        self.store.put(f"stats/rank-{self.rank:05d}.json", json.dumps([asdict(h) for h in self.history]).encode())

    def _raise(self) -> None:
        if self._error is None:
            return
        with self._cv:  # let the worker undo every queued (failed) version first
            while self._pending > 0:
                self._cv.wait(timeout=1.0)
        err, self._error = self._error, None
        self.last_version = self._last_good  # receivers hold this; the next version builds on it
        raise RuntimeError(f"nemo-dcr publisher failed: {err}") from err

    # -------------------------------------------------------------- worker side
    def _run(self) -> None:
        from nemo_dcr_callback.delta import undo

        while True:
            item = self._q.get()
            if item is None:
                return
            version, base, taken, size, st = item
            try:
                if self._error is not None:
                    raise RuntimeError("an earlier version failed")
                t0 = time.perf_counter()
                chunks, ss = self.sender.encode(taken)
                t1 = time.perf_counter()
                headers = [codec.parse_header(c, verify=False) for c in chunks]
                commit.write_rank(self.store, version, self.rank, self.world, chunks, ss.params, ss.changed,
                                  headers)
                t2 = time.perf_counter()
                if self.rank == 0:
                    commit.seal_version(self.store, version, base, self.world, timeout=self.seal_timeout)
                st.seal_s = time.perf_counter() - t2
                st.params, st.changed, st.bytes, st.chunks = ss.params, ss.changed, ss.bytes, ss.chunks
                st.encode_s, st.upload_s = t1 - t0, t2 - t1
                self.history.append(st)
                self._last_good = version
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer thread
                # Undo this version's deltas (XOR composes: later ones are undone as they fail too),
                # so the baselines fall back and the next published version covers the gap.
                for pm, d in reversed(taken):
                    undo(self.sender.baselines[pm.name], d)
                if self._error is None:
                    self._error = exc
            finally:
                with self._cv:
                    self._pending -= size
                    self._cv.notify_all()
