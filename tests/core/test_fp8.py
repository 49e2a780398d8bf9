"""The block-FP8 cast (core/fp8.py) against the serving engines' per-block cast (vLLM's
per_block_cast_to_fp8, with and without ue8m0, and DeepGEMM's first reference), rewritten
here from their published formula as the oracle (issue 37)."""

from __future__ import annotations

import pytest
import torch

from nemo_dcr_callback.core import fp8
from tests.helpers.tensors import same_fp8


def engine_cast(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The engines' dense per-block cast, as published (vLLM utils/deep_gemm.py; DeepGEMM)."""
    m, n = x.shape
    mp, np_ = -(-m // 128) * 128, -(-n // 128) * 128
    xp = torch.zeros((mp, np_), dtype=x.dtype)
    xp[:m, :n] = x
    xv = xp.view(-1, 128, np_ // 128, 128)
    amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    if recipe == "deepgemm-v1":
        q, sf = (xv * (448.0 / amax)).to(torch.float8_e4m3fn), amax / 448.0
    else:
        sf = amax / 448.0
        if recipe == "ue8m0":
            sf = torch.pow(2.0, torch.ceil(torch.log2(sf.abs())))
        q = (xv * (1.0 / sf)).to(torch.float8_e4m3fn)
    return q.view_as(xp)[:m, :n].contiguous(), sf.view(xv.size(0), xv.size(2))


@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("shape", [(128, 128), (300, 520), (64, 1000), (257, 129)])
def test_quantizer_equals_the_engines_cast(recipe, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 0.03).to(torch.bfloat16)
    x[:10, :10] = 0  # an all-zero corner (clamped amax) where the block is small
    x.view(-1)[7] = 300.0  # a large value: that block's scale
    q, s = fp8.quantize(x, recipe)
    rq, rs = engine_cast(x, recipe)
    assert same_fp8(q, rq) and torch.equal(s, rs)
    zero = torch.zeros(130, 130, dtype=torch.bfloat16)
    assert same_fp8(fp8.quantize(zero, recipe)[0], engine_cast(zero, recipe)[0])
