"""bench/refit.py's interleaving: a uniform control version between two AdamW-like ones must
leave the next AdamW-like delta that step's alone (the run itself needs root: `make bench-refit`)."""

from __future__ import annotations

import torch

from nemo_dcr_callback.bench.fp8 import ulp_step
from nemo_dcr_callback.bench.refit import absorb
from nemo_dcr_callback.recipes import synthetic


def _changed(a: dict, b: dict) -> float:
    n = sum(int((a[k].view(torch.int16) != b[k].view(torch.int16)).sum()) for k in a)
    return n / sum(t.numel() for t in a.values())


def test_a_uniform_version_between_adamw_steps_leaves_their_rate_alone():
    policy = synthetic.make_policy(1 << 20, seed=0)
    lr = policy.lr_for_rate(0.03)
    prev = policy.bf16()
    policy.step(lr)
    cur = policy.bf16()
    alone = _changed(prev, cur)
    uniform = ulp_step(cur, 0.03, seed=1)
    absorb(policy, cur, uniform)
    assert all(torch.equal(v.view(torch.int16), uniform[k].view(torch.int16)) for k, v in policy.bf16().items())
    policy.step(lr)
    after = _changed(uniform, policy.bf16())
    assert abs(after - alone) < 0.1 * alone, (alone, after)  # without absorb: about alone + 0.03 (undoing)
