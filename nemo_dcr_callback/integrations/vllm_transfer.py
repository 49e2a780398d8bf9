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
(the trainer engine below does it where its client can): cached KV came from the old weights.

Trainer side (`DCRTrainerWeightTransferEngine`, through vLLM's `WeightTransferTrainerFactory`
with a `DCRTrainerInitInfo`): for trainers that hold Hugging Face-named tensors. It keeps the
baseline, publishes each version through the store (sender/named.py: delta, seal, joint commit
with the engine as a receiver) and then asks the engine to apply it through any
`VLLMWeightSyncClient` (HTTP, Ray, or `LLMClient` below for an in-process `LLM`).

As with the worker extension, a server that exposes these routes (VLLM_SERVER_DEV_MODE) lets
whoever reaches the port choose the store: set NEMO_DCR_VLLM_STORE for the server to pin it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
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
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from nemo_dcr_callback.config import CommitPolicy
from nemo_dcr_callback.integrations.vllm import BACKEND, EngineWeights, check_store_allowed, tp_group
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.sender.named import NamedPublisher

__all__ = ["DCRInitInfo", "DCRTrainerInitInfo", "DCRTrainerWeightTransferEngine", "DCRUpdateInfo",
           "DCRWeightTransferEngine", "HTTPClient", "LLMClient", "UpdateError"]

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
        new = EngineWeights(self.model, init_info.model_dir or self.model_config.model, tp_group())
        new.attach(init_info.store, init_info.receiver_id, int(init_info.version), float(init_info.idle_poll_s),
                   strict=True)  # (refused: the store followed before, if any, stays)
        if self.weights is not None:
            self.weights.detach()
        self.weights = new

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


@dataclass
class DCRTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    store: str
    engine_store: str | None = None  # the URL the engines read (e.g. a relay near them); default: store
    receiver_id: str | None = "vllm"  # the engine's id in the joint commit (None: not awaited)
    config_json: str | None = None  # the model's config.json, for keyframe 0 (engines start from it)
    context: str = "auto"  # when chunks are context-coded (config.CONTEXT_MODES: auto | on | off)
    link_mbit: float | None = None  # the engines' link (Mbit/s): what context="auto" keeps ahead of
    commit_mode: str = "wait"  # CommitPolicy: the engine's ack is awaited, a refusal aborts
    commit_timeout_s: float = 600.0
    update_timeout_s: float = 600.0


class DCRTrainerWeightTransferEngine(TrainerWeightTransferEngine[DCRTrainerInitInfo]):
    """The trainer side: keeps the baseline, publishes each version, has the engine apply it.

    `send_weights()` iterates the `WeightSource` (on every rank: materialising may be a
    collective); the sender publishes and drives the engine. `send_weights(weights)` takes
    the named tensors directly instead."""

    init_info_cls = DCRTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: DCRTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> DCRTrainerWeightTransferEngine:
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
        self.publisher = None
        tensors = list(iter(source)) if source is not None else None
        if self.is_sender:
            policy = CommitPolicy(mode=init_info.commit_mode, timeout=init_info.commit_timeout_s)
            self.publisher = NamedPublisher(init_info.store, tensors, policy=policy,
                                            config_json=init_info.config_json, context=init_info.context,
                                            link_mbit=init_info.link_mbit)
            client.init_weight_transfer_engine({"store": init_info.engine_store or init_info.store,
                                                "receiver_id": init_info.receiver_id,
                                                "version": self.publisher.last})
        return self

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> dict | None:
        """One version; returns its decision and figures on the sender (None elsewhere). An
        aborted version is not sent to the engine (the next one covers it); a failed update
        raises."""
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
            log.warning("dcr: version %d was aborted (%s); the engine stays on %d", d["version"], d["reason"],
                        self.publisher.last)
            return d
        v = d["version"]
        self.client.start_weight_update()
        self.client.update_weights({"version": v, "timeout_s": self.info.update_timeout_s})
        self.client.finish_weight_update(weight_version=str(v))
        reset = getattr(self.client, "reset_prefix_cache", None)
        if reset is not None:
            reset()  # cached KV was computed with the old weights
        return d


class LLMClient:
    """A VLLMWeightSyncClient over an in-process `vllm.LLM` (whose methods take requests)."""

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

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class HTTPClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP client for the RL routes, which also resets the prefix cache after an update."""

    def reset_prefix_cache(self) -> None:
        self._post("reset_prefix_cache")
