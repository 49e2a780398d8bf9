"""Additive digests: the compiled kernels against the numpy reference (the oracle), and the
properties the protocol relies on (slices add up, updates from changes alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.core.rawbits import OP_OVERWRITE, OP_XOR


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float64])
def test_compiled_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1_100_001, generator=g) * 50).to(dtype)  # > 2^20: the threaded path too
    assert digest.sum64(x) == digest.sum64_reference(x)
    assert digest.sum64(x, base=12345) == digest.sum64_reference(x, base=12345)
    pos = np.sort(np.random.default_rng(1).choice(x.numel(), 300_000, replace=False)).astype(np.int64)
    p = torch.from_numpy(pos)
    ref = digest.sum64_reference(x[p], pos)
    assert digest.sum64(x[p], pos) == ref
    assert digest.sum64_at(x, p) == ref and digest.sum64_at(x, p.int()) == ref


def test_slices_add_up_and_updates_follow_changes():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10_000, generator=g).bfloat16()
    whole = digest.sum64_reference(x)
    assert (digest.sum64(x[:3000]) + digest.sum64(x[3000:], base=3000)) & digest.MASK == whole
    y = x.clone()
    pos = torch.tensor([3, 77, 9000], dtype=torch.int64)
    y[pos] = torch.tensor([1.0, -2.0, 3.5]).bfloat16()
    assert digest.update(whole, pos.numpy(), x[pos], y[pos]) == digest.sum64_reference(y)


@pytest.mark.parametrize("op", [OP_XOR, OP_OVERWRITE])
def test_scatter_terms_is_scatter_plus_before_and_after_terms(op):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50_000, generator=g).bfloat16()
    pos = torch.arange(5, 50_000, 97, dtype=torch.int32)
    vals = torch.randint(-30000, 30000, (pos.numel(),), generator=g, dtype=torch.int16).view(torch.bfloat16)
    p64 = pos.long()
    before_ref = digest.sum64_reference(x[p64], p64.numpy())
    expect = x.clone()
    if op == OP_XOR:
        expect.view(torch.int16)[p64] ^= vals.view(torch.int16)
    else:
        expect[p64] = vals
    before, after = digest.scatter_terms(x, pos, vals, op)
    assert torch.equal(x.view(torch.int16), expect.view(torch.int16))
    assert before == before_ref and after == digest.sum64_reference(expect[p64], p64.numpy())


def test_terms_of_a_part_held_apart_are_those_of_the_whole():
    """A part of a canonical tensor kept in a tensor of its own (a loader's row split): with
    its offset, sum64_at and scatter_terms hash canonical positions, so the terms and the
    writes are those of the whole tensor's (the numpy reference as oracle)."""
    g = torch.Generator().manual_seed(4)
    whole = torch.randn(40_000, generator=g).bfloat16()
    off = 12_345
    part = whole[off:].clone()
    pos = torch.arange(off + 3, 40_000, 61, dtype=torch.int32)
    vals = torch.randint(-30000, 30000, (pos.numel(),), generator=g, dtype=torch.int16)
    p64 = pos.long()
    assert digest.sum64_at(part, pos, offset=off) == digest.sum64_reference(whole[p64], p64.numpy())
    before, after = digest.scatter_terms(part, pos, vals, OP_XOR, offset=off)
    whole.view(torch.int16)[p64] ^= vals
    assert torch.equal(part.view(torch.int16), whole[off:].view(torch.int16))
    assert after == digest.sum64_reference(whole[p64], p64.numpy()) and before != after
    with pytest.raises((ValueError, IndexError)):
        digest.scatter_terms(part, torch.tensor([off - 1], dtype=torch.int32), vals[:1], OP_XOR, offset=off)
