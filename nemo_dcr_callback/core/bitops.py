"""Bit-level helpers every stage shares: raw-bit views of any 1-8 byte dtype, the sparse
delta record, the apply ops (XOR, overwrite, ulp) and their pure-torch references.

A leaf: it imports only the kernels' bindings (core.kernels, core.cuda_kernels for CUDA
targets) and the shared types (core.rawbits), so the codec, the placement and the receiver
use it without pulling in the sender.
"""

from __future__ import annotations

import numpy as np
import torch

from nemo_dcr_callback.core import cuda_kernels, kernels
from nemo_dcr_callback.core.rawbits import BITS_DTYPE, OP_OVERWRITE, OP_ULP, OP_XOR, bits

_INDEX = (torch.int32, torch.int64)


def _native_ready(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> bool:
    """Can the compiled scatter take these as they are (host tensors, a contiguous target,
    int32/int64 positions, one value of the target's width per position)?"""
    return (target.is_cpu and positions.is_cpu and values.is_cpu and target.is_contiguous()
            and positions.dtype in _INDEX and values.element_size() == target.element_size()
            and values.numel() == positions.numel())


def scatter(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, op: int) -> None:
    """target[positions] (^=, =, ulp+=) values, in place. Positions are validated first.
    A CUDA target goes to the CUDA kernel (positions and values may be on the host)."""
    lib = kernels.native()
    # The common case first, with no views made: a receiver applies one call per tensor a
    # version touches, and a checkpoint's many small tensors made the views cost more than
    # the writes.
    if lib is not None and _native_ready(target, positions, values):
        if not positions.is_contiguous():
            positions = positions.contiguous()
        if not values.is_contiguous():
            values = values.contiguous()
        rc = lib.dcr_scatter(target.data_ptr(), target.numel(), target.element_size(), positions.data_ptr(),
                             int(positions.dtype == torch.int64), values.data_ptr(), positions.numel(), op)
        if rc < 0:
            raise ValueError(f"scatter refused: positions out of range or unsorted ({rc})")
        return
    if target.is_cuda:
        return cuda_kernels.scatter_cuda(target, positions, values, op)
    if positions.is_cuda or values.is_cuda:  # a host target (a pinned baseline), deltas on a GPU
        positions, values = positions.cpu(), values.cpu()
    t = bits(target)
    values = values.contiguous().view(t.dtype) if values.dtype != t.dtype else values.contiguous()
    if lib is not None and positions.dtype in (torch.int32, torch.int64):
        positions = positions.contiguous()
        rc = lib.dcr_scatter(t.data_ptr(), t.numel(), t.element_size(), positions.data_ptr(),
                             int(positions.dtype == torch.int64), values.data_ptr(),
                             positions.numel(), op)
        if rc < 0:
            raise ValueError(f"scatter refused: positions out of range or unsorted ({rc})")
        return
    scatter_reference(t, positions, values, op)


def scatter_many(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]) -> None:
    """scatter() for each (target, positions, values, op), in one compiled call per run of
    items alike in width, index type and op where every tensor is a contiguous host tensor
    (a checkpoint's small tensors: a call per tensor cost more than its writes). Every
    position of a run is checked before any of it is written."""
    lib = kernels.native()
    run: list = []

    def flush() -> None:
        if not run:
            return
        if len(run) == 1:
            scatter(*run[0])
        else:
            t0, p0, _, op = run[0]
            m = len(run)
            arr = np.empty((5, m), dtype=np.int64)
            arr[0] = [t.data_ptr() for t, _, _, _ in run]
            arr[1] = [t.numel() for t, _, _, _ in run]
            arr[2] = [p.data_ptr() for _, p, _, _ in run]
            arr[3] = [v.data_ptr() for _, _, v, _ in run]
            arr[4] = [p.numel() for _, p, _, _ in run]
            rc = lib.dcr_scatter_many(m, arr[0].ctypes.data, arr[1].ctypes.data, arr[2].ctypes.data,
                                      arr[3].ctypes.data, arr[4].ctypes.data, t0.element_size(),
                                      int(p0.dtype == torch.int64), op)
            if rc < 0:
                raise ValueError(f"scatter refused: positions out of range or unsorted ({rc})")
        run.clear()

    key = None
    for item in items:
        t, p, v, op = item
        fast = lib is not None and _native_ready(t, p, v) and p.is_contiguous() and v.is_contiguous()
        k = (t.element_size(), p.dtype, op) if fast else None
        if k is None or k != key:
            flush()
        if k is None:
            scatter(t, p, v, op)
        else:
            run.append(item)
        key = k
    flush()


