"""A training job that stops when asked: SIGTERM ends it at the next step boundary, every rank
on the same step, within a stated time, with exit status 0.

Why the recipe needs its own: its ranks run Lightning's SingleDeviceStrategy (Megatron does the
parallelism), so Lightning sees a world of one and acts on SIGTERM only at the end of an epoch,
which a run of max_steps never reaches. torchrun then waited its 30 s and sent SIGKILL: every
stop, every peer's death (torchrun stops the survivors with SIGTERM), cost 30 s and an exit
by signal. Here:

- SIGTERM sets a flag (and Lightning's, which the DCR callback reads to bound its last flush);
- after each step every rank takes the maximum of the flags (one small all-reduce), so all
  leave after the same step and none waits in a collective for a peer that has gone;
- a watchdog ends the rank `grace_s` after the signal whatever it is doing (a collective with
  a dead peer, a store that does not answer), first logging every thread's stack: where it
  was stuck is the reason it could not leave on its own.

A rank whose peer died leaves through the same path: torchrun sends it SIGTERM, and gloo's
collective fails at once on the closed connection, or the watchdog ends it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from nemo_dcr_callback.launcher import collective_device


@dataclass
class StopConfig:
    """`trainer.stop_grace_s`: from SIGTERM to this rank's exit at the latest. Below torchrun's
    30 s before its SIGKILL, and above dcr.stop_timeout_s, the callback's last flush."""

    grace_s: float = 20.0

    def __post_init__(self):
        if self.grace_s <= 0:
            raise ValueError(f"trainer.stop_grace_s must be > 0, not {self.grace_s}")


def _say(msg: str) -> None:
    """One line to stderr from a signal handler or the watchdog (no print: not reentrant)."""
    os.write(2, (msg + "\n").encode())


class StopOnSignal(L.Callback):
    def __init__(self, cfg: StopConfig | None = None):
        self.cfg = cfg or StopConfig()
        self.requested_at: float | None = None
        self.training = False
        self._rank = 0

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def install(self) -> None:
        """SIGTERM's handler, before fit: Lightning registers its own at fit's start and calls
        this one after it (so trainer.received_sigterm is set as well)."""
        self._rank = int(os.environ.get("RANK", "0"))
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            if self.requested_at is not None:
                return
            if not self.training:  # start-up: no step to finish, nothing published to wait for
                _say(f"rank {self._rank}: SIGTERM during start-up: leaving now, exit status 0")
                os._exit(0)
            _say(f"rank {self._rank}: SIGTERM: stopping after this step (at most {self.cfg.grace_s:.0f} s)")
            self._request()
            if callable(previous) and previous is not on_sigterm:
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)

    def on_train_start(self, trainer, pl_module) -> None:
        self.training = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stop = self.requested
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(stop)], dtype=torch.int32, device=collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            if not self.requested:  # a peer was asked: this rank stops with it, on the same watch
                self._request()
            trainer.should_stop = True

    def _request(self) -> None:
        """The stop is asked for: noted, and the watchdog started (once)."""
        self.requested_at = time.monotonic()
        threading.Thread(target=self._watchdog, name="stop-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        time.sleep(self.cfg.grace_s)
        _say(f"rank {self._rank}: still running {self.cfg.grace_s:.0f} s after SIGTERM; stuck here "
             "(a collective whose peer is gone, or a store that does not answer):")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _say(f"rank {self._rank}: leaving now, exit status 0 (the stop was asked for)")
        os._exit(0)


def fit(trainer, module, stop: StopOnSignal) -> None:
    """trainer.fit(module); after a SIGTERM, an error on the way out (a collective failing on
    a peer that has gone) is the stop's consequence: one line, and a normal return."""
    stop.install()
    try:
        trainer.fit(module)
    except SIGTERMException:  # Lightning's own end of a run it saw SIGTERM in (exit status 0)
        pass
    except Exception as exc:  # noqa: BLE001 - reraised unless a stop was asked for
        if not stop.requested:
            raise
        print(f"rank {stop._rank}: stopped on SIGTERM; on the way out: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}"[:400], flush=True)
    if stop.requested:
        print(f"rank {stop._rank}: stopped on SIGTERM after "
              f"{time.monotonic() - stop.requested_at:.1f} s", flush=True)
