"""The delta kernel: compiled == reference, baseline moves, undo restores, scatter refuses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_dcr_callback.core import bitops, delta
from nemo_dcr_callback.core.rawbits import bits
from tests.helpers.tensors import FLOAT_DTYPES, perturb, random_tensor

SHAPES = [(), (1,), (7,), (31,), (33, 3), (1, 1, 1), (257, 5), (2, 0)]
RATES = [0.0, "one", 0.01, 0.5, 1.0]


def _case(shape, dtype, rate, seed):
    g = torch.Generator().manual_seed(seed)
    old = random_tensor(shape, dtype, g)
    if rate == "one":
        new = old.clone()
        if new.numel():
            bits(new).view(-1)[new.numel() // 2] ^= 1
    else:
        new = perturb(old, rate, g, specials=True)
    return old, new


@given(shape=st.sampled_from(SHAPES), dtype=st.sampled_from(FLOAT_DTYPES + [torch.float64, torch.int8]),
       rate=st.sampled_from(RATES), seed=st.integers(0, 2**31), keep_new=st.booleans())
@settings(max_examples=150, deadline=None)
def test_compiled_equals_reference(shape, dtype, rate, seed, keep_new):
    old, new = _case(shape, dtype, rate, seed)
    b_ref, b_nat = old.clone(), old.clone()
    ref = delta.take_delta_reference(new, b_ref, keep_new=keep_new)
    nat = delta.take_delta(new, b_nat, keep_new=keep_new)
    assert torch.equal(ref.positions, nat.positions) and ref.positions.dtype == nat.positions.dtype
    assert torch.equal(ref.xor, nat.xor)
    assert torch.equal(bits(b_ref), bits(new)) and torch.equal(bits(b_nat), bits(new))
    if keep_new:
        assert torch.equal(ref.new, nat.new)
        assert torch.equal(nat.new, bits(new).reshape(-1)[nat.positions.long()])
    # The positions are exactly where the bits differ (independent check: elementwise compare).
    differs = (bits(old) != bits(new)).reshape(-1).nonzero().reshape(-1)
    assert torch.equal(nat.positions.long(), differs)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_multithreaded_large(dtype, threads):
    g = torch.Generator().manual_seed(threads)
    old = random_tensor((3 * (1 << 20) + 77,), dtype, g)
    new = perturb(old, 0.03, g, specials=True)
    b1, b2 = old.clone(), old.clone()
    ref = delta.take_delta_reference(new, b1)
    nat = delta.take_delta(new, b2, threads=threads)
    assert torch.equal(ref.positions, nat.positions) and torch.equal(ref.xor, nat.xor)
    assert torch.equal(bits(b2), bits(new))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("rate", [0.0, 0.03, 1.0])
def test_kernel_writes_into_caller_buffers(threads, rate):
    """The publisher's arena path: the kernel writes into given buffers (a shared-memory
    segment) and the delta views them; same output as the reference, and buffers that cannot
    hold the worst case are refused before anything is written."""
    g = torch.Generator().manual_seed(11)
    old = random_tensor(((1 << 20) + 4099,), torch.bfloat16, g)
    new = perturb(old, rate, g, specials=True)
    cap = delta.output_capacity(old.numel(), threads)
    arena = torch.zeros(cap * 8 + 64, dtype=torch.uint8)
    pos, val, nv = arena[:cap * 4].view(torch.int32), arena[cap * 4:cap * 6].view(torch.int16), \
        arena[cap * 6:cap * 8].view(torch.int16)
    b_ref, b_out = old.clone(), old.clone()
    with pytest.raises(ValueError, match="do not fit"):
        delta.take_delta(new, b_out, threads=threads, keep_new=True, out=(pos[:cap - 1], val, nv))
    assert torch.equal(bits(b_out), bits(old))  # refused: the baseline did not move
    ref = delta.take_delta_reference(new, b_ref, keep_new=True)
    d = delta.take_delta(new, b_out, threads=threads, keep_new=True, out=(pos, val, nv))
    assert d.count == 0 or (d.positions.data_ptr() == pos.data_ptr() and d.new.data_ptr() == nv.data_ptr())
    assert torch.equal(ref.positions, d.positions) and torch.equal(ref.xor, d.xor) and torch.equal(ref.new, d.new)
    assert torch.equal(bits(b_out), bits(new))
    delta.undo(b_out, d)
    assert torch.equal(bits(b_out), bits(old))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rate", [0.0, 0.03, 1.0])
def test_undo_restores_previous_baseline(dtype, rate):
    g = torch.Generator().manual_seed(7)
    old = random_tensor((4099,), dtype, g)
    new = perturb(old, rate, g, specials=True)
    base = old.clone()
    d = delta.take_delta(new, base)
    assert torch.equal(bits(base), bits(new))
    delta.undo(base, d)
    assert torch.equal(bits(base), bits(old))


def test_reference_path_undo(reference_only):
    g = torch.Generator().manual_seed(3)
    old = random_tensor((1000,), torch.bfloat16, g)
    new = perturb(old, 0.1, g)
    base = old.clone()
    d = delta.take_delta(new, base)
    delta.undo(base, d)
    assert torch.equal(bits(base), bits(old))


@pytest.mark.parametrize("bad", [[5, 3], [1, 1], [-1, 2], [0, 10]])
def test_scatter_refuses_bad_positions_and_writes_nothing(bad):
    t = torch.zeros(10, dtype=torch.bfloat16)
    before = bits(t).clone()
    with pytest.raises(ValueError):
        bitops.scatter(t, torch.tensor(bad, dtype=torch.int32), torch.ones(2, dtype=torch.int16), bitops.OP_XOR)
    assert torch.equal(bits(t), before)


def test_mismatched_pair_refused():
    with pytest.raises(ValueError, match="differ"):
        delta.take_delta(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="differ"):
        delta.take_delta(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float16))


@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(FLOAT_DTYPES))
@settings(max_examples=50, deadline=None)
def test_ulp_reference_round_trip(seed, dtype):
    """ulp_add(old, ulp_diff(old, new)) == new for arbitrary bit patterns (NaN, Inf, -0, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(0, dtype=dtype).element_size()
    bd = bitops.BITS_DTYPE[w]
    lo, hi = -(1 << (8 * w - 1)), (1 << (8 * w - 1))
    old = torch.randint(lo, hi, (512,), generator=g, dtype=torch.int64).to(bd)
    new = torch.randint(lo, hi, (512,), generator=g, dtype=torch.int64).to(bd)
    new[:256] = old[:256] + torch.randint(-3, 4, (256,), generator=g).to(bd)  # near neighbours
    z = bitops.ulp_diff_reference(old, new)
    assert torch.equal(bitops.ulp_add_reference(old, z), new)


@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(FLOAT_DTYPES))
@settings(max_examples=50, deadline=None)
def test_ulp_negate_takes_an_ulp_apply_back(seed, dtype):
    """scatter(OP_ULP, ulp_negate(z)) after scatter(OP_ULP, z) restores every bit, for any
    target bits (NaN, Inf, -0) and any differences, the extremes of the width included: the
    receiver's undo log relies on it instead of keeping the old values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(0, dtype=dtype).element_size()
    bd = bitops.BITS_DTYPE[w]
    lo, hi = -(1 << (8 * w - 1)), (1 << (8 * w - 1))
    target = torch.randint(lo, hi, (2048,), generator=g, dtype=torch.int64).to(bd).view(dtype)
    before = bits(target).clone()
    pos = torch.randperm(2048, generator=g)[:700].sort().values.to(torch.int32)
    z = torch.randint(lo, hi, (700,), generator=g, dtype=torch.int64).to(bd)
    z[:4] = torch.tensor([0, -1, lo, hi - 1]).to(bd)  # 0, the largest |d|, -2^(w-1), 2^(w-1)-1 as zig-zag bits
    bitops.scatter(target, pos, z, bitops.OP_ULP)
    assert not torch.equal(bits(target), before)
    neg = bitops.ulp_negate(z)
    assert torch.equal(bitops.ulp_negate(neg), z)
    bitops.scatter(target, pos, neg, bitops.OP_ULP)
    assert torch.equal(bits(target), before)


@pytest.mark.parametrize("rate", [0.002, 0.04, 0.6])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vector_and_scalar_kernels_agree(monkeypatch, dtype, rate):
    """The AVX-512 and AVX2 paths (where the CPU has them) and the portable path give the same
    output, and it is the pure-torch reference's."""
    g = torch.Generator().manual_seed(11)
    old = random_tensor((2 * (1 << 20) + 45,), dtype, g)
    new = perturb(old, rate, g, specials=True)
    ref_pos = torch.nonzero(bits(new) != bits(old)).flatten()
    assert ref_pos.numel() > 0
    outs = []
    for off in ([], ["NEMO_DCR_NO_AVX512"], ["NEMO_DCR_NO_AVX512", "NEMO_DCR_NO_AVX2"]):
        for name in off:
            monkeypatch.setenv(name, "1")
        b = old.clone()
        outs.append((delta.take_delta(new, b, keep_new=True), b))
    for d, b in outs:
        assert torch.equal(d.positions.long(), ref_pos)
        assert torch.equal(d.xor, bits(new)[ref_pos] ^ bits(old)[ref_pos])
        assert torch.equal(d.new, bits(new)[ref_pos]) and torch.equal(bits(b), bits(new))
