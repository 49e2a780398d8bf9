"""bench vllm --backend --deltas adamw: Adam-like versions of fp32 masters, calibrated to a
change rate, in which a value changes the more likely the smaller it is (what context coding
exploits; the uniform one-ulp versions have no such dependence)."""

from __future__ import annotations

import torch

from nemo_dcr_callback.bench.vllm import _adam_like


def test_adam_like_versions_hit_the_rate_and_move_small_values_more():
    g = torch.Generator().manual_seed(0)
    masters = {"w": torch.randn(1 << 18, generator=g) * torch.logspace(-3, 0, 1 << 18)}
    old = masters["w"].to(torch.bfloat16)
    new = _adam_like(masters, 0.03, seed=1)["w"]
    moved = new != old
    assert 0.02 < float(moved.float().mean()) < 0.04
    small = old.float().abs() < old.float().abs().median()
    assert float(moved[small].float().mean()) > 3 * float(moved[~small].float().mean())
