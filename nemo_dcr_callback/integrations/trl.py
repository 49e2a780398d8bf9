"""TRL: the `dcr` backend as the weight sync of TRL 1.16's `AsyncGRPOTrainer`.

`trl vllm-serve` hard-codes NCCL; TRL's plug-in point is `AsyncGRPOTrainer(weight_transfer=...)`,
an object with its `WeightTransferProtocol`'s five methods. `DCRWeightTransfer` is one. The
rollout server is a plain `vllm serve` with the `dcr` backend, started from the checkpoint the
trainer starts from:

    VLLM_SERVER_DEV_MODE=1 NEMO_DCR_VLLM_STORE=s3://bucket/run-1 vllm serve ./ckpt-v0 \\
        --weight-transfer-config '{"backend": "dcr"}'

    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from nemo_dcr_callback.integrations.trl import DCRWeightTransfer

    args = AsyncGRPOConfig(output_dir="out", dtype="bfloat16", vllm_server_base_url="http://rollout:8000")
    sync = DCRWeightTransfer("s3://bucket/run-1", args.vllm_server_base_url)
    AsyncGRPOTrainer("./ckpt-v0", reward_funcs=..., args=args, train_dataset=..., weight_transfer=sync).train()

TRL calls it on its main process only (the other ranks walk their share of FSDP's gathers
themselves), in this order each sync: `pause`, `send_weights(iterator)`, `resume`. The first
sync makes the store's keyframe 0 from the tensors (the baseline is the only copy kept) and
points the engine at the store. Each later one publishes a version (delta, seal, joint commit
with the engine acking it) while the engine keeps generating: its follower fetches, verifies and
decodes in the background. Only then is the server paused, the version applied
(`/start_weight_update`, `/update_weights`, `/finish_weight_update`) and the prefix cache reset
(checked: vLLM answers `success=false` while blocks are held). `resume` lets it generate again.
So TRL's `pause` only names the moment: the server is paused for the apply alone.

Pause modes (vLLM 0.32's `/pause`): `keep` (default, as TRL's own client) freezes requests in
flight and resumes them; vLLM then drops their KV at the pause (the route's `clear_cache`) and
the reset below drops anything still held, so their tokens sampled so far came from the old
weights and everything after from the new ones. `wait` lets them finish first; `abort` ends them.

This module needs neither vLLM nor TRL installed: it speaks HTTP to the server (stdlib only).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import torch

from nemo_dcr_callback.config import CommitPolicy
from nemo_dcr_callback.protocol.rebuild import committed_keyframes
from nemo_dcr_callback.sender.named import NamedPublisher
from nemo_dcr_callback.transport.store import open_store

__all__ = ["PAUSE_MODES", "DCRWeightTransfer", "SyncError"]

log = logging.getLogger(__name__)

PAUSE_MODES = ("keep", "wait", "abort")


class SyncError(RuntimeError):
    """The server did not take a version (or refused a route); its weights are as they were."""


class DCRWeightTransfer:
    """TRL's `WeightTransferProtocol` over a DCR store and a `vllm serve` with the `dcr` backend.

    Cheap to build on every rank: nothing is read or sent before TRL's main process calls
    `init_weight_transfer`. `history` holds each sync's decision and timings (`pause_s`: the
    server paused, from `/pause` to the reset's answer; `resume` follows TRL's barrier)."""

    def __init__(self, store: str, server_url: str = "http://localhost:8000", *, receiver_id: str | None = None,
                 engine_store: str | None = None, pause_mode: str = "keep", config_json: str | None = None,
                 commit_mode: str = "wait", commit_timeout_s: float = 600.0, update_timeout_s: float = 600.0,
                 server_timeout_s: float = 240.0, http_timeout_s: float = 300.0, context: str = "auto",
                 link_mbit: float | None = None, reset_tries: int = 5) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"dcr: pause_mode must be one of {PAUSE_MODES}, not {pause_mode!r}")
        self.store = store
        self.engine_store = engine_store or store  # the URL the engine reads (e.g. a relay near it)
        self.url = server_url.rstrip("/")
        # One engine, one id in the joint commit: by default named after its server, so two
        # servers behind one store never answer for each other.
        self.receiver_id = receiver_id or "vllm-" + re.sub(r"[^A-Za-z0-9._-]+", "-",
                                                           urllib.parse.urlsplit(self.url).netloc or self.url)
        self.pause_mode = pause_mode
        self.config_json = config_json  # the model's config.json, for keyframe 0 (engines may start from it)
        self.policy = CommitPolicy(mode=commit_mode, timeout=commit_timeout_s)
        self.update_timeout_s, self.server_timeout_s = update_timeout_s, server_timeout_s
        self.http_timeout_s, self.reset_tries = http_timeout_s, reset_tries
        self.context, self.link_mbit = context, link_mbit
        self.publisher: NamedPublisher | None = None
        self.history: list[dict[str, Any]] = []
        self._paused_at: float | None = None

    # ------------------------------------------------------------------ TRL's protocol
    def init_weight_transfer(self) -> None:
        """Wait for the server and check that it runs the `dcr` backend (TRL's train begin)."""
        deadline = time.monotonic() + self.server_timeout_s
        while True:
            try:
                self._call("GET", "/health", timeout=5)
                break
            except (OSError, SyncError) as exc:
                if time.monotonic() > deadline:
                    raise SyncError(f"dcr: no vLLM server answered at {self.url} within "
                                    f"{self.server_timeout_s:.0f} s") from exc
                time.sleep(1.0)
        config = self._call("GET", "/server_info", params={"config_format": "json"})["vllm_config"]
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend != "dcr":
            raise SyncError(f"dcr: the server at {self.url} runs weight-transfer backend {backend!r}; start it with "
                            "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{\"backend\": \"dcr\"}'")

    def pause(self) -> None:
        """Nothing yet: `send_weights` pauses the server once the version is ready to apply."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publish the trainer's tensors as one version and have the server apply it.

        The first call starts the store (keyframe 0) or resumes it, and points the engine at
        it. A version the joint commit aborted is not applied (the next one carries its
        changes); one the server does not take raises SyncError, its weights as they were."""
        if self.publisher is None:
            self._start(iterator)
            return
        d = self.publisher.publish(iterator)
        self._apply(d)

    def resume(self) -> None:
        """Let the server generate again (if this sync paused it)."""
        if self._paused_at is None:
            return
        self._call("POST", "/resume")
        if self.history:
            self.history[-1]["paused_total_s"] = time.perf_counter() - self._paused_at
        self._paused_at = None

    def destroy(self) -> None:
        """TRL's train end: a server left paused by a failed sync generates again (its weights
        are those of the last version applied whole)."""
        if self._paused_at is not None:
            try:
                self.resume()
            except (OSError, SyncError) as exc:
                log.warning("dcr: could not resume the server at %s: %s", self.url, exc)

    # ------------------------------------------------------------------ the work
    def _start(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        store = open_store(self.store)
        fresh = not committed_keyframes(store)
        # An empty store takes these tensors as keyframe 0 (consumed once; the publisher keeps
        # its baseline copy only). A store with history is the baseline (its newest committed
        # version, which the engine must hold), placed where these tensors are; they then go
        # out as the next version (held whole meanwhile: a resume's first sync only).
        tensors = iterator if fresh else dict(iterator)
        self.publisher = NamedPublisher(store, tensors, policy=self.policy, config_json=self.config_json,
                                        context=self.context, link_mbit=self.link_mbit)
        self._call("POST", "/init_weight_transfer_engine", {"init_info": {
            "store": self.engine_store, "receiver_id": self.receiver_id, "version": self.publisher.last}})
        self._call("POST", "/update_weight_version", {"new_version": str(self.publisher.last)})
        self.history.append({"version": self.publisher.last, "committed": True, "start": True})
        if not fresh:
            self._apply(self.publisher.publish(tensors))

    def _apply(self, d: dict[str, Any]) -> None:
        self.history.append(d)
        if not d["committed"]:
            log.warning("dcr: version %d was aborted (%s); the server stays on %d", d["version"], d["reason"],
                        self.publisher.last)
            return
        v = d["version"]
        t0 = time.perf_counter()
        self._call("POST", "/pause", params={"mode": self.pause_mode})
        self._paused_at = t0
        self._call("POST", "/start_weight_update")
        try:
            self._call("POST", "/update_weights", {"update_info": {"version": v, "timeout_s": self.update_timeout_s}},
                       timeout=self.update_timeout_s + 60)
        except BaseException:
            with contextlib.suppress(OSError, SyncError):  # (ends the session: the next sync starts a new one)
                self._call("POST", "/finish_weight_update")
            raise
        self._call("POST", "/finish_weight_update", {"weight_version": str(v)})
        applied = time.perf_counter()
        self._reset_prefix_cache(v)
        d.update(apply_s=applied - t0, pause_s=time.perf_counter() - t0)

    def _reset_prefix_cache(self, v: int) -> None:
        """Drop every cached block: its KV came from the old weights. Paused, any block still
        held belongs to a frozen request (keep), so those are preempted too
        (`reset_running_requests`) and recompute their KV on resume."""
        for i in range(self.reset_tries):
            if self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"}).get("success"):
                return
            time.sleep(0.1 * 2**i)  # (blocks held by an async KV transfer are released shortly)
        raise SyncError(f"dcr: version {v} applied, but the server at {self.url} refused to reset its prefix cache "
                        f"{self.reset_tries} times (blocks still held): cached KV of the old weights could be served")

    def _call(self, method: str, path: str, body: dict | None = None, *, params: dict | None = None,
              timeout: float | None = None) -> dict:
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.http_timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raise SyncError(f"dcr: {method} {path} at {self.url}: HTTP {exc.code}: {exc.read()[:400]!r}") from exc
        return json.loads(raw) if raw else {}
