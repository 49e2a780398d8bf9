"""A vLLM engine as a receiver: `LLM(model, worker_extension_cls=
"nemo_dcr_callback.integrations.vllm.DCRWorkerExtension")` (or `vllm serve
--worker-extension-cls ...`) mixes this class into every worker; the engine then follows a
store through `collective_rpc`:

    llm.collective_rpc("dcr_attach", args=("file:///shared/dcr",), kwargs={"receiver_id": "rollout-0"})
    llm.collective_rpc("dcr_update")      # applies every committed version, returns the version held
    llm.reset_prefix_cache()              # cached KV of the old weights must go

A version is fetched, verified and decoded first; then the model's own `load_weights` places
every change in place (LoaderTarget: under a dispatch mode its copies become the chunks'
operation, so vLLM's fused qkv_proj/gate_up_proj, its TP shards and padded vocab are its own
doing). A refused version changes nothing. The call runs between engine steps, so the engine
pauses only for it.

On CPU, vLLM repacks every linear weight for its GEMM kernels after loading and drops the
weight (`dispatch_cpu_unquantized_gemm(remove_weight=True)`): there is then nothing to update
in place. Importing this module (which vLLM does in each worker before the model loads)
makes the CPU dispatch keep the weights, and after an apply the layers whose weights changed
are repacked (the `repack_s` of the result). GPUs keep their weights; nothing is repacked.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

_KEEP = "_dcr_keeps_cpu_weights"


def _keep_cpu_weights() -> None:
    """Make vLLM's CPU GEMM dispatch keep each linear's weight (idempotent)."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:  # not inside vLLM (docs, tests of the rest of the package)
        return
    if getattr(utils, _KEEP, False):
        return
    orig = utils.dispatch_cpu_unquantized_gemm

    def keep(layer, remove_weight: bool) -> None:
        orig(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = keep
    utils._dcr_dispatch = orig
    setattr(utils, _KEEP, True)


_keep_cpu_weights()


def _checkpoint_shapes(model_dir: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Canonical (Hugging Face) names, shapes and dtypes, from the checkpoint's headers."""
    from nemo_dcr_callback import codec
    from nemo_dcr_callback.tools.checkpoint import Checkpoint

    ck = Checkpoint(model_dir)
    return {n: (torch.Size(ck.entry(n).shape), codec.dtype_info(ck.entry(n).dtype).torch) for n in ck.where}


class DCRWorkerExtension:
    """Methods vLLM adds to its Worker (self.model_runner.model is the live model)."""

    def dcr_attach(self, store_url: str, receiver_id: str | None = None, version: int | str = 0,
                   model_dir: str | None = None) -> int:
        """Follow store_url from `version` (the version the engine was loaded with). Numbers
        may come as strings (`vllm serve`'s /collective_rpc passes only strings); a relay's
        token is read from NEMO_DCR_RELAY_TOKEN in the engine's environment, never passed."""
        version = int(version)
        from nemo_dcr_callback.receiver.follow import Follower
        from nemo_dcr_callback.receiver.targets import LoaderTarget
        from nemo_dcr_callback.transport.store import open_store

        model = self.model_runner.model
        model_dir = model_dir or self.model_runner.model_config.model
        shapes = _checkpoint_shapes(model_dir)
        self._dcr_target = LoaderTarget(model, model.load_weights, shapes)
        refused = sorted(n for n, ok in self._dcr_target.plain.items() if not ok)
        if refused:
            raise ValueError(f"vLLM's loader does not copy {refused[0]!r} (and {len(refused) - 1} more) as a plain "
                             f"copy: these cannot be updated in place")
        self._dcr = Follower(open_store(store_url), self._dcr_target, version=version, receiver_id=receiver_id)
        self._dcr_layers = self._linear_layers(model)
        self._dcr_load_s = 0.0
        self._dcr_changed: set[str] = set()
        apply = self._dcr_target.apply_with_terms

        def timed(decoded):  # the in-place part of an update: what pauses the engine once
            t0 = time.perf_counter()  # fetching and decoding run ahead of it
            self._dcr_changed.update(d.header.name for d in decoded)
            try:
                return apply(decoded)
            finally:
                self._dcr_load_s += time.perf_counter() - t0

        self._dcr_target.apply_with_terms = timed
        return version

    @staticmethod
    def _linear_layers(model) -> dict[int, torch.nn.Module]:
        """Modules whose weights vLLM's CPU dispatch packed, by their weight's storage."""
        return {p.untyped_storage().data_ptr(): m for m in model.modules()
                if hasattr(m, "cpu_linear") and isinstance(getattr(m, "weight", None), torch.Tensor)
                for p in [m.weight]}

    def dcr_update(self, until: int | str | None = None) -> dict:
        """Apply every committed version after the one held (up to `until`); returns the
        version held, the versions applied, the time the apply took and the repack's."""
        from nemo_dcr_callback import codec

        if not hasattr(self, "_dcr"):
            raise RuntimeError("dcr_update before dcr_attach")
        until = None if until is None else int(until)
        t0, held, refused = time.perf_counter(), self._dcr.version, None
        self._dcr_load_s = 0.0
        self._dcr_changed = set()
        try:
            self._dcr.poll(until=until)
        except codec.ChunkError as exc:  # nothing of that version was applied: keep serving
            refused = str(exc)
        apply_s = time.perf_counter() - t0
        applied = list(range(held + 1, self._dcr.version + 1))
        repack_s = self._repack(self._dcr_changed) if applied else 0.0
        return {"version": self._dcr.version, "applied": applied, "apply_s": apply_s, "load_s": self._dcr_load_s,
                "fetch_decode_s": apply_s - self._dcr_load_s, "repack_s": repack_s, "refused": refused}

    def dcr_reload_dense(self, model_dir: str, version: int | str) -> dict:
        """Load every weight of a dense checkpoint in place through load_weights (a resync, e.g.
        from a keyframe after the chain broke); the engine then holds `version`."""
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        weights = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            weights.update(load_file(str(f)))
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model_runner.model.load_weights(iter(sorted(weights.items())))
        load_s = time.perf_counter() - t0
        repack_s = self._repack(None)
        if hasattr(self, "_dcr"):  # follow on from there, the digests taken afresh (and checked)
            f = self._dcr
            f.version = int(version)
            if f.digests is not None:
                f.digests = {n: self._dcr_target.digest_of(n) for n in f.digests}
                f._check_held()
        return {"read_s": read_s, "load_s": load_s, "repack_s": repack_s}

    def _repack(self, names: set[str] | None) -> float:
        """CPU only: rebuild the packed GEMM weights of the layers the apply wrote (names: the
        canonical tensors changed; None: every layer)."""
        if not self._dcr_layers:
            return 0.0
        from vllm.model_executor.layers import utils

        layers = self._dcr_layers.values()
        if names is not None and hasattr(self, "_dcr_target"):  # where the loader put each tensor
            keys = {v.dst.untyped_storage().data_ptr() for n in names for v in self._dcr_target._views.get(n, [])}
            layers = [m for k, m in self._dcr_layers.items() if k in keys]
        t0 = time.perf_counter()
        for m in layers:
            utils._dcr_dispatch(m, remove_weight=False)
        return time.perf_counter() - t0

    def dcr_version(self) -> int:
        return self._dcr.version if hasattr(self, "_dcr") else -1

    def dcr_params(self) -> dict[str, bytes]:
        """Every parameter's raw bytes, in vLLM's own (fused, sharded) layout: for checks."""
        return {n: p.detach().contiguous().view(torch.uint8).numpy().tobytes()
                for n, p in self.model_runner.model.named_parameters()}
