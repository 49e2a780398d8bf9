"""A vLLM engine as a receiver: `LLM(model, worker_extension_cls=
"nemo_dcr_callback.integrations.vllm.DCRWorkerExtension")` (or `vllm serve
--worker-extension-cls ...`) mixes this class into every worker; the engine then follows a
store through `collective_rpc`:

    llm.collective_rpc("dcr_attach", args=("file:///shared/dcr",), kwargs={"receiver_id": "rollout-0"})
    llm.collective_rpc("dcr_update")      # applies every version sealed now; returns what it did
    llm.reset_prefix_cache()              # cached KV of the old weights must go

After `dcr_attach` a thread in each worker lists the store, fetches, verifies and decodes the
next versions, acks them and waits for the joint commit while the engine keeps generating
(receiver/background.py). `dcr_update` runs in the engine's loop between two steps (that is
where vLLM runs collective_rpc), so the engine pauses only for the apply: the model's own
`load_weights` places every change in place (LoaderTarget: under a dispatch mode its copies
become the chunks' operation, so vLLM's fused qkv_proj/gate_up_proj, its TP shards and padded
vocab are its own doing). A refused version changes nothing.

Digests: a tensor a worker holds whole is checked there; a TP-sharded one as the sum of the
workers' partial digests (each element counted by its lowest rank), one collective per apply.

On CPU, vLLM repacks every linear weight for its GEMM kernels and drops the weight
(`dispatch_cpu_unquantized_gemm(remove_weight=True)`). Importing this module (vLLM does in each
worker before the model loads) makes it keep the weights; after an apply the layers whose
weights changed are repacked (`repack_s`). Arguments may come as strings (/collective_rpc's).

Served through HTTP (VLLM_SERVER_DEV_MODE), anyone who reaches the dev-mode port can call these
methods, so the store and folders they name are pinned (integrations/vllm_pins.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load, load_file

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.codec.checkpoint import Checkpoint
from nemo_dcr_callback.integrations.vllm_pins import (  # noqa: F401 - re-exported: the checks' old home
    _dev_mode,
    check_model_dir,
    check_reload_allowed,
    check_store_allowed,
    served_dir,
)
from nemo_dcr_callback.integrations.vllm_serve import EXT, SERVED_DIR_ENV, STORE_DOWN
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.records import read_limit
from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.receiver.background import BackgroundFollower
from nemo_dcr_callback.receiver.targets.loader import LoaderTarget
from nemo_dcr_callback.transport.store import open_store

_KEEP = "_dcr_keeps_cpu_weights"
BACKEND = "dcr"  # the name of the weight-transfer backend (integrations/vllm_transfer.py)


def _follows_dcr() -> bool:
    """Is the engine being loaded one that follows a DCR store (the `dcr` weight-transfer
    backend or this worker extension)? The `vllm.general_plugins` entry point imports this
    module into every vLLM process of a machine where nemo-dcr is installed; only those engines
    keep their weights beside the packed ones (the memory it costs)."""
    try:
        from vllm.config import get_current_vllm_config_or_none  # optional: vllm is only in .venv-vllm
    except ImportError:
        return True
    cfg = get_current_vllm_config_or_none()
    if cfg is None:  # loaded outside vLLM's config context: keep (what an update needs)
        return True
    wt = cfg.weight_transfer_config
    return (wt is not None and wt.backend == BACKEND) or cfg.parallel_config.worker_extension_cls == EXT


def _keep_cpu_weights() -> None:
    """Make vLLM's CPU GEMM dispatch keep each linear's weight (idempotent)."""
    try:
        from vllm.model_executor.layers import utils  # optional: vllm is only in .venv-vllm
    except ImportError:  # not inside vLLM (docs, tests of the rest of the package)
        return
    if getattr(utils, _KEEP, False):
        return
    orig = utils.dispatch_cpu_unquantized_gemm

    def keep(layer, remove_weight: bool) -> None:
        if _follows_dcr():
            _dispatch_keeping(orig, layer)
        else:
            orig(layer, remove_weight=remove_weight)

    utils.dispatch_cpu_unquantized_gemm = keep
    utils._dcr_dispatch = orig
    setattr(utils, _KEEP, True)


def _dispatch_keeping(orig, layer) -> None:
    """vLLM's CPU GEMM dispatch for `layer`, keeping its weight, and its bias in the loaded
    dtype and storage. On CPUs with AMX, small layers go to a kernel that wants an fp32
    bias, and the dispatch swaps the bias Parameter's data for a widened copy: the loader
    would then convert into it (not a plain copy) and an apply's in-place writes would land
    in storage nobody reads. The Parameter keeps its storage; the kernel gets the fp32 copy,
    made again at each repack."""
    bias = getattr(layer, "bias", None)
    held = bias.data if isinstance(bias, torch.Tensor) else None
    orig(layer, remove_weight=False)
    bias = getattr(layer, "bias", None)
    if held is None or not isinstance(bias, torch.Tensor) or bias.dtype == held.dtype:
        return
    wide = bias.data
    bias.data = held  # widened from these bits, so nothing is lost
    fn = layer.cpu_linear
    layer.cpu_linear = lambda x, weight, _bias, _fn=fn, _wide=wide: _fn(x, weight, _wide)


_EXPERTS = ("w13_weight", "w2_weight")


def _keep_raw_experts() -> None:
    """vLLM's CPU MoE pads and prepacks each layer's w13/w2 for its grouped GEMM after loading,
    and registers the packed tensors under the same names: its loader would then write
    checkpoint rows into the packed layout. Keep the loader-layout tensors (the Parameters the
    loader filled; memory for the experts doubles, as for the kept linear weights) so that
    updates go there and the layer is packed again afterwards (idempotent)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe  # optional: vllm, CPU builds only
    except ImportError:
        return
    cls = cpu_moe.CPUUnquantizedExperts
    if getattr(cls, _KEEP, False):
        return
    orig = cls.process_weights_after_loading

    def keep(self, layer) -> None:
        if not _follows_dcr():
            return orig(self, layer)
        raw = {n: getattr(layer, n) for n in _EXPERTS}
        orig(self, layer)
        if getattr(self, "_use_zentorch", False) or getattr(layer, "w13_bias", None) is not None:
            return  # (zentorch keeps its own layout; biased experts are padded through .data: not kept)
        layer._dcr_raw = raw
        layer._dcr_pack = lambda: _pack_again(self, orig, layer)

    cls.process_weights_after_loading = keep
    setattr(cls, _KEEP, True)


