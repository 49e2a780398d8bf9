"""verl's checkpoint engine `dcr`: the trainer's weights reach verl's rollout workers as DCR
versions through a store (file://, s3://, relay://), bit-exact and digest-checked.

Why: verl's built-in engines broadcast the full weights (NCCL, NIXL) every step, or need the
trainer and the rollout in one NCCL group (delta_sharded). With `dcr` the actor publishes only
the bits that changed since the last committed version into a store that rollout workers in
other clusters or regions can reach, and every rollout worker takes part in the joint commit:
a version it cannot verify is refused, and no worker applies a version that was not committed.

Select it in verl's config (Hydra overrides; a key of engine_kwargs needs the leading +):

    actor_rollout_ref.rollout.checkpoint_engine.backend=dcr
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=nemo_dcr_callback.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dcr.store=s3://bucket/run-1

or in YAML, under actor_rollout_ref.rollout:

    checkpoint_engine:
      backend: dcr
      custom_backend_module: nemo_dcr_callback.integrations.verl
      engine_kwargs:
        dcr: {store: "s3://bucket/run-1", commit_policy: quorum, ack_timeout: 60}

verl imports `custom_backend_module` in every actor and rollout worker before it builds the
engine; importing this module registers the class below as `dcr`. The engine's options (the
constructor's keywords) are the same on both sides.

What each side does, per verl's weight sync (CheckpointEngineManager.update_weights: prepare,
build_topology and init_process_group on every worker, then send_weights on the actor and
receive_weights on each rollout worker at once, then finalize):

- actor rank 0 (`is_master`): send_weights takes verl's dense per-tensor generator (Hugging
  Face names), copies each tensor to host memory as it comes (staging="cpu"; "device" keeps
  them where they are), and publishes one version with NamedPublisher: the delta against the
  last committed version, uploaded, sealed, decided by the joint commit. From the second sync
  on, the stream is diffed and uploaded tensor by tensor (one weight held at a time). The first sync writes
  keyframe 0 (or, on a store with history, rebases on it). The version is numbered
  global_steps where that is newer than the store's newest, else the next number. Other actor
  ranks only walk the generator (producing a weight may be a collective over the actor ranks).
- rollout worker: init_process_group registers it in the joint commit (receiver id
  `{receiver_id}-{rank}`), so the sync's version is not decided without its answer.
  receive_weights follows the store with a CPU replica of the weights (the first time from the
  newest committed keyframe), waits for the sync's version, verifies every part and the
  digests, acks, applies it once committed, and then yields only the tensors that changed,
  whole (the first time: all of them). A version that is refused or aborted raises
  DCRSyncError naming why, before anything is yielded, and the replica keeps the version it
  held (the apply is undone exactly, fetch.py's early apply). The yielded tensors are the
  replica's own: copy them before the next sync, as verl's adapters do.

verl's abort and resume around a sync (abort_all_requests, release and resume of the KV cache,
resume_generation) concern the replica servers only: the engine keeps its publisher and
replica across syncs, and finalize frees nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from nemo_dcr_callback import codec
from nemo_dcr_callback.config import CommitPolicy, FollowerConfig, check_link, context_mode
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.rebuild import KeyframeError, latest_keyframe, load_keyframe
from nemo_dcr_callback.protocol.store import StoreError, backoff, redact, wait_news
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.sender.named import NamedPublisher
from nemo_dcr_callback.transport.store import open_store

__all__ = ["DCRCheckpointEngine", "DCRSyncError"]

logger = logging.getLogger(__name__)


class DCRSyncError(RuntimeError):
    """A rollout worker did not get the sync's version: refused, aborted, or not there in time.
    The replica (and what the worker serves) stays on the version it held."""


@CheckpointEngineRegistry.register("dcr")
class DCRCheckpointEngine(CheckpointEngine):
    """verl's engine `dcr`. verl passes bucket_size (unused: only changes are sent, through the
    store) and, on the actor, is_master; the rest are `engine_kwargs.dcr`:

    store           the store URL (required), the same on every worker
    receiver_id     rollout workers register as `{receiver_id}-{rank}` in the joint commit
    commit_policy   wait | abort | quorum, ack_timeout (s), quorum, ack_grace (s): config.CommitPolicy
    timeout         seconds a rollout worker waits for the sync's version (and a keyframe)
    poll_s          the rollout worker's pause between polls of the store
    staging         "cpu": the actor copies each weight to host memory as verl yields it (one
                    device tensor alive at a time; the delta runs on CPU); "device": kept as
                    is (the whole model on the device while it is published)
    context         when chunks are context-coded: auto | on | off (config.CONTEXT_MODES)
    link_mbit       the rollout workers' link in Mbit/s, what auto keeps ahead of (None: the
                    actor's own upload)
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 0, is_master: bool = False, *, store: str | None = None,
                 receiver_id: str = "verl-rollout", commit_policy: str = "quorum", ack_timeout: float = 60.0,
                 quorum: float = 0.5, ack_grace: float = 1.0, timeout: float = 600.0, poll_s: float = 0.01,
                 staging: str = "cpu", context: str | bool = "auto", link_mbit: float | None = None):
        if not store:
            raise ValueError("checkpoint engine dcr needs a store: set "
                             "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dcr.store")
        if staging not in ("cpu", "device"):
            raise ValueError(f"dcr staging must be 'cpu' or 'device', not {staging!r}")
        self.bucket_size, self.is_master = bucket_size, is_master
        self.store_url, self.prefix, self.staging = store, receiver_id, staging
        self.policy = CommitPolicy(commit_policy, ack_timeout, quorum, grace=ack_grace)
        self.timeout, self.poll_s = timeout, poll_s
        self.context = context_mode(context)  # bad options are refused when verl builds the engine
        check_link(link_mbit)
        self.link_mbit = link_mbit
        self._store = None
        self.publisher: NamedPublisher | None = None
        self.rank: int | None = None
        self.receiver_id: str | None = None
        self.follower: Follower | None = None
        self.replica: dict[str, torch.Tensor] | None = None
        self._registered_at: float | None = None
        self._last_target: int | None = None  # the version the last receive_weights was for
        self._delivered: dict[str, int] | None = None  # the digests of what the engine was last handed
        self._refused: list[tuple[int, BaseException]] = []

    # ------------------------------------------------------------ verl's process-group steps
    def prepare(self) -> dict[str, Any]:
        return {"is_master": self.is_master}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """No process group: workers meet only through the store. Each rollout worker gets its
        rank (its receiver id); actor rank 0 must be the master (the publisher)."""
        masters = [i for i, m in enumerate(metadata[:actor_wg_world_size]) if m.get("is_master")]
        if masters != [0]:
            raise ValueError(f"dcr: actor rank 0 (and only it) must be the master, got actor ranks {masters}")
        return ({"rank": list(range(actor_wg_world_size)), "role": ["actor"] * actor_wg_world_size},
                {"rank": list(range(rollout_world_size)), "role": ["rollout"] * rollout_world_size})

    def init_process_group(self, rank: int, role: str) -> None:
        """A rollout worker registers in the joint commit here, before the sync's send starts,
        so the sync's version waits for its answer."""
        self.rank = rank
        if role == "rollout":
            self.receiver_id = f"{self.prefix}-{rank}"
            self._register()

    def finalize(self) -> None:
        """Nothing to free: the publisher and the replica carry over to the next sync."""

    # ------------------------------------------------------------ the actor
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None):
        """Publish the weights as one version; returns metrics for verl's trainer. An aborted
        version is not an error here (the next one carries the changes); a failed one raises."""
        if not self.is_master:
            async for _ in ensure_async_iterator(weights):  # the other actor ranks' part of each gather
                pass
            return {}
        if self.publisher is None:  # the first sync: these weights are the baseline (keyframe 0), kept whole
            tensors: dict[str, torch.Tensor] = {}
            async for name, t in ensure_async_iterator(weights):
                if name in tensors:
                    raise ValueError(f"dcr: the weights name {name!r} twice")
                tensors[name] = self._staged(t)
            d = await asyncio.to_thread(self._publish, tensors, global_steps)
        else:  # later syncs stream: one weight held at a time, diffed and uploaded as verl yields it
            d = await asyncio.to_thread(self._publish, self._pulled(weights, asyncio.get_running_loop()),
                                        global_steps)
        if not d["committed"]:
            logger.warning("dcr: version %d aborted (%s); the next version carries its changes",
                           d["version"], d["reason"])
        return {"dcr/version": d["version"], "dcr/committed": float(d["committed"]), "dcr/bytes": d["bytes"],
                "dcr/changed": d["changed"], "dcr/params": d["params"], "dcr/publish_s": d["publish_s"]}

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.to("cpu") if self.staging == "cpu" else t

    def _pulled(self, weights, loop: asyncio.AbstractEventLoop):
        """verl's (async) per-tensor stream as a plain generator for the publisher's thread:
        each next weight is produced on verl's event loop (free while the thread runs)."""
        it = ensure_async_iterator(weights).__aiter__()
        while True:
            try:
                name, t = asyncio.run_coroutine_threadsafe(it.__anext__(), loop).result()
            except StopAsyncIteration:
                return
            yield name, self._staged(t)

    def _publish(self, tensors, global_steps: int | None) -> dict:
        if self.publisher is None:
            # an empty store: keyframe 0 holds these weights; else the baseline is rebuilt from it
            self.publisher = NamedPublisher(self.store(), tensors, policy=self.policy, context=self.context,
                                            link_mbit=self.link_mbit, log=logger.info)
        pub = self.publisher
        # one version per sync, so every rollout worker waits for exactly one (also the first
        # sync, whose delta against its own keyframe is empty)
        v = global_steps if global_steps is not None and global_steps > pub.newest else pub.newest + 1
        return pub.publish(tensors, version=v)

    # ------------------------------------------------------------ a rollout worker
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The tensors the sync's version changed, from the replica, once it is committed and
        verified; raises DCRSyncError (nothing yielded) if it is not."""
        names = await asyncio.to_thread(self._receive, global_steps)
        for n in names:
            yield n, self.replica[n]

    def store(self):
        if self._store is None:
            try:
                self._store = open_store(self.store_url)
            except StoreError as exc:
                raise DCRSyncError(f"dcr: cannot open the store {redact(self.store_url)}: {exc}") from exc
        return self._store

    def _register(self) -> None:
        """Register (or refresh) this rollout worker; the store may be down a while."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                commit.register(self.store(), self.receiver_id, self.follower.version if self.follower else 0)
                break
            except OSError as exc:  # StoreError, or a file store's own
                if time.monotonic() > deadline:
                    raise DCRSyncError(f"dcr: store {redact(self.store_url)} unreachable for {self.timeout:g} s "
                                       f"({exc}): receiver {self.receiver_id} could not register") from exc
                time.sleep(min(1.0, self.timeout / 10))
        if self._registered_at is None:
            self._registered_at = time.time()

    def _receive(self, global_steps: int | None) -> list[str]:
        deadline = time.monotonic() + self.timeout
        if self.receiver_id is None:  # not started by verl's manager: register now
            self.receiver_id = f"{self.prefix}-{self.rank or 0}"
            self._register()
        first = self.follower is None
        if first:
            self._start(deadline)
        f = self.follower
        # this sync's version: global_steps, unless the store is past it (the publisher then
        # takes the next number); the first time, past every version decided before this
        # worker registered (the sync's own cannot be decided without its answer)
        # (every sync publishes a version after keyframe 0: the first one too)
        floor = max(1, self._decided_before_registration() + 1) if first else self._last_target + 1
        target = max(floor, 0 if global_steps is None else global_steps)
        self._last_target = target
        token, pause = 0, self.poll_s
        while f.version < target:
            self._refused.clear()
            f.decision_timeout = max(0.1, deadline - time.monotonic())
            try:
                applied = f.poll(until=target)
            except codec.ChunkError as exc:  # refused (its ack says why): nothing of it was applied
                v = self._refused[-1][0] if self._refused else target
                self._last_target = max(target, v)
                raise DCRSyncError(f"dcr: receiver {self.receiver_id} refused version {v}: {exc}; it keeps "
                                   f"version {f.version}") from exc
            except commit.CommitTimeout as exc:  # acked, and no decision in time
                raise DCRSyncError(f"dcr: version {target} was not decided within {self.timeout:g} s ({exc}); "
                                   f"receiver {self.receiver_id} keeps version {f.version}") from exc
            except OSError as exc:  # StoreError, or a file store's own
                if time.monotonic() > deadline:
                    raise DCRSyncError(f"dcr: store {redact(self.store_url)} unreachable for {self.timeout:g} s "
                                       f"({exc}); receiver {self.receiver_id} keeps version {f.version}") from exc
                applied = []
            if f.version >= target:
                break
            target = self._check_aborted(target)
            left = deadline - time.monotonic()
            if left < 0:
                raise DCRSyncError(f"dcr: version {target} was not committed within {self.timeout:g} s "
                                   f"({self._status(target)}); receiver {self.receiver_id} keeps version {f.version}")
            pause = self.poll_s if applied else backoff(pause, self.poll_s, 0.1)
            try:
                token, _ = wait_news(self.store(), token, pause, min(1.0, left), data_only=True)
            except OSError:  # (a relay restarting: the long-poll is where a sync waits) tried again
                time.sleep(pause)  # above, until the deadline, which names the store
        self._last_target = f.version
        # what changed since the engine was last handed weights (all of them the first time): a
        # failed sync may have applied committed versions before the one it refused
        before, self._delivered = self._delivered, dict(f.digests)
        return list(self.replica) if before is None else [n for n, d in f.digests.items() if d != before[n]]

    def _start(self, deadline: float) -> None:
        """The replica, from the newest committed keyframe (waited for), and its follower."""
        store, err = self.store(), None
        while True:
            try:
                k = latest_keyframe(store)
            except OSError as exc:
                k, err = None, exc
            if k is not None:
                break
            if time.monotonic() > deadline:
                why = f"unreachable ({err})" if err else "no committed keyframe: an empty or wrong store?"
                raise DCRSyncError(f"dcr: nothing to start from in {redact(self.store_url)} after "
                                   f"{self.timeout:g} s: {why}")
            time.sleep(min(0.1, self.timeout / 10))
        try:
            tensors, _ = load_keyframe(store, k)
            cfg = FollowerConfig(receiver_id=self.receiver_id, decision_timeout=self.timeout, poll_s=self.poll_s,
                                 early="sealed")  # applied with an exact undo: a bad digest changes nothing
            f = Follower(store, tensors, version=k, config=cfg)
        except (KeyframeError, codec.ChunkError) as exc:
            raise DCRSyncError(f"dcr: receiver {self.receiver_id} cannot start from keyframe {k}: {exc}") from exc
        f.max_refusals = 0  # a refusal is this sync's error, raised at once
        f.on_refuse = lambda v, exc: self._refused.append((v, exc))
        self.follower, self.replica = f, tensors

    def _decided_before_registration(self) -> int:
        """The newest version decided before this worker registered (-1: none)."""
        store = self.store()
        for v in reversed(commit.list_versions(store)):
            d = commit.read_decision(store, v)
            if d is not None and d["time"] < self._registered_at:
                return v
        return -1

    def _check_aborted(self, target: int) -> int:
        """Raise if the sync's version was aborted; skip one aborted without this worker (a
        dead publisher's leftover). Returns the target, moved past skipped versions."""
        store = self.store()
        for v in commit.list_versions(store):
            if v < target:
                continue
            d = commit.read_decision(store, v)
            if d is None or d["decision"] == "commit":
                break
            if self.receiver_id in d["acked"] or self.receiver_id in d["lagging"]:
                self._last_target = v
                raise DCRSyncError(f"dcr: version {v} was aborted by the joint commit ({d['reason']}); receiver "
                                   f"{self.receiver_id} keeps version {self.follower.version}")
            target = v + 1
        return target

    def _status(self, v: int) -> str:
        """What the store says of version v, for an error."""
        store = self.store()
        try:
            if commit.read_record(store, v) is None:
                newest = max(commit.list_versions(store), default=None)
                return f"not in the store; its newest version is {newest}"
            d = commit.read_decision(store, v)
            return "sealed, undecided" if d is None else f"decided {d['decision']}: {d['reason']}"
        except OSError as exc:
            return f"store unreachable: {exc}"

