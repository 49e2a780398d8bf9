"""What the Publisher and its worker tell each other, and the figures a version reports.

Every message is a small frozen dataclass: it crosses a multiprocessing queue (pickled) when
the worker is a process. The trainer sends Job, Reset and Stop; the worker answers Ready once,
then Uploaded, Decided or Failed for every job, in version order per stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nemo_dcr_callback.sender.shm import ShmPayload


@dataclass
class PublishStats:
    """One version's figures on one rank (kept in Publisher.history, written to stats/)."""

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


# ------------------------------------------------------------------ trainer -> worker
@dataclass(frozen=True)
class Job:
    """Encode and upload `version` on `base`. payload: the deltas, as shm.pack made them (a
    process: a shared-memory segment's name and layout; a thread: (parameter index, delta)
    pairs, the undo log's own deltas)."""

    version: int
    base: int
    payload: ShmPayload | list
    stats: PublishStats


@dataclass(frozen=True)
class Reset:
    """The trainer has undone the failed versions: take jobs again."""


@dataclass(frozen=True)
class Stop:
    """Finish what is queued and exit."""


# ------------------------------------------------------------------ worker -> trainer
@dataclass(frozen=True)
class Ready:
    """The worker started (its store is open): the trainer may publish."""


@dataclass(frozen=True)
class Uploaded:
    """version's parts and manifest are in the store; the worker no longer reads its deltas."""

    version: int
    stats: PublishStats


@dataclass(frozen=True)
class Decided:
    """version was committed or aborted (stats.decision, stats.reason)."""

    version: int
    stats: PublishStats


@dataclass(frozen=True)
class Failed:
    """version could not be published (it, and every later one until a Reset, fails)."""

    version: int
    message: str


Report = Ready | Uploaded | Decided | Failed