def ulp_negate(values: torch.Tensor) -> torch.Tensor:
    """Zig-zag ulp differences -> their negations: scatter(OP_ULP) with these takes back
    scatter(OP_ULP) with `values` bit for bit (the ulp key is a bijection and the sum wraps),
    so an undo log needs no copy of the old values."""
    z = bits(values.contiguous()).numpy()  # signed ints of the value width
    u = z.view(f"u{z.itemsize}")
    d = (u >> 1).astype(z.dtype) ^ -(u & 1).astype(z.dtype)  # un-zig-zag
    nd = -d  # wraps at the width, like the apply's sum
    return torch.from_numpy((nd << 1) ^ (nd >> (8 * z.itemsize - 1))).view(values.dtype)


def scatter_reference(t: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, op: int) -> None:
    pos = positions.to(torch.int64)
    if pos.numel():
        if (pos[1:] <= pos[:-1]).any() or int(pos[0]) < 0 or int(pos[-1]) >= t.numel():
            raise ValueError("scatter refused: positions out of range or unsorted")
    if op == OP_XOR:
        t[pos] ^= values
    elif op == OP_OVERWRITE:
        t[pos] = values
    elif op == OP_ULP:
        t[pos] = ulp_add_reference(t[pos], values)
    else:
        raise ValueError(f"unknown op {op}")


# ------------------------------------------------------------------ ulp reference
# A monotone map from bit patterns to unsigned order: key(b) = b | sign if b >= 0 else ~b.
# Done in int64 arithmetic on the unsigned value so every width works the same way.

def _unsigned(x: torch.Tensor, w: int) -> torch.Tensor:
    return x.to(torch.int64) & ((1 << (8 * w)) - 1) if w < 8 else x


def ulp_key_reference(b: torch.Tensor) -> torch.Tensor:
    w = b.element_size()
    if w == 8:
        raise NotImplementedError("the reference ulp map covers widths 2 and 4")
    u = _unsigned(b, w)
    sign = 1 << (8 * w - 1)
    mask = (1 << (8 * w)) - 1
    return torch.where(u & sign != 0, (~u) & mask, u | sign)


def ulp_unkey_reference(k: torch.Tensor, w: int) -> torch.Tensor:
    sign = 1 << (8 * w - 1)
    mask = (1 << (8 * w)) - 1
    return torch.where(k & sign != 0, k & (sign - 1), (~k) & mask)


def ulp_diff_reference(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Zig-zag coded (key(new) - key(old)) mod 2^bits, as the tensor's bit dtype."""
    w = old.element_size()
    mask = (1 << (8 * w)) - 1
    d = (ulp_key_reference(new) - ulp_key_reference(old)) & mask
    s = torch.where(d >= (1 << (8 * w - 1)), d - (1 << (8 * w)), d)  # signed
    z = ((s << 1) ^ (s >> 63)) & mask
    return _to_bits(z, w)


def ulp_add_reference(old: torch.Tensor, zz: torch.Tensor) -> torch.Tensor:
    w = old.element_size()
    mask = (1 << (8 * w)) - 1
    z = _unsigned(zz, w)
    d = (z >> 1) ^ (-(z & 1) & mask)
    k = (ulp_key_reference(old) + d) & mask
    return _to_bits(ulp_unkey_reference(k, w), w)


def _to_bits(x: torch.Tensor, w: int) -> torch.Tensor:
    """int64 holding an unsigned w-byte value -> the w-byte bit dtype, same bits."""
    if w == 8:
        return x
    sign = 1 << (8 * w - 1)
    signed = torch.where(x >= sign, x - (1 << (8 * w)), x)
    return signed.to(BITS_DTYPE[w]) if w > 1 else x.to(torch.uint8)
