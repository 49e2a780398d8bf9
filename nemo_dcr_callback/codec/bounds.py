"""Information bounds of a delta: what the codec's sizes are measured against (stats, bench)."""

from __future__ import annotations

import math

import numpy as np
import torch

from nemo_dcr_callback.codec.format import BY_TORCH
from nemo_dcr_callback.codec.streams import ulp_encode
from nemo_dcr_callback.core.rawbits import SparseDelta


def entropy_bits(hist: np.ndarray) -> float:
    """Total order-0 information of the symbols counted in hist, in bits."""
    h = hist[hist > 0].astype(np.float64)
    n = h.sum()
    return float(-(h * np.log2(h / n)).sum()) if n else 0.0


def values_info_bits(values: torch.Tensor) -> float:
    """Order-0 information (bits) of raw values of any width: the value part of the bound."""
    w = values.element_size()
    u = values.contiguous().numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[w])
    if w <= 2:
        return entropy_bits(np.bincount(u, minlength=1 << (8 * w)))
    return entropy_bits(np.unique(u, return_counts=True)[1])


def delta_bound_bits(delta: SparseDelta) -> dict[str, float | None]:
    """Information bound of a delta, in bits: positions (n H(p)), XOR values, and ulp values
    (floats whose new values are known; else None)."""
    info = BY_TORCH.get(delta.dtype)
    ulp_ok = info is not None and info.is_float and info.width > 1
    out: dict[str, float | None] = {"positions": position_bound_bits(delta.count, delta.numel), "xor": 0.0,
                                    "ulp": 0.0 if ulp_ok else None}
    if delta.count:
        out["xor"] = values_info_bits(delta.xor)
        out["ulp"] = values_info_bits(ulp_encode(delta.xor, delta.new)) if ulp_ok and delta.new is not None else None
    return out


def position_bound_bits(count: int, numel: int) -> float:
    """n * H(p): the information in which positions changed (independent changes)."""
    if numel == 0 or count in (0, numel):
        return 0.0
    p = count / numel
    return numel * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
