"""The CPU run mode's bf16 GEMMs through fp32 (megatron_cpu.gemm_mode): same dtype flow and
the bits of an fp32 GEMM rounded to bf16, forward and backward; the switch's env var."""

import contextlib

import pytest
import torch

from nemo_dcr_callback.recipes import megatron_cpu


def _linear_and_grads(ctx):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 40, generator=g).bfloat16().requires_grad_()
    w = torch.randn(56, 40, generator=g).bfloat16().requires_grad_()
    q = torch.randn(3, 8, 16, generator=g).bfloat16()
    with ctx:
        y = torch.nn.functional.linear(x, w)
        y.float().square().sum().backward()
        s = torch.baddbmm(torch.zeros(3, 8, 8, dtype=torch.bfloat16), q, q.transpose(1, 2))
    return x, w, y, s


def test_fp32_gemm_mode_matches_an_fp32_gemm_rounded_to_bf16(monkeypatch):
    monkeypatch.setenv(megatron_cpu.BF16_GEMM_ENV, "fp32")
    x, w, y, s = _linear_and_grads(megatron_cpu.gemm_mode())
    assert y.dtype == s.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    # The oracle: the same products computed in fp32 outside the mode, then rounded.
    xf, wf = x.detach().float(), w.detach().float()
    assert torch.equal(y, (xf @ wf.T).bfloat16())
    dy = (2 * y.float()).bfloat16().float()  # d/dy of sum(y^2), rounded as autograd does in bf16
    assert torch.equal(x.grad, (dy @ wf).bfloat16())
    assert torch.equal(w.grad, (dy.T @ xf).bfloat16())
    # Within bf16 rounding of the native bf16 kernels (both accumulate in fp32).
    _, _, y_native, s_native = _linear_and_grads(contextlib.nullcontext())
    assert torch.allclose(y.float(), y_native.float(), rtol=2 ** -7, atol=1e-2)
    assert torch.allclose(s.float(), s_native.float(), rtol=2 ** -7, atol=1e-2)


def test_products_are_counted(monkeypatch):
    monkeypatch.setenv(megatron_cpu.BF16_GEMM_ENV, "fp32")
    n0 = megatron_cpu.fp32_gemm_products()
    _linear_and_grads(megatron_cpu.gemm_mode())  # linear (forward, both grads via matmul/mm) and baddbmm
    assert megatron_cpu.fp32_gemm_products() - n0 >= 2
    n1 = megatron_cpu.fp32_gemm_products()
    with megatron_cpu.gemm_mode():
        torch.ones(2, 3) @ torch.ones(3, 2)  # fp32: torch's own, not counted
    _linear_and_grads(contextlib.nullcontext())  # outside the mode: not counted
    assert megatron_cpu.fp32_gemm_products() == n1


def test_env_switch(monkeypatch):
    monkeypatch.setenv(megatron_cpu.BF16_GEMM_ENV, "native")
    assert not megatron_cpu.bf16_gemm_via_fp32()
    monkeypatch.setenv(megatron_cpu.BF16_GEMM_ENV, "fp32")
    assert megatron_cpu.bf16_gemm_via_fp32()
    monkeypatch.setenv(megatron_cpu.BF16_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="NEMO_DCR_CPU_BF16_GEMM='fast'"):
        megatron_cpu.bf16_gemm_via_fp32()


def test_gemm_mode_puts_torch_back(monkeypatch):
    monkeypatch.setenv(megatron_cpu.BF16_GEMM_ENV, "fp32")
    before = (torch.matmul, torch.Tensor.matmul, torch.nn.functional.linear)
    with megatron_cpu.gemm_mode():
        with megatron_cpu.gemm_mode():
            assert torch.matmul is not before[0]
        assert torch.matmul is not before[0]  # the outer context still holds
        a = torch.ones(2, 3)  # fp32 products are torch's own
        assert torch.equal(a @ a.T, torch.full((2, 2), 3.0))
    assert (torch.matmul, torch.Tensor.matmul, torch.nn.functional.linear) == before
