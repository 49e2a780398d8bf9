"""The placement's affine projection: the compiled map (dcr_affine) against the numpy one,
on random segment tables with row-split and column-split segments, int32 and int64 input
positions and a shifted local range (a data-parallel slice)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.placement.families import FAMILIES
from nemo_dcr_callback.placement.maps import ParamMap, Placement


def _param_map(rng: np.random.Generator) -> ParamMap:
    """Segments tiling [0, n) of a local parameter: some whole rows (a shift), some column
    slices of wider canonical rows (row_len < stride), landing in two canonical tensors."""
    starts, lengths, row_len, cid, off, stride = [], [], [], [], [], []
    at = 0
    for _ in range(rng.integers(1, 7)):
        rl = int(rng.integers(1, 40))
        rows = int(rng.integers(1, 30))
        whole = rng.random() < 0.5
        st = rl if whole else rl + int(rng.integers(1, 50))
        starts.append(at)
        lengths.append(rl * rows)
        row_len.append(rl)
        stride.append(st)
        cid.append(int(rng.integers(0, 2)))
        off.append(int(rng.integers(0, 1000)) * st + (0 if whole else int(rng.integers(0, st - rl + 1))))
        at += rl * rows
    a = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    rule = next(iter(FAMILIES.values())).rules[0]
    return ParamMap("p", "k", torch.empty(at, dtype=torch.bfloat16), rule, None, 0, at, False, a(starts),
                    a(lengths), a(row_len), a(cid), a(off), a(stride), ["t0", "t1"], size=at)


@pytest.mark.parametrize("seed", range(40))
def test_compiled_projection_matches_numpy(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    pm = _param_map(rng)
    n = int(pm.length.sum())
    add = int(rng.integers(0, n // 2 + 1))  # positions are relative to a slice starting at add
    local = np.sort(rng.choice(n - add, size=int(rng.integers(0, n - add + 1)), replace=False))
    for dt in (np.int32, np.int64):
        native = Placement.project(pm, local.astype(dt), add=add)
        monkeypatch.setattr(kernels, "native", lambda: None)
        ref = Placement.project(pm, local.astype(np.int64) + add)
        monkeypatch.undo()
        assert [p.name for p in native] == [p.name for p in ref]
        for x, y in zip(native, ref, strict=True):
            assert x.parts == y.parts
            assert x.positions.dtype == np.int64 and np.array_equal(x.positions, y.positions)


def _disjoint_map(rng: np.random.Generator) -> tuple[ParamMap, dict[str, tuple[int]]]:
    """Like _param_map, but each canonical tensor's segments land in ascending, disjoint rows
    (as Megatron's layouts do), so the changes of a slice are a valid sparse delta."""
    starts, lengths, row_len, cid, off, stride = [], [], [], [], [], []
    at, end = 0, [0, 0]
    for _ in range(rng.integers(1, 7)):
        rl, rows, c = int(rng.integers(1, 40)), int(rng.integers(1, 30)), int(rng.integers(0, 2))
        st = rl if rng.random() < 0.5 else rl + int(rng.integers(1, 50))
        o = end[c] + int(rng.integers(0, 3)) * st + int(rng.integers(0, st - rl + 1))
        for col, v in zip((starts, lengths, row_len, stride, cid, off), (at, rl * rows, rl, st, c, o), strict=True):
            col.append(v)
        end[c] = o - o % st + rows * st + st
        at += rl * rows
    a = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    rule = next(iter(FAMILIES.values())).rules[0]
    pm = ParamMap("p", "k", torch.empty(at, dtype=torch.bfloat16), rule, None, 0, at, False, a(starts),
                  a(lengths), a(row_len), a(cid), a(off), a(stride), ["t0", "t1"], size=at)
    return pm, {"t0": (end[0] + int(rng.integers(1, 100)),), "t1": (end[1] + int(rng.integers(1, 100)),)}


@pytest.mark.parametrize("seed", range(24))
def test_compiled_slice_encoder_matches_the_python_path(seed):
    """codec.encode_xor_slice (projection, span ranges and the fused encoder in one call)
    writes the chunks, digest terms and counts of Placement.project + encode_sparse, for
    dense and sparse slices (the sparse ones fall back to the Python path), int32 and int64
    positions, small spans (many chunks per tensor) and a data-parallel slice offset."""
    from nemo_dcr_callback.core.rawbits import SparseDelta, bits
    from nemo_dcr_callback.sender.shard import Encoder

    rng = np.random.default_rng(seed)
    pm, canonical = _disjoint_map(rng)
    n = int(pm.length.sum())
    pm.lo = int(rng.integers(0, n // 3 + 1))
    placement = Placement([pm], canonical, torch.bfloat16)
    rate = [0.9, 0.05, 0.002][seed % 3]
    m = max(1, int((n - pm.lo) * rate))
    local = np.sort(rng.choice(n - pm.lo, size=min(m, n - pm.lo), replace=False))
    new = bits(torch.randn(local.size).to(torch.bfloat16))
    old = new + torch.from_numpy(rng.choice([-3, -1, 1, 2, 300], local.size, p=[.2, .3, .3, .19, .01])).to(torch.int16)
    for dt in (torch.int32, torch.int64):
        d = SparseDelta(torch.from_numpy(local).to(dt), new ^ old, n - pm.lo, torch.bfloat16, new)
        outs = []
        for fused in (True, False):
            s = Encoder(placement, [1 << 24, 97, 1000][seed % 3], 1)
            s.fused_slices = fused
            digests = {"t0": 5, "t1": 7}
            chunks, st = s.encode([(pm, d)], digests=digests)
            outs.append((chunks, digests, st))
        assert outs[0] == outs[1]
        assert outs[0][2].changed == local.size and outs[0][0]
