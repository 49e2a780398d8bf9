"""Block-scaled FP8 weights (DeepSeek-V3's layout): float8_e4m3fn values, and per 128x128
block one fp32 `weight_scale_inv` (the factor that dequantizes: w ~ q * scale_inv).

The serving engines quantize a BF16 weight block by block from the block's largest |w|
(clamped at 1e-4): scale_inv = amax / 448, q = w * (1 / scale_inv) cast to float8_e4m3fn,
which is vLLM's per-block cast (and DeepGEMM's now); `ue8m0` rounds scale_inv up to a power
of two first (vLLM's use_ue8m0, for DeepGEMM on Blackwell); `deepgemm-v1` is the older
reference, q = w * (448 / amax). The three can differ in the last bit of q, so a receiver
uses its engine's: bit-exactness is against that engine's dense cast.

Here the same arithmetic runs on any set of blocks (zero-padded at the edges, as the dense
cast pads): requantizing only the blocks a version touched gives the dense cast's bytes.
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
RECIPES = ("vllm", "ue8m0", "deepgemm-v1")


def quantize_blocks(blocks: torch.Tensor, recipe: str = "vllm") -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [k, bm, bn] (BF16, zero-padded) -> (float8_e4m3fn [k, bm, bn], scale_inv fp32 [k])."""
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe must be one of {', '.join(RECIPES)}, not {recipe!r}")
    amax = blocks.abs().float().amax(dim=(1, 2), keepdim=True).clamp(1e-4)
    if recipe == "deepgemm-v1":
        q = (blocks * (FP8_MAX / amax)).to(torch.float8_e4m3fn)
        return q, (amax / FP8_MAX).reshape(-1)
    sf = amax / FP8_MAX
    if recipe == "ue8m0":
        sf = torch.pow(2.0, torch.ceil(torch.log2(sf.abs())))
    q = (blocks * (1.0 / sf)).to(torch.float8_e4m3fn)
    return q, sf.reshape(-1)


def grid(shape: tuple[int, int]) -> tuple[int, int]:
    """Blocks along each dimension of a [m, n] weight."""
    return -(-shape[0] // BLOCK), -(-shape[1] // BLOCK)


def gather_blocks(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Blocks `ids` (row-major block numbers) of the 2-D weight w as [k, BLOCK, BLOCK], zero
    outside w (the dense cast's padding)."""
    m, n = w.shape
    gm, gn = grid((m, n))
    out = torch.zeros((len(ids), BLOCK, BLOCK), dtype=w.dtype)
    for i, b in enumerate(ids.tolist()):
        r, c = divmod(b, gn)
        blk = w[r * BLOCK:(r + 1) * BLOCK, c * BLOCK:(c + 1) * BLOCK]
        out[i, :blk.shape[0], :blk.shape[1]] = blk
    return out


def quantize(w: torch.Tensor, recipe: str = "vllm") -> tuple[torch.Tensor, torch.Tensor]:
    """The dense cast of a 2-D BF16 weight: (float8_e4m3fn [m, n], scale_inv fp32 [gm, gn])."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 takes 2-D weights, not shape {tuple(w.shape)}")
    m, n = w.shape
    gm, gn = grid((m, n))
    padded = torch.zeros((gm * BLOCK, gn * BLOCK), dtype=w.dtype)
    padded[:m, :n] = w
    blocks = padded.view(gm, BLOCK, gn, BLOCK).permute(0, 2, 1, 3).reshape(gm * gn, BLOCK, BLOCK)
    q, sf = quantize_blocks(blocks, recipe)
    q = q.view(gm, gn, BLOCK, BLOCK).permute(0, 2, 1, 3).reshape(gm * BLOCK, gn * BLOCK)
    return q[:m, :n].contiguous(), sf.view(gm, gn)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """q * scale_inv per block, in fp32 (for checks; serving kernels fuse this)."""
    m, n = q.shape
    s = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:m, :n]
    return q.float() * s
