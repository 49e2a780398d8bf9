"""A store that rides out an outage: every call retried until the store answers or the
patience runs out.

The trainer's publisher writes through one (dcr.store_patience_s). A store's own retries (the
S3 client's five attempts, a relay chain's failover) last seconds; a restarted object store or
a relay that lost its upstream can take longer than that, and a training job should not end
for it. While a call waits, the version it belongs to waits, the queue behind it fills, and
the trainer's next publish blocks on the memory budget: back-pressure, never an exit. Past the
patience the call raises, naming the store, the error and the patience, and the trainer rolls
the version back as for any failure.

What is retried: StoreError (unreachable, 5xx, throttling, a relay's 503). What is not: a
history object with other bytes (ImmutableError), a missing key (KeyError), a record refused
for its form or size (ValueError): none of them is an outage.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from nemo_dcr_callback.protocol.store import ImmutableError, StoreError, redact

FIRST_PAUSE_S = 0.25
MAX_PAUSE_S = 5.0


class PatientStore:
    """`store`, with each call retried on a StoreError for up to `patience_s` seconds from its
    first failure. One line when an outage starts and one when it ends (per store, not per
    call: the worker's threads share it)."""

    def __init__(self, store, patience_s: float, *, who: str = "dcr", clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if patience_s < 0:
            raise ValueError(f"store patience must be >= 0 seconds, not {patience_s}")
        self.store, self.patience_s, self.who = store, float(patience_s), who
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._down_since: float | None = None  # when the current outage was first seen
        self.outages = 0  # outages ridden out (tests, stats)

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def impatient(self):
        """The store without the patience: for a call made in a hurry (a rank leaving on a
        stop writes its figures once, or not at all)."""
        return self.store

    def __getattr__(self, name: str):  # executor, get_pieces, long_polls, wait, ...: the store's own
        return getattr(self.store, name)

    def _call(self, op: str, *args, **kw):
        first: float | None = None
        pause = FIRST_PAUSE_S
        while True:
            try:
                out = getattr(self.store, op)(*args, **kw)
            except ImmutableError:
                raise
            except StoreError as exc:
                now = self._clock()
                first = now if first is None else first
                self._down(exc, now)
                left = first + self.patience_s - now
                if left <= 0:
                    raise StoreError(f"{exc} (still failing after {self.patience_s:.0f} s of the store's patience, "
                                     "dcr.store_patience_s)") from exc
                self._sleep(min(pause, left))
                pause = min(2 * pause, MAX_PAUSE_S)
                continue
            if first is not None:
                self._up()
            return out

    def _down(self, exc: StoreError, now: float) -> None:
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = now
        print(f"{self.who}: store {redact(self.store.url)} failing ({exc}); retrying for up to "
              f"{self.patience_s:.0f} s, the uploads wait meanwhile", file=sys.stderr, flush=True)

    def _up(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            lasted, self._down_since = self._clock() - self._down_since, None
            self.outages += 1
        print(f"{self.who}: store {redact(self.store.url)} answering again after {lasted:.1f} s",
              file=sys.stderr, flush=True)


def _patient(op: str):
    def call(self, *args, **kw):
        return self._call(op, *args, **kw)
    call.__name__ = op
    return call


# every store operation, retried alike; wait and wait_keys are a relay's long-poll (callers
# ask protocol.store.long_polls first)
for _op in ("put", "put_if_absent", "get", "exists", "list", "children", "delete", "delete_prefix", "wait",
            "wait_keys"):
    setattr(PatientStore, _op, _patient(_op))
