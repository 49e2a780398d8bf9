"""CPU run mode for megatron-core (gloo), for tests, demos and benchmarks without a GPU.

megatron-core assumes CUDA in a handful of places (see ../shared/DESIGN.md): tensors created
with device="cuda" or torch.cuda.current_device(), the CUDA RNG tracker, param.type()
strings such as 'torch.cuda.BFloat16Tensor', torch.cuda.synchronize/empty_cache, and
collectives gloo lacks (reduce_scatter_tensor). `enable()` patches exactly those so that
model construction, forward/backward, the pipeline schedule, DDP and the (distributed)
optimizer run on CPU. It refuses to run where CUDA is available: there the real path runs
untouched.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

_enabled = False


def _cpu_device(dev):
    if dev is None:
        return None
    if isinstance(dev, int):
        return torch.device("cpu")
    if isinstance(dev, str) and dev.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    return dev


def _redirect(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper._dcr_cpu_shim = True  # type: ignore[attr-defined]
    return wrapper


_FACTORIES = ["empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "randint",
              "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor", "linspace", "eye",
              "empty_strided"]
_CUDA_TYPES = {"torch.HalfTensor": "torch.cuda.HalfTensor", "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
               "torch.FloatTensor": "torch.cuda.FloatTensor"}


def _reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """gloo has no reduce_scatter_tensor: all_reduce a copy and keep this rank's slice."""
    buf = input.clone()
    dist.all_reduce(buf, op=op, group=group)
    rank = dist.get_rank(group)
    n = output.numel()
    output.copy_(buf.reshape(-1)[rank * n:(rank + 1) * n].view_as(output))
    if async_op:
        return _Done()
    return None


class _Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


def _all_gather_into_tensor(output, input, group=None, async_op=False):
    parts = list(output.reshape(-1).chunk(dist.get_world_size(group)))
    bufs = [torch.empty_like(input.reshape(-1)) for _ in parts]
    dist.all_gather(bufs, input.reshape(-1).contiguous(), group=group)
    for p, b in zip(parts, bufs, strict=True):
        p.copy_(b)
    return _Done() if async_op else None


