"""Raw bits and the sparse delta record: the types every stage shares.

A leaf below the kernels' bindings (core.bitops, core.cuda_kernels), so both import it and
neither imports the other's data types back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
INT32_LIMIT = 2**31 - 1


def bits(t: torch.Tensor) -> torch.Tensor:
    """A flat view of a contiguous tensor's raw bits (int16 for bf16/fp16, int32 for fp32...)."""
    if not t.is_contiguous():
        raise ValueError("delta kernels need contiguous tensors")
    flat = t.reshape(-1)
    return flat.view(BITS_DTYPE[t.element_size()])


def index_dtype(numel: int) -> torch.dtype:
    """int32 positions where they fit (half the undo-log memory), int64 beyond."""
    return torch.int32 if numel <= INT32_LIMIT else torch.int64


@dataclass
class SparseDelta:
    """Changed positions (sorted, flat) and XOR values (raw bits) of one tensor."""

    positions: torch.Tensor  # int32 / int64, strictly increasing
    xor: torch.Tensor  # bit dtype of the tensor's element size
    numel: int
    dtype: torch.dtype
    new: torch.Tensor | None = None  # new bits at the positions (for the encoder; not undo)

    @property
    def count(self) -> int:
        return int(self.positions.numel())

    @property
    def rate(self) -> float:
        return self.count / self.numel if self.numel else 0.0


OP_XOR, OP_OVERWRITE, OP_ULP = 0, 1, 2
