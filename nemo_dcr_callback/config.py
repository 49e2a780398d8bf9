"""Every configuration dataclass and shared default, in one place.

The callback's flat options (DCRConfig: the YAML surface, configs/dcr.yaml) build the
components' configs: PublisherConfig (every training rank's sender), CommitPolicy (the joint
commit on rank 0). FollowerConfig is a receiver's (`nemo-dcr receive`). A component takes
its config object and overrides fields by name; no default is written twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from nemo_dcr_callback.codec.format import DEFAULT_CHUNK_SPAN
from nemo_dcr_callback.core.cuda_kernels import check_baseline_option

PART_BYTES = 4 << 20  # a rank's chunks are uploaded in parts of about this size (protocol/upload.py)
FETCH_LANES = 2  # parts of one version a receiver downloads at once (receiver/fetch.py)

__all__ = ["DEFAULT_CHUNK_SPAN", "FETCH_LANES", "PART_BYTES", "CommitPolicy", "DCRConfig", "FollowerConfig",
           "PublisherConfig"]


@dataclass
class CommitPolicy:
    """What the committer does about receivers that are slow, missing or refuse a version.

    wait:   commit once every expected receiver acked; a refusal aborts; past `timeout` it is
            an error (the trainer sees it; nothing is committed).
    abort:  as wait, but past `timeout` the version is aborted (senders restore their
            baselines; the next version covers the changes).
    quorum: commit once every expected receiver answered, or at `timeout` if at least
            `quorum` of them acked; the rest are marked lagging and catch up later;
            otherwise abort. Once the quorum acked, the rest get `grace` seconds (or as
            long again as the quorum took, if longer), and receivers the previous decision
            marked lagging are not waited for at all: one stalled receiver must not hold
            every version for the whole timeout while the trainer publishes every step.
    Expected receivers: those registered (and seen within `live_s`) when the version is
    sealed. With none registered, a sealed version commits at once.
    """

    mode: Literal["wait", "abort", "quorum"] = "quorum"
    timeout: float = 60.0
    quorum: float = 0.5
    live_s: float = 600.0
    poll: float = 0.01
    grace: float = 1.0

    def __post_init__(self):
        if self.grace < 0:
            raise ValueError("grace is seconds >= 0")
        if self.mode not in ("wait", "abort", "quorum"):
            raise ValueError(f"commit policy must be wait, abort or quorum, not {self.mode!r}")
        if not 0.0 <= self.quorum <= 1.0:
            raise ValueError("quorum is a fraction in [0, 1]")


# When a sender context-codes a chunk (codec/context.py: smaller, but a walk over the chunk's
# range costs about a copy of it): "on", wherever the coding comes out smaller; "auto", where
# it comes out smaller while the sender is ahead of the link (parts handed over that the link
# has not carried yet: the CPU would otherwise wait); "off", never. On a fast link the
# walk costs more time than the bytes it saves (docs/PERFORMANCE.md). Ahead of which link:
# with link_mbit, the receivers' (this sender's share of it); without, its own upload's
# (parts queued and not yet stored), which is the same where the store sits behind that link
# and says nothing where the store is near the sender and the receivers far from it.
CONTEXT_MODES = ("auto", "on", "off")


def context_mode(value: str | bool) -> str:
    """A context option (YAML's true / false too) as one of CONTEXT_MODES."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in CONTEXT_MODES:
        raise ValueError(f"context must be one of {', '.join(CONTEXT_MODES)} (or true / false), not {value!r}")
    return value


def check_link(link_mbit: float | None) -> None:
    if link_mbit is not None and not link_mbit > 0:
        raise ValueError(f"link_mbit must be a positive rate in Mbit/s (or unset), not {link_mbit!r}")


@dataclass
class PublisherConfig:
    """How a Publisher sends. DCRConfig.publisher_config() builds it from the callback's
    options; Publisher(..., **options) overrides fields by name."""

    max_pending_bytes: int = 1 << 30  # undo-log bytes queued for upload before publish() blocks
    span: int = DEFAULT_CHUNK_SPAN  # canonical positions per chunk
    level: int = 1  # zstd level of zstd-coded streams
    seal_timeout: float = 600.0  # seconds rank 0 waits for every rank's manifest
    # seconds a failing store is retried (transport/patient.py) before the version fails: an
    # outage shorter than this is back-pressure, not an exit
    store_patience_s: float = 300.0
    policy: CommitPolicy = field(default_factory=CommitPolicy)  # slow or refusing receivers
    part_bytes: int = PART_BYTES  # chunks are uploaded in parts of about this size, each as soon as full
    baseline: str = "gpu"  # CUDA shards: baselines in GPU memory (gpu) or pinned host memory (pinned)
    worker: Literal["process", "thread"] = "process"  # where encoding and upload run
    nice: int = 19  # the worker's nice value (19, in a process: only on otherwise idle CPU)
    resume: bool = False  # a store with versions: rebase on its last committed one (a restarted job)
    context: str = "auto"  # context coding: auto | on | off (CONTEXT_MODES)
    link_mbit: float | None = None  # the receivers' link, shared by every rank (CONTEXT_MODES); None: unknown

    def __post_init__(self):
        check_baseline_option(self.baseline)
        self.context = context_mode(self.context)
        check_link(self.link_mbit)
        if self.store_patience_s < 0:
            raise ValueError(f"store_patience_s must be >= 0, not {self.store_patience_s}")
        if self.worker not in ("process", "thread"):
            raise ValueError(f"worker must be 'process' or 'thread', not {self.worker!r}")


@dataclass
class FollowerConfig:
    """How a Follower takes part and paces itself (`nemo-dcr receive` builds it from its
    options; Follower(..., **options) overrides fields by name)."""

    receiver_id: str | None = None  # set: register under it, ack versions, take part in the joint commit
    decision_timeout: float = 600.0  # seconds to wait for a version's decision after acking it
    check_digests: bool = True  # check the held weights, and every version applied, against the digests
    poll_s: float = 0.01  # pause between polls while versions come
    # the longest pause between polls once idle (IDLE_AFTER_S) on a store that cannot
    # long-poll: polling every poll_s, an idle receiver listed S3 about 77 times a second
    # (9% of a core); at 0.1 s about 10, and a version that starts after an idle second is
    # seen up to 0.1 s later. Relays are long-polled: there it changes nothing.
    idle_poll_s: float = 0.1
    journal: str | None = None  # redo journal directory: weights that outlive this follower (journal.py)
    early: bool | str = False  # apply while fetching: True, "sealed" or False (APPLY_MODES; fetch.py)
    # The registration (liveness, and the version held, which gc keeps) is refreshed this often,
    # applied or idle (Follower.heartbeat): a write per version per receiver is load on the
    # relays and the store that a fleet multiplies, and it was on the refit's path. It must
    # stay well under the live_s of gc and of the commit's expected receivers.
    register_every_s: float = 30.0
    fetch_lanes: int = FETCH_LANES  # parts of one version downloading at once (receiver.fetch.Parts)

    def __post_init__(self):
        if self.early not in (False, True, "sealed"):
            raise ValueError(f"early must be False, True or 'sealed', not {self.early!r}")
        if self.fetch_lanes < 1:
            raise ValueError("fetch_lanes must be >= 1")


@dataclass
class DCRConfig:
    """Every option of the callback (configs/dcr.yaml documents each one; a test checks that
    its defaults are these). The fields are flat: they are the YAML surface (`dcr.store=...`).
    The components' configs are built from them; the defaults they share are taken from the
    components' own configs, so each is written once."""

    store: str | None = None  # URL (file:///path); None: file://<trainer.default_root_dir>/dcr-store
    family: str = "llama"  # placement table (nemo_dcr_callback.placement.FAMILIES)
    vocab_size: int | None = None  # the tokenizer's vocabulary; None: pl_module.dcr_vocab_size
    every_n_steps: int = 1  # publish a version every N optimizer steps
    max_pending_bytes: int = PublisherConfig.max_pending_bytes  # undo-log bytes queued before a step blocks
    chunk_span: int = PublisherConfig.span  # positions per chunk
    zstd_level: int = PublisherConfig.level  # for zstd-coded streams
    keyframe: bool = True  # write the dense export of version 0 as the receivers' starting point
    verify: bool = False  # check every version bit for bit against the dense export (slow)
    seal_timeout: float = PublisherConfig.seal_timeout  # seconds rank 0 waits for every rank's manifest
    store_patience_s: float = PublisherConfig.store_patience_s  # seconds a failing store is retried
    # at an exception or a SIGTERM: seconds to wait for undecided versions (the next start aborts
    # the rest); within a launcher's grace before its SIGKILL (torchrun: 30 s)
    stop_timeout_s: float = 5.0
    commit_policy: str = CommitPolicy.mode  # wait | abort | quorum: what to do about slow or refusing receivers
    ack_timeout: float = CommitPolicy.timeout  # seconds the committer waits for receivers' acks
    quorum: float = CommitPolicy.quorum  # quorum policy: fraction of registered receivers that must ack
    ack_grace: float = CommitPolicy.grace  # quorum policy: seconds the rest get once the quorum acked
    keyframe_every: int = 0  # also write a full keyframe every N versions (0: only version 0)
    # the dense export of every Nth version under verify/ (receivers' --verify, audits), without
    # verify's replay and without waiting for the commit: a version may still be aborted
    export_every: int = 0
    part_bytes: int = PublisherConfig.part_bytes  # chunks are uploaded in parts of about this size
    baseline: str = PublisherConfig.baseline  # CUDA shards: baselines in GPU memory (gpu) or pinned host memory
    resume: bool = True  # a store with versions: rebase on its last committed one (a restarted job)
    context: str = PublisherConfig.context  # context coding: auto | on | off (CONTEXT_MODES)
    link_mbit: float | None = PublisherConfig.link_mbit  # the receivers' link (Mbit/s): what auto keeps ahead of

    def __post_init__(self):  # bad options are refused when the trainer is built, not at its first step
        if self.every_n_steps < 1:
            raise ValueError("every_n_steps must be >= 1")
        if self.keyframe_every < 0:
            raise ValueError("keyframe_every must be >= 0")
        if self.export_every < 0:
            raise ValueError("export_every must be >= 0")
        if self.stop_timeout_s < 0:
            raise ValueError(f"stop_timeout_s must be >= 0, not {self.stop_timeout_s}")
        check_baseline_option(self.baseline)
        self.publisher_config()

    def commit_policy_config(self) -> CommitPolicy:
        """What the committer (rank 0) does about slow or refusing receivers."""
        return CommitPolicy(self.commit_policy, self.ack_timeout, self.quorum, grace=self.ack_grace)

    def publisher_config(self) -> PublisherConfig:
        """Every rank's Publisher."""
        return PublisherConfig(max_pending_bytes=self.max_pending_bytes, span=self.chunk_span, level=self.zstd_level,
                               seal_timeout=self.seal_timeout, store_patience_s=self.store_patience_s,
                               policy=self.commit_policy_config(),
                               part_bytes=self.part_bytes, baseline=self.baseline, resume=self.resume,
                               context=self.context, link_mbit=self.link_mbit)