def enable() -> None:
    """Install the CPU shims (idempotent). Raises if CUDA is available."""
    global _enabled
    if _enabled:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu is for machines without CUDA; use the real path here")
    for name in _FACTORIES:
        setattr(torch, name, _redirect(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    _orig_to = torch.Tensor.to

    def _to(self, *args, **kwargs):
        args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return _orig_to(self, *args, **kwargs)

    torch.Tensor.to = _to  # type: ignore[method-assign]
    _orig_type = torch.Tensor.type

    def _type(self, *args, **kwargs):  # DistributedOptimizer checks 'torch.cuda.*Tensor' strings
        out = _orig_type(self, *args, **kwargs)
        return _CUDA_TYPES.get(out, out) if not args and not kwargs else out

    torch.Tensor.type = _type  # type: ignore[method-assign]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.device_count = lambda: 0  # type: ignore[assignment]
    dist.reduce_scatter_tensor = _reduce_scatter_tensor  # type: ignore[assignment]
    dist.all_gather_into_tensor = _all_gather_into_tensor  # type: ignore[assignment]
    dist._reduce_scatter_base = _reduce_scatter_tensor  # type: ignore[attr-defined]
    dist._all_gather_base = _all_gather_into_tensor  # type: ignore[attr-defined]

    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # type: ignore
    mrandom._set_cuda_rng_state = lambda *a, **k: None  # type: ignore[attr-defined]

    from megatron.core.transformer import utils as tutils

    def _causal_mask(sq, *_a, **_k):
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    for name in ("get_default_causal_mask",):
        if hasattr(tutils, name):
            setattr(tutils, name, functools.lru_cache(maxsize=None)(_causal_mask))
    _moe_and_mla()
    _enabled = True


def _moe_and_mla() -> None:
    """Mixtures of experts and MLA without Transformer Engine (megatron-core 0.16.1):
    - the router tests `te_general_gemm is not None`, a name defined only when TE imports;
    - MLA takes TE for present when TE's names import (as placeholders): HAVE_TE is set False;
    - MoE with TP trains only with sequence parallelism, which the local spec's torch norms
      refuse: they are built as without it, their weights marked sequence-parallel so that
      their gradients are all-reduced over TP (what TE's norms do)."""
    import copy

    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    try:
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False
    except ImportError:
        pass
    orig = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args, **kwargs):
        sp = config.sequence_parallel
        if sp:
            config = copy.copy(config)
            config.sequence_parallel = False
        mod = orig(cls, config, hidden_size, *args, **kwargs)
        for p in mod.parameters():
            p.sequence_parallel = sp
        return mod

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


class SDPACoreAttention(torch.nn.Module):
    """Core attention for MLA under the local spec (megatron-core's DotProductAttention takes
    no k_channels/v_channels): causal scaled-dot-product attention on [s, b, h, d]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None, softmax_scale=None,
                 k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__()
        self.config, self.softmax_scale = config, softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:
            r = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return o.permute(2, 0, 1, 3).reshape(o.shape[2], o.shape[0], -1)


def seed(value: int) -> None:
    """model_parallel_cuda_manual_seed asserts CUDA; on CPU one torch seed serves all ranks
    (use_cpu_initialization builds every master weight identically, then splits it)."""
    torch.manual_seed(value)


def is_enabled() -> bool:
    return _enabled


def init_gloo(tp: int, pp: int = 1, timeout_s: float = 300.0) -> int:
    """A torchrun worker's set-up on CPU: this run mode, a gloo process group, Megatron's
    model-parallel groups. Returns the rank."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    enable()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    ps.initialize_model_parallel(tp, pp)
    return dist.get_rank()


def exit_worker(rc: int) -> None:
    """End a torchrun worker with exit status rc, its process group destroyed first: gloo's
    threads still up while the interpreter exits abort the process now and then ("terminate
    called without an active exception"), after the work itself has passed."""
    import sys

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(rc)


# BF16 GEMMs on a CPU without AVX-512 (AVX2-only x86: AMD Zen 2/3, older Intel): oneDNN's
# bf16 kernels need AVX-512, and torch falls back to a scalar loop (0.9 GFLOP/s measured on a
# 2-core AMD EPYC with AVX2, against 119 GFLOP/s in fp32), which turns a 0.6 s demo step into
# 19 s. There the training step runs its matrix products in fp32 on bf16-exact inputs and
# rounds the result to bf16: the accumulation is fp32 either way, so only the summation order
# differs from a native bf16 GEMM. The weights, their dtype and what the callback publishes are
# unchanged.
BF16_GEMM_ENV = "NEMO_DCR_CPU_BF16_GEMM"  # auto (default) | fp32 | native


def bf16_gemm_via_fp32() -> bool:
    """Whether this CPU's bf16 GEMMs go through fp32 (the env var overrides the detection)."""
    import os
    import platform

    choice = os.environ.get(BF16_GEMM_ENV, "auto").lower()
    if choice not in ("auto", "fp32", "native"):
        raise ValueError(f"{BF16_GEMM_ENV}={choice!r}: expected auto, fp32 or native")
    if choice != "auto":
        return choice == "fp32"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return torch.backends.cpu.get_cpu_capability() != "AVX512"  # public since torch 2.1


# The torch-level GEMM entry points megatron-core's layers, its attention and their backward
# call (torch.matmul, Tensor.matmul, torch.baddbmm, torch.bmm, ...). Only GEMM calls pay for
# the wrapper; a TorchDispatchMode would see every op instead, about 20 us each here (a 1-rank
# step of TinyGPTConfig's default model: 123 ms with one, 43 ms with these wrappers; ad hoc).
# Casts outside the GEMM are autograd ops, so the backward of a wrapped product runs in fp32
# too.
_GEMM_FNS = [(torch, "matmul"), (torch, "mm"), (torch, "bmm"), (torch, "baddbmm"), (torch, "addmm"),
             (torch.Tensor, "matmul"), (torch.Tensor, "__matmul__"), (torch.Tensor, "mm"), (torch.Tensor, "bmm"),
             (torch.nn.functional, "linear")]
_gemm_depth = 0
_gemm_saved: list = []
_gemm_products = 0  # products computed through fp32 in this process (the first step reports it)


def fp32_gemm_products() -> int:
    """How many bf16 products this process has computed through fp32 so far: the proof that the
    mode reached the model's own layers (a native bf16 GEMM may give the same bits)."""
    return _gemm_products


def _via_fp32(fn):
    bf16 = torch.bfloat16

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ts = [a for a in args if isinstance(a, torch.Tensor)]
        if "out" in kwargs or not ts or any(t.dtype is not bf16 or t.device.type != "cpu" for t in ts):
            return fn(*args, **kwargs)  # only all-bf16 CPU products: anything else as torch does it
        global _gemm_products
        _gemm_products += 1
        return fn(*[a.float() if isinstance(a, torch.Tensor) else a for a in args], **kwargs).to(bf16)

    return wrapper


@contextlib.contextmanager
def _fp32_gemms():
    global _gemm_depth
    if _gemm_depth == 0:
        _gemm_saved[:] = [(owner, name, getattr(owner, name)) for owner, name in _GEMM_FNS]
        for owner, name, fn in _gemm_saved:
            setattr(owner, name, _via_fp32(fn))
    _gemm_depth += 1
    try:
        yield
    finally:
        _gemm_depth -= 1
        if _gemm_depth == 0:
            for owner, name, fn in _gemm_saved:
                setattr(owner, name, fn)


def gemm_mode():
    """Context for a training step: bf16 CPU GEMMs through fp32 where `bf16_gemm_via_fp32()`,
    else nothing."""
    if torch.cuda.is_available() or not bf16_gemm_via_fp32():
        return contextlib.nullcontext()
    return _fp32_gemms()