def _pack_again(experts, orig, layer) -> None:
    """Run vLLM's own padding and prepacking on the loader-layout weights, into the packed
    tensors the kernel holds."""
    packed = {n: getattr(layer, n) for n in _EXPERTS}
    for n in _EXPERTS:
        layer.register_parameter(n, torch.nn.Parameter(layer._dcr_raw[n].detach().clone(), requires_grad=False))
    orig(experts, layer)
    for n in _EXPERTS:
        packed[n].data.copy_(getattr(layer, n).data)
        layer.register_parameter(n, packed[n])


class _LoaderLayout:
    """Within it, layers whose experts vLLM prepacked show the loader their loader-layout
    weights (what load_weights writes and the digests read)."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [m for m in model.modules() if hasattr(m, "_dcr_raw")]
        self.depth = 0  # (re-entered by the loader calls made inside it: only the outermost swaps)

    def __enter__(self):
        self.depth += 1
        if self.depth == 1:
            self.saved = [{n: getattr(m, n) for n in _EXPERTS} for m in self.layers]
            for m in self.layers:
                for n in _EXPERTS:
                    m.register_parameter(n, m._dcr_raw[n])

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:
            for m, saved in zip(self.layers, self.saved, strict=True):
                for n in _EXPERTS:
                    m.register_parameter(n, saved[n])


def _expert_layers(layout: _LoaderLayout) -> dict[int, torch.nn.Module]:
    """Layers whose experts vLLM prepacked, by their loader-layout weights' storages."""
    return {m._dcr_raw[n].untyped_storage().data_ptr(): m for m in layout.layers for n in _EXPERTS}


_keep_cpu_weights()
_keep_raw_experts()


