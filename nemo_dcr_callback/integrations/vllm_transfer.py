"""`dcr` as a vLLM weight-transfer backend: selected by configuration, no worker extension.

Engine side (every vLLM worker), selected with `--weight-transfer-config '{"backend": "dcr"}'`
(or `LLM(..., weight_transfer_config={"backend": "dcr"})`); the `vllm.general_plugins` entry
point in pyproject.toml registers it in every vLLM process. Driven by vLLM's own RL routes
(`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) or `LLM`'s methods of the same names:

    init_info   {"store": "s3://bucket/run", "receiver_id": "rollout-0", "version": 0}
    update_info {"version": 7}

`init_weight_transfer_engine` checks the held weights against that version's digests and
starts the background follower (fetch, verify, decode and ack, while the engine generates);
`update_weights` applies, in place through the model's own `load_weights`, every committed
version up to the one named, and answers only once the digests matched. A version that is
refused, aborted, or not in the store is an error naming it, and leaves the weights as they
were (at the last version that was applied whole). Reset the prefix cache after an update
(the trainer engine below does, and checks the answer): cached KV came from the old weights.

Trainer side (`DCRTrainerWeightTransferEngine`, through vLLM's `WeightTransferTrainerFactory`
with a `DCRTrainerInitInfo`): for trainers that hold Hugging Face-named tensors. Importing this
module registers `dcr` with vLLM's factories (a trainer process builds no engine, so vLLM never
loads its plugins there). It keeps the baseline (on the sender only), publishes each version
through the store (sender/named.py: delta, seal, joint commit with every engine as a receiver
of its own) and then has each engine pause, apply, reset its prefix cache (checked) and resume,
through any `VLLMWeightSyncClient` with pause/resume/reset (HTTPClient, RayClient, or
LLMClient for an in-process `LLM`).

As with the worker extension, a server that exposes these routes (VLLM_SERVER_DEV_MODE) lets
whoever reaches the port name the store, so `init_weight_transfer_engine` checks it first
(integrations/vllm.py, check_store_allowed): with NEMO_DCR_VLLM_STORE set at start-up only
that store; without it, no relay off this machine (the relay token would go to it); the
operator's NEMO_DCR_VLLM_ANY_STORE=1 lifts both. `init_info.model_dir` must be the served
model's folder (check_model_dir).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient

from nemo_dcr_callback.config import CommitPolicy
from nemo_dcr_callback.integrations.vllm import (
    BACKEND,
    EngineWeights,
    check_model_dir,
    check_store_allowed,
    tp_group,
)
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.sender.named import NamedPublisher

__all__ = ["check_export", "DCRInitInfo", "DCRTrainerInitInfo", "DCRTrainerWeightTransferEngine", "DCRUpdateInfo",
           "DCRWeightTransferEngine", "EngineError", "HTTPClient", "LLMClient", "RayClient", "UpdateError"]

log = logging.getLogger(__name__)


class UpdateError(RuntimeError):
    """The version asked for was not applied (refused, aborted, not in the store)."""


@dataclass
class DCRInitInfo(WeightTransferInitInfo):
    store: str
    receiver_id: str | None = None  # its id in the joint commit (None: the trainer does not wait for it)
    version: int = 0  # the version the engine holds now (loaded from its keyframe or export)
    model_dir: str | None = None  # the checkpoint whose shapes name the tensors (default: the served model)
    idle_poll_s: float = 0.2


@dataclass
class DCRUpdateInfo(WeightTransferUpdateInfo):
    version: int
    timeout_s: float = 600.0


class DCRWeightTransferEngine(WeightTransferEngine[DCRInitInfo, DCRUpdateInfo]):
    """The engine side: a follower of a DCR store, applied at `update_weights`."""

    init_info_cls = DCRInitInfo
    update_info_cls = DCRUpdateInfo
    supports_draft_weight_update = False  # (a draft model would need its own store and version)

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.weights: EngineWeights | None = None
        self.last: dict | None = None  # the last update's figures (pause, fetch+decode)

    def init_transfer_engine(self, init_info: DCRInitInfo) -> None:
        check_store_allowed(init_info.store)  # before anything changes: the engine goes on as it was
        model_dir = check_model_dir(init_info.model_dir, self.model_config.model, "init_info.model_dir")
        new = EngineWeights(self.model, model_dir, tp_group())
        new.attach(init_info.store, self.receiver_id(init_info.receiver_id), int(init_info.version),
                   float(init_info.idle_poll_s), strict=True)  # (refused: the store followed before, if any, stays)
        if self.weights is not None:
            self.weights.detach()
        self.weights = new

    def receiver_id(self, given: str | None) -> str | None:
        """This engine's id in the joint commit: with data parallelism every DP engine behind one
        server gets the same init_info, so each adds its DP rank (one engine, one receiver)."""
        pc = self.parallel_config
        if not given or pc.data_parallel_size <= 1:
            return given or None
        # (data_parallel_index: the rank vLLM keeps for dense models, whose engines it runs as DP 1 each)
        return f"{given}-dp{getattr(pc, 'data_parallel_index', pc.data_parallel_rank)}"

    def start_weight_update(self) -> None:
        if self.weights is None or self.weights.follower is None:
            raise UpdateError("dcr: init_weight_transfer_engine first (no store is followed)")

    def receive_weights(self, update_info: DCRUpdateInfo) -> None:
        w = self.weights
        v, held = int(update_info.version), w.version
        if v < held:
            raise UpdateError(f"dcr: version {v} is older than the version held ({held}); nothing applied")
        if v == held:
            return
        store = w.store
        if commit.read_record(store, v) is None:
            raise UpdateError(f"dcr: version {v} is not in {store.url} (not sealed); holding {held}, nothing applied")
        d = commit.read_decision(store, v)
        if d is not None and d["decision"] != "commit":
            raise UpdateError(f"dcr: version {v} was not committed ({d['reason']}); holding {held}, nothing applied")
        self.last = up = w.update(until=v, wait=True, timeout=float(update_info.timeout_s))
        if up["version"] != v:
            why = up["refused"] or "not committed"
            raise UpdateError(f"dcr: version {v} not applied: {why}; holding version {up['version']}")

    def finish_weight_update(self) -> None:
        pass  # applied in place at update_weights: nothing to finalize

    def shutdown(self) -> None:
        if self.weights is not None:
            self.weights.detach()


def check_export(worker, version: int) -> dict:
    """The held version against its dense export in the store (EngineWeights.check_export: the
    trainer's gather and convert, written with dcr.verify), in each worker of an engine that
    runs the `dcr` backend: `(Async)LLM.collective_rpc(check_export, args=(v,))` (a callable:
    VLLM_ALLOW_INSECURE_SERIALIZATION=1). The backend has no route of its own for it."""
    eng = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(eng, DCRWeightTransferEngine) or eng.weights is None:
        raise UpdateError("dcr: this engine does not run the dcr backend, or init_weight_transfer_engine was "
                          "not called")
    return eng.weights.check_export(int(version))


PAUSE_MODES = ("keep", "wait", "abort", "none")


@dataclass
class DCRTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    store: str
    engine_store: str | None = None  # the URL the engines read (e.g. a relay near them); default: store
    receiver_id: str | None = "vllm"  # the engines' id in the joint commit (None: not awaited); with
    # several engines each gets its own, `{receiver_id}-{i}`, unless receiver_ids names them
    receiver_ids: list[str] | None = None
    config_json: str | None = None  # the model's config.json, for keyframe 0 (engines start from it)
    context: str = "auto"  # when chunks are context-coded (config.CONTEXT_MODES: auto | on | off)
    link_mbit: float | None = None  # the engines' link (Mbit/s): what context="auto" keeps ahead of
    commit_mode: str = "wait"  # CommitPolicy: every engine's ack is awaited, a refusal aborts
    commit_timeout_s: float = 600.0
    update_timeout_s: float = 600.0
    # how running requests meet the apply (PAUSE_MODES). keep: they wait, keeping their tokens (their KV
    # is recomputed with the new weights); wait: they finish first; abort: they end; none: no pause (the
    # steps between the apply and the reset still read KV of the old weights)
    pause_mode: str = "keep"
    # keep/none: the running requests' KV is recomputed with the new weights (the reset preempts them; a
    # prefill of every running sequence when they resume). False keeps their KV of the old weights (as
    # PipelineRL does); vLLM then refuses the prefix-cache reset while they hold blocks, so new requests
    # may reuse cached KV of the old weights until a later reset succeeds (reported: "reset": False)
    recompute_kv: bool = True
    reset_retries: int = 5  # prefix-cache resets that answer success=false, retried before failing

    def __post_init__(self) -> None:
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"dcr: pause_mode must be one of {PAUSE_MODES}, not {self.pause_mode!r}")
        if self.reset_retries < 0:
            raise ValueError("dcr: reset_retries must be >= 0")


@dataclass
class Engine:
    """One engine behind the trainer engine: its own id in the joint commit, its own client."""

    id: str | None
    client: Any


def split_clients(client: Any) -> list[Any]:
    """One client per engine: a list as given; vLLM's Ray client over several actors becomes one
    per actor (its calls fan out to all with one init_info, which would give them one identity)."""
    if isinstance(client, (list, tuple)):
        return [c for cl in client for c in split_clients(cl)]
    handles = getattr(client, "handles", None)
    if isinstance(handles, list) and len(handles) > 1 and isinstance(client, RayVLLMWeightSyncClient):
        return [RayClient(h) for h in handles]
    return [client]


def engine_ids(info: DCRTrainerInitInfo, n: int) -> list[str | None]:
    """Each engine's receiver id: named by the user, else derived from receiver_id and its index."""
    if info.receiver_ids is not None:
        ids = list(info.receiver_ids)
        if len(ids) != n or len(set(ids)) != n or not all(ids):
            raise ValueError(f"dcr: receiver_ids must name each of the {n} engines once, got {ids}")
        return ids
    if info.receiver_id is None:
        return [None] * n
    return [info.receiver_id] if n == 1 else [f"{info.receiver_id}-{i}" for i in range(n)]


class DCRTrainerWeightTransferEngine(TrainerWeightTransferEngine[DCRTrainerInitInfo]):
    """The trainer side: keeps the baseline, publishes each version, has every engine apply it.

    `client` is one VLLMWeightSyncClient or a list of them (one per engine: several servers, or
    the DP ranks of a Ray deployment); each engine registers and acks under its own id, so the
    joint commit counts each and a refusal names the engine. `send_weights()` iterates the
    `WeightSource` (on every rank: materialising may be a collective); only the sender keeps
    anything (its baseline, one copy of the model). `send_weights(weights)` takes the named
    tensors directly instead.

    Per version: publish (the engines fetch, verify, decode and ack in the background while
    they generate), then per engine, all at once: pause (pause_mode), apply, reset the prefix
    cache (checked), resume. Under `keep` running requests stay, with the tokens they have;
    the reset preempts them, so their KV is recomputed with the new weights when they resume."""

    init_info_cls = DCRTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: DCRTrainerInitInfo, *, client: VLLMWeightSyncClient | list,
                     source: WeightSource | None = None) -> DCRTrainerWeightTransferEngine:
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
        self.publisher = None
        clients = split_clients(client)
        self.engines = [Engine(i, c) for i, c in zip(engine_ids(init_info, len(clients)), clients, strict=True)]
        self.last_update: dict[str, dict] = {}  # per engine: the last update's figures or error
        if not self.is_sender:
            if source is not None:  # (the collective's share of this rank; nothing kept)
                for _ in source:
                    pass
            return self
        policy = CommitPolicy(mode=init_info.commit_mode, timeout=init_info.commit_timeout_s)
        self.publisher = NamedPublisher(init_info.store, iter(source) if source is not None else None, policy=policy,
                                        config_json=init_info.config_json, context=init_info.context,
                                        link_mbit=init_info.link_mbit)
        url = init_info.engine_store or init_info.store
        errors = _each(self.engines, lambda e: e.client.init_weight_transfer_engine(
            {"store": url, "receiver_id": e.id, "version": self.publisher.last}))
        if errors:
            raise EngineError("init", self.publisher.last, errors)
        return self

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> dict | None:
        """One version; returns its decision and figures on the sender (None elsewhere), with
        "engines": per engine, the pause and apply as the trainer measured them. An aborted
        version is not sent to the engines (the next one covers it); its decision's reason names
        the engines that refused it. An engine that fails the update raises EngineError naming
        it (every engine was resumed first)."""
        if weights is None:
            if self.source is None:
                raise ValueError("dcr: send_weights needs the tensors (no WeightSource was given)")
            weights = iter(self.source)
        if not self.is_sender:
            for _ in weights:  # (the collective's share of this rank)
                pass
            return None
        d = self.publisher.publish(weights)
        if not d["committed"]:
            log.warning("dcr: version %d was aborted (%s); the engines stay on %d", d["version"], d["reason"],
                        self.publisher.last)
            return d
        v = d["version"]
        figures: dict[str, dict] = {}
        errors = _each(self.engines, lambda e: figures.__setitem__(e.id, self._update(e, v)))
        self.last_update = {**figures, **{k: {"error": why} for k, why in errors.items()}}
        if errors:
            raise EngineError("update", v, errors)
        return {**d, "engines": figures}

    def _update(self, e: Engine, v: int) -> dict:
        """pause -> apply -> checked reset -> resume on one engine; resumed whatever happened."""
        c, mode = e.client, self.info.pause_mode
        paused = False
        c.start_weight_update()  # (a flag in each worker: before the pause, one call less inside it)
        marks, session = [time.perf_counter()], True
        reset_by_pause = False
        try:
            if mode != "none":
                # vLLM's pause resets the prefix cache itself (clear_cache), preempting kept requests,
                # and fails if it cannot: the checked reset, done where nothing runs until the resume
                # (one call less inside the pause). Kept KV asks it not to.
                reset_by_pause = bool(_call(c, "pause", mode, self.info.recompute_kv)) and self.info.recompute_kv
                paused = True
            marks.append(time.perf_counter())
            session = False  # (an update that fails ends the workers' session itself)
            c.update_weights({"version": v, "timeout_s": self.info.update_timeout_s})
            marks.append(time.perf_counter())
            c.finish_weight_update(weight_version=str(v))
            if reset_by_pause:
                resets, reset = 0, True
            elif self.info.recompute_kv or mode not in ("keep", "none"):
                resets, reset = _reset(c, running=mode in ("keep", "none"), retries=self.info.reset_retries), True
            else:  # (kept KV holds blocks: one try, the answer reported)
                resets, reset = 1, _reset_once(c)
                if not reset:
                    log.warning("dcr: %s kept the running requests' KV: its prefix cache was not reset (version "
                                "%d); new requests may reuse KV of the old weights", e.id, v)
            marks.append(time.perf_counter())
        finally:
            if session:  # the pause failed: end the session, or the next start_weight_update is refused
                try:
                    c.finish_weight_update()
                except Exception as exc:  # noqa: BLE001 (the pause's error is the one raised)
                    log.warning("dcr: ending the update session on %s failed too: %s", e.id, exc)
            if paused:
                _call(c, "resume")
        marks.append(time.perf_counter())
        now = time.time()
        # pause_s: the engine generated nothing (from the pause's answer to the resume's); before
        # that, pause_wait_s, the running step ended (generating)
        return {"pause_s": marks[4] - marks[1], "apply_s": marks[2] - marks[1], "resets": resets, "reset": reset,
                "pause_wait_s": marks[1] - marks[0], "reset_s": marks[3] - marks[2], "resume_s": marks[4] - marks[3],
                "pause_called_at": now - (marks[4] - marks[0]), "paused_at": now - (marks[4] - marks[1]),
                "resumed_at": now}


