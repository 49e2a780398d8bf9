"""The placement's affine projection: the compiled map (dcr_affine) against the numpy one,
on random segment tables with row-split and column-split segments, int32 and int64 input
positions and a shifted local range (a data-parallel slice)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr_callback import kernels
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
    if kernels.native() is None:
        pytest.skip("compiled library unavailable")
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