def _checkpoint_shapes(model_dir: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Canonical (Hugging Face) names, shapes and dtypes, from the checkpoint's headers."""
    ck = Checkpoint(model_dir)
    return {n: (torch.Size(ck.entry(n).shape), codec.dtype_info(ck.entry(n).dtype).torch) for n in ck.where}


def _store_digests(store, version: int) -> bool:
    """Does the store hold the digests of `version` (its record, or its keyframe's)?"""
    return commit.version_digests(store, version) is not None


def _check_against(target: LoaderTarget, model_dir: str) -> None:
    """The model, read back through its loader's copies, must hold the checkpoint it was loaded
    from. It does not where vLLM keeps a weight in a layout of its own after loading (its CPU
    MoE prepacks the experts for its grouped GEMM): the loader would then write checkpoint rows
    into that layout, so such an engine is refused before anything is applied."""
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                held = target.digest_of(name) if name in target.shapes else None
                if held is not None and held != digest.sum64(st.get_tensor(name)):
                    raise ValueError(f"vLLM does not hold {name!r} as its loader wrote it (a layout of its own "
                                     f"after loading, e.g. the CPU backend's prepacked MoE experts): the weights "
                                     f"cannot be updated in place through its loader")


def _flag(x: bool | str) -> bool:
    return x if isinstance(x, bool) else str(x).lower() in ("1", "true", "yes")


class _Group:
    """Sums over a process group (gloo, on the engine's thread only) for the digests."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world

    def sum64(self, values: list[int]) -> list[int]:
        """Per entry, the sum mod 2^64 over the group (in 32-bit halves: no overflow)."""
        t = torch.tensor([[v & 0xFFFFFFFF, v >> 32] for v in values], dtype=torch.int64).reshape(-1, 2)
        dist.all_reduce(t, group=self.group)
        return [(int(lo) + (int(hi) << 32)) & digest.MASK for lo, hi in t.tolist()]

    def max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)

    def union(self, names: set[str]) -> set[str]:
        out: list = [None] * self.world
        dist.all_gather_object(out, sorted(names), group=self.group)
        return set().union(*out)

    def owned(self, held: torch.Tensor) -> torch.Tensor:
        """Of the elements this rank holds, those no lower rank holds."""
        first = torch.where(held, self.rank, self.world).to(torch.int32)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.group)
        return first == self.rank


class ShardedLoaderTarget(LoaderTarget):
    """A LoaderTarget whose model may hold tensors in part (tensor parallelism): the digests of
    those tensors are summed over the group (each worker runs the same applies, in order)."""

    def __init__(self, model, load_fn, shapes, group: _Group | None = None, **kwargs):
        super().__init__(model, load_fn, shapes, **kwargs)
        self.group = group
        self.summed: list[str] = []  # tensors some rank holds in part, digested over the group
        self._owned: dict[str, torch.Tensor] = {}
        self._summed_digest: dict[str, int] = {}
        if group is not None and group.world > 1:
            local = {n for n in self._views if n not in self._whole}
            self.summed = sorted(group.union(local))
            for n in self.summed:  # (every rank, the same order)
                self._owned[n] = group.owned(self.held(n))
            self.refresh()

    def refresh(self) -> None:
        """Take the summed digests afresh (a collective: every rank calls it), e.g. after
        weights were loaded by other means."""
        if self.summed:
            digests = self.group.sum64([self.partial_digest(n, self._owned[n]) for n in self.summed])
            self._summed_digest = dict(zip(self.summed, digests, strict=True))

    def digest_of(self, name: str) -> int | None:
        if name in self._summed_digest:
            return self._summed_digest[name]
        return super().digest_of(name)

    def apply_with_terms(self, decoded):
        terms = super().apply_with_terms(decoded)
        names = sorted({d.header.name for d in decoded} & set(self.summed))
        if names:
            after = self.group.sum64([self.partial_digest(n, self._owned[n]) for n in names])
            for n, a in zip(names, after, strict=True):
                terms[n] = (self._summed_digest[n], a)
                self._summed_digest[n] = a
        return terms


def tp_group() -> _Group | None:
    """This worker's tensor-parallel group, for the digests of sharded tensors (None: whole)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group  # optional: vllm is only in .venv-vllm
    except ImportError:
        return None
    tp = get_tp_group()
    return _Group(tp.cpu_group, tp.rank_in_group, tp.world_size) if tp.world_size > 1 else None


class EngineWeights:
    """One vLLM worker's model as a DCR receiver: what the worker extension and the `dcr`
    weight-transfer backend (integrations/vllm_transfer.py) share. `attach` checks the held
    weights against a version's digests and starts the background follower; `update` applies,
    at a step boundary, what it readied; `reload_dense` loads a whole checkpoint in place."""

    def __init__(self, model: torch.nn.Module, model_dir: str, group: _Group | None):
        self.model, self.model_dir, self.group = model, model_dir, group
        self.layout = _LoaderLayout(model)
        self.layers = _linear_layers(model)
        self.moe = _expert_layers(self.layout)
        self.target: ShardedLoaderTarget | None = None
        self.follower: BackgroundFollower | None = None
        self._args: tuple | None = None

    def _load(self, items):
        with self.layout:
            return self.model.load_weights(items)

    def attach(self, store_url: str, receiver_id: str | None = None, version: int = 0,
               idle_poll_s: float = 0.2, strict: bool = False) -> int:
        """Follow store_url from `version` (the version the engine holds): the weights are
        checked against its digests (or, unless strict, the checkpoint's own bits when the
        store has none: a store that starts empty), then a background thread readies the next
        versions. With tensor parallelism only the first rank registers and acks (one engine,
        one receiver)."""
        self.detach()
        with self.layout:  # (the loader's copies are learned into the loader-layout experts)
            target = ShardedLoaderTarget(self.model, self._load, _checkpoint_shapes(self.model_dir), self.group)
        refused = sorted(n for n, ok in target.plain.items() if not ok)
        if refused:
            raise ValueError(f"vLLM's loader does not copy {refused[0]!r} (and {len(refused) - 1} more) as a plain "
                             f"copy: these cannot be updated in place")
        store = open_store(store_url)
        if not _store_digests(store, version):  # nothing in the store to check the weights against
            if strict:
                raise ValueError(f"{store.url} holds no version {version} (no record, no keyframe): a wrong store, "
                                 f"or a version its trainer has not published")
            _check_against(target, self.model_dir)
        self.target = target
        receiver_id = receiver_id or None  # ("" over HTTP)
        self._args = (store, receiver_id if self.group is None or self.group.rank == 0 else None, idle_poll_s)
        self._follow(version)
        return version

    def _follow(self, version: int) -> None:
        store, rid, idle = self._args
        self.follower = BackgroundFollower(store, self.target, version, receiver_id=rid, idle_poll_s=idle)

    @property
    def store(self):
        return self._args[0] if self._args else None

    @property
    def version(self) -> int:
        return self.follower.version if self.follower is not None else -1

    def detach(self) -> None:
        """Stop following (the weights stay as they are)."""
        if self.follower is not None:
            self.follower.stop()
            self.follower = None

    def update(self, until: int | None = None, wait: bool = True, timeout: float = 600.0) -> dict:
        """Apply the versions readied in the background: with wait every version sealed now
        (or up to `until`) once it is decided, else only what is ready. Returns the version
        held, the versions applied, the pause (load_s: the applies; repack_s: CPU only), the
        background's fetch+verify+decode time and why a version was refused."""
        bf = self.follower
        if bf is None:
            raise RuntimeError("no store attached: attach (dcr_attach, init_weight_transfer_engine) first")
        if self.group is not None:  # every rank applies the same versions (the digests' sums)
            if wait:  # what any rank waits for, all do
                until = self.group.max(until if until is not None else bf.sealed_after(bf.version))
            else:  # what every rank has ready
                until = -self.group.max(-bf.ready_version())
            wait = True
        t0 = time.perf_counter()
        up = bf.apply_ready(until=until, wait=wait, timeout=timeout)
        repack_s = self.repack(up.changed) if up.applied else 0.0
        return {"version": up.version, "applied": up.applied, "load_s": up.load_s, "repack_s": repack_s,
                "pause_s": up.load_s + repack_s, "fetch_decode_s": up.fetch_s,
                "call_s": time.perf_counter() - t0, "refused": up.refused}

    def reload_dense(self, model_dir: str, version: int) -> dict:
        """Load every weight of a dense checkpoint in place through load_weights (a resync, e.g.
        from a keyframe after the chain broke, and the benchmark's comparison); a follower then
        goes on from `version`, the weights checked against its digests first (refused: the
        engine follows nothing until a resync is accepted)."""
        following = self._args is not None  # attached once: follow on (also after a refused resync)
        self.detach()
        t0 = time.perf_counter()
        weights = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            weights.update(load_file(str(f)))
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            self._load(iter(sorted(weights.items())))
        load_s = time.perf_counter() - t0
        repack_s = self.repack(None)
        if following:
            self.target.refresh()
            self._follow(int(version))
        return {"read_s": read_s, "load_s": load_s, "repack_s": repack_s}

    def check_export(self, version: int) -> dict:
        """The oracle for a version held: its dense export in the store (the trainer's gather
        and convert, written with dcr.verify) against the weights this engine holds, read back
        in canonical coordinates through the loader's copies (LoaderTarget.compare)."""
        if self.follower is None or self.version != version:
            raise RuntimeError(f"the engine holds version {self.version}, not {version}")
        if not self.store.exists(key := commit.verify_key(version)):
            raise FileNotFoundError(f"{self.store.url} has no dense export of version {version} ({key}): the "
                                    "trainer writes them with dcr.verify=true")
        return {"version": version, **self.target.compare(load(self.store.get(key, limit=read_limit(key))))}

    def repack(self, names: set[str] | None) -> float:
        """CPU only: rebuild the packed GEMM weights of the layers the apply wrote (names: the
        canonical tensors changed; None: every layer), linear layers and prepacked experts."""
        if not self.layers and not self.moe:
            return 0.0
        layers, experts = list(self.layers.values()), list({id(m): m for m in self.moe.values()}.values())
        if names is not None:
            keys = self.target.destinations(names)
            layers = [m for k, m in self.layers.items() if k in keys]
            experts = list({id(m): m for k, m in self.moe.items() if k in keys}.values())
        t0 = time.perf_counter()
        if layers:
            from vllm.model_executor.layers import utils  # optional: vllm is only in .venv-vllm

            for m in layers:
                _dispatch_keeping(utils._dcr_dispatch, m)
        with torch.no_grad():
            for m in experts:
                m._dcr_pack()
        return time.perf_counter() - t0


def _linear_layers(model) -> dict[int, torch.nn.Module]:
    """Modules whose weights vLLM's CPU dispatch packed, by their weight's storage."""
    return {p.untyped_storage().data_ptr(): m for m in model.modules()
            if hasattr(m, "cpu_linear") and isinstance(getattr(m, "weight", None), torch.Tensor)
            for p in [m.weight]}


def _served_model(worker) -> str | None:
    """A worker's model, read only where NEMO_DCR_VLLM_MODEL_DIR does not name the folder."""
    return None if os.environ.get(SERVED_DIR_ENV) is not None else worker.model_runner.model_config.model


class DCRWorkerExtension:
    """Methods vLLM adds to its Worker (self.model_runner.model is the live model)."""

    def _dcr_weights(self, model_dir: str | None = None) -> EngineWeights:
        model_dir = model_dir or self.model_runner.model_config.model
        w = getattr(self, "_dcr_w", None)
        if w is None or w.model_dir != model_dir:
            if w is not None:
                w.detach()
            w = self._dcr_w = EngineWeights(self.model_runner.model, model_dir, tp_group())
        return w

    def dcr_attach(self, store_url: str, receiver_id: str | None = None, version: int | str = 0,
                   model_dir: str | None = None, idle_poll_s: float | str = 0.2) -> int:
        """Follow store_url from `version` (the version the engine was loaded with; see
        EngineWeights.attach). A relay's token is read from NEMO_DCR_RELAY_TOKEN in the
        engine's environment, never passed."""
        check_store_allowed(store_url)  # before anything changes: the engine goes on as it was
        model_dir = check_model_dir(model_dir, _served_model(self)) if model_dir else None
        try:
            return self._dcr_weights(model_dir).attach(store_url, receiver_id, int(version), float(idle_poll_s))
        except StoreError as exc:  # named, so that a caller can tell it from a refusal and retry
            raise RuntimeError(f"{STORE_DOWN}: {exc}") from exc

    def dcr_detach(self) -> None:
        """Stop following (the weights stay as they are)."""
        if getattr(self, "_dcr_w", None) is not None:
            self._dcr_w.detach()

    def dcr_update(self, until: int | str | None = None, wait: bool | str = True,
                   timeout: float | str = 600.0) -> dict:
        """EngineWeights.update, arguments as vLLM's HTTP /collective_rpc passes them."""
        w = getattr(self, "_dcr_w", None)
        if w is None or w.follower is None:
            raise RuntimeError("dcr_update before dcr_attach")
        until = None if until in (None, "", "None") else int(until)
        return w.update(until=until, wait=_flag(wait), timeout=float(timeout))

    def dcr_reload_dense(self, model_dir: str, version: int | str) -> dict:
        """EngineWeights.reload_dense, from the served model's folder only."""
        check_reload_allowed(model_dir, _served_model(self) if _dev_mode() else None)
        w = getattr(self, "_dcr_w", None) or self._dcr_weights()
        return w.reload_dense(model_dir, int(version))

    def dcr_check_export(self, version: int | str) -> dict:
        """EngineWeights.check_export: the held version against its dense export in the store."""
        return self._dcr_weights().check_export(int(version))

    def dcr_version(self) -> int:
        w = getattr(self, "_dcr_w", None)
        return w.version if w is not None else -1

    def dcr_params(self) -> dict[str, bytes]:
        """Every parameter's raw bytes, in vLLM's own (fused, sharded) layout: for checks."""
        return {n: p.detach().contiguous().view(torch.uint8).numpy().tobytes()
                for n, p in self.model_runner.model.named_parameters()}

    def dcr_param_digests(self) -> dict[str, str]:
        """Every parameter's digest (hex), in vLLM's layout: the same check over HTTP (`vllm
        serve`'s /collective_rpc answers JSON)."""
        return {n: digest.hexd(digest.sum64(p.detach())) for n, p in self.model_runner.model.named_parameters()}