class EngineError(UpdateError):
    """Engines that refused or failed a step (init or update), each by its id with why."""

    def __init__(self, step: str, version: int, errors: dict[str | None, str]):
        self.step, self.version, self.errors = step, version, errors
        named = "; ".join(f"{k}: {why}" for k, why in errors.items())
        super().__init__(f"dcr: {step} of version {version} failed on {len(errors)} engine(s): {named}")


def _each(engines: list[Engine], fn) -> dict[str | None, str]:
    """fn on every engine at once (each pauses only for its own apply); the errors by engine."""
    if not engines:  # (a trainer that only publishes: engines follow the store on their own)
        return {}
    if len(engines) == 1:
        try:
            fn(engines[0])
            return {}
        except Exception as exc:  # noqa: BLE001 (named and raised by the caller)
            return {engines[0].id: f"{type(exc).__name__}: {exc}"}
    with ThreadPoolExecutor(len(engines), thread_name_prefix="dcr-engine") as pool:
        futs = {e.id: pool.submit(fn, e) for e in engines}
    return {k: f"{type(f.exception()).__name__}: {f.exception()}" for k, f in futs.items() if f.exception()}


def _call(client, method: str, *args):
    fn = getattr(client, method, None)
    if fn is None:
        raise UpdateError(f"dcr: {type(client).__name__} cannot {method} an engine; use a client that can "
                          f"(HTTPClient, LLMClient, RayClient) or pause_mode='none'")
    return fn(*args)


