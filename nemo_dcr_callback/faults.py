"""Fault injection for the fault suite (tests/faults, docs/FAULTS.md): the one place product
code reaches it. A component calls `point(name, **where)` at a named moment; with the
matching environment variable unset (always, outside the tests) the call does nothing.

Points and the variables that arm them (names and syntax are the tests' interface):

- "sender.parts_uploaded" (rank, version): in the publisher's worker, once a version's parts
  are uploaded and before its manifest is written. NEMO_DCR_SENDER_FAULT=kill:R:V SIGKILLs
  rank R's training process and its worker at version V (a node lost mid-upload).
- "receiver.tensor_written": after each tensor write of a journaled apply or of a checkpoint
  directory's redo log. NEMO_DCR_RECEIVER_FAULT=kill-after:N makes the process SIGKILL
  itself at its N-th write (counted over the process's life: a torn apply).

The relay's fault is a per-relay setting (RelayConfig.fault): `relay_fault()` reads its
default, NEMO_DCR_RELAY_FAULT, and `RelayFault` carries it out ('corrupt:N' flips a byte in
the cached copy of the first N parts after they were verified; 'die:N' SIGKILLs the relay
when asked for a part after serving N).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from nemo_dcr_callback.protocol import keys

SENDER_ENV = "NEMO_DCR_SENDER_FAULT"
RECEIVER_ENV = "NEMO_DCR_RECEIVER_FAULT"
RELAY_ENV = "NEMO_DCR_RELAY_FAULT"


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _sender_parts_uploaded(rank: int, version: int) -> None:
    spec = os.environ.get(SENDER_ENV, "")
    if not spec.startswith("kill:"):
        return
    _, r, v = spec.split(":")
    if int(r) == rank and int(v) == version:
        # The worker runs as its own process (on that process's main thread) or as a thread
        # of the trainer's: in a process, the trainer dies with it, as on a lost node.
        if threading.current_thread() is threading.main_thread():
            os.kill(os.getppid(), signal.SIGKILL)
        _kill_self()


_writes = 0  # receiver.tensor_written calls in this process while armed


def _receiver_tensor_written() -> None:
    global _writes
    spec = os.environ.get(RECEIVER_ENV, "")
    if spec.startswith("kill-after:"):
        _writes += 1
        if _writes >= int(spec.split(":")[1]):
            _kill_self()


_POINTS: dict[str, Callable[..., None]] = {
    "sender.parts_uploaded": _sender_parts_uploaded,
    "receiver.tensor_written": _receiver_tensor_written,
}


def point(name: str, **where: int) -> None:
    """Named moment `name` is reached (with its context: rank, version...): injects the fault
    armed for it, if any. An unknown name is an error, so a typo cannot disarm a test."""
    _POINTS[name](**where)


def relay_fault() -> str | None:
    """The relay's fault spec from the environment (RelayConfig.fault's default)."""
    return os.environ.get(RELAY_ENV)


class RelayFault:
    """A relay's fault ('corrupt:N' or 'die:N', see the module docstring), counted per relay."""

    def __init__(self, spec: str | None):
        self.kind, self.n = None, 0
        if spec:
            kind, _, n = spec.partition(":")
            if kind not in ("corrupt", "die"):
                raise ValueError(f"unknown relay fault {spec!r} (corrupt:N or die:N)")
            self.kind, self.n = kind, int(n or 1)
        self.count = 0

    def at_rest(self, key: str, data: bytes) -> bytes:
        """The bytes a relay caches for key (corrupted, for the first N parts)."""
        if self.kind != "corrupt" or not keys.is_part(key) or self.count >= self.n or not data:
            return data
        self.count += 1
        b = bytearray(data)
        b[len(b) // 2] ^= 0x40
        return bytes(b)

    def served(self, key: str) -> None:
        """A relay is asked for key (it dies here after serving N parts)."""
        if self.kind == "die" and keys.is_part(key):
            if self.count >= self.n:
                _kill_self()
            self.count += 1