def _reset(client, running: bool, retries: int) -> int:
    """Reset the prefix cache (KV of the old weights must not serve the new ones) and check the
    answer: vLLM refuses (False) while requests hold blocks, so under `keep` the running ones
    are preempted; refused again, it is retried, then an error. Returns the attempts made."""
    fn = getattr(client, "reset_prefix_cache", None)
    if fn is None:
        raise UpdateError(f"dcr: {type(client).__name__} cannot reset the engine's prefix cache (its KV would "
                          "serve the new weights); use HTTPClient, LLMClient or RayClient")
    for attempt in range(1, retries + 2):
        if fn(reset_running_requests=running) is not False:  # (clients that cannot tell answer None)
            return attempt
        time.sleep(0.05 * attempt)
    raise UpdateError(f"dcr: the engine refused to reset its prefix cache {retries + 1} times (requests still hold "
                      "KV blocks, or KV is in transfer): its cached KV is from the old weights")


def _reset_once(client) -> bool:
    fn = getattr(client, "reset_prefix_cache", None)
    if fn is None:
        raise UpdateError(f"dcr: {type(client).__name__} cannot reset the engine's prefix cache")
    return fn(reset_running_requests=False) is not False


class LLMClient:
    """A VLLMWeightSyncClient over an in-process `vllm.LLM` (whose methods take requests). Its
    generate() blocks, so nothing runs during an update: pause and resume have nothing to do."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> bool:
        return False  # (nothing paused, nothing reset: the reset is a call of its own)

    def resume(self) -> None:
        pass

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(self.llm.reset_prefix_cache(reset_running_requests=reset_running_requests))


class HTTPClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP client for the RL routes, plus pause / resume and a checked prefix-cache reset
    (`/pause?mode=`, `/resume`, `/reset_prefix_cache`: VLLM_SERVER_DEV_MODE=1)."""

    def _post_json(self, path: str, params: dict | None = None) -> dict:
        import requests  # (as vLLM's client: a dependency of vLLM's server)

        r = requests.post(f"{self.base_url}/{path}", params=params, timeout=self.timeout)
        if r.status_code != 200:
            raise UpdateError(f"dcr: {self.base_url}/{path} answered HTTP {r.status_code}: {r.text[:300]}")
        return r.json() if r.content else {}

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> bool:
        """Pause; with clear_cache the engine resets its prefix cache too, or the pause fails
        (HTTP 500: an error here). True: the cache was reset."""
        self._post_json("pause", {"mode": mode, "clear_cache": str(clear_cache).lower()})
        return clear_cache

    def resume(self) -> None:
        self._post_json("resume")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        got = self._post_json("reset_prefix_cache", {"reset_running_requests": str(reset_running_requests).lower()})
        if "success" not in got:
            raise UpdateError(f"dcr: {self.base_url}/reset_prefix_cache answered {got!r}, not its success")
        return bool(got["success"])


class RayClient(RayVLLMWeightSyncClient):
    """vLLM's Ray client for one AsyncLLM actor, plus pause / resume and a checked prefix-cache
    reset (the actor's pause_generation, resume_generation and reset_prefix_cache)."""

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> bool:
        import ray  # optional: only where the engines are Ray actors

        ray.get([h.pause_generation.remote(mode=mode, clear_cache=clear_cache) for h in self.handles])
        return clear_cache

    def resume(self) -> None:
        import ray  # optional: only where the engines are Ray actors

        ray.get([h.resume_generation.remote() for h in self.handles])

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        import ray  # optional: only where the engines are Ray actors

        return all(ray.get([h.reset_prefix_cache.remote(reset_running_requests=reset_running_requests)
                            for h in self.handles]))


def _register() -> None:
    """Importing this module registers `dcr` with vLLM's factories: a trainer process builds no
    engine, so vLLM never runs the `vllm.general_plugins` entry point there."""
    from nemo_dcr_callback.integrations.vllm_plugin import register  # (one registration, the plugin's)

    register()


_register()
