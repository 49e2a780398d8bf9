"""Additive tensor digests: what a receiver checks after applying a version.

digest(t) = sum over elements of mix(p * K xor bits(t[p])) mod 2^64.

Why additive rather than a stream hash (xxh3 of the bytes): no sender rank holds a whole
canonical tensor (TP splits it, QKV interleaves it), but each rank can digest its own slice in
canonical positions and the slices sum to the tensor's digest; and a version's digest follows
from the previous one and the changes alone (subtract the old elements' terms, add the new
ones), so neither side rescans the model per version. A wrong bit anywhere changes one term
and so the sum, except with probability ~2^-64.
"""

from __future__ import annotations

import numpy as np
import torch

from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.core.bitops import scatter
from nemo_dcr_callback.core.rawbits import bits

MASK = (1 << 64) - 1
_K = np.uint64(0xD6E8FEB86659FD93)


def _mix(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sum64_reference(values: torch.Tensor, positions: np.ndarray | None = None, base: int = 0) -> int:
    """numpy reference (and fallback without the compiled library)."""
    v = bits(values.reshape(-1)).numpy()
    mask = (1 << (8 * v.itemsize)) - 1
    v = v.astype(np.int64).astype(np.uint64) & np.uint64(mask) if v.itemsize < 8 else v.view(np.uint64)
    acc = 0
    step = 1 << 22
    with np.errstate(over="ignore"):
        for i in range(0, v.size, step):
            p = (np.arange(i, min(i + step, v.size), dtype=np.uint64) + np.uint64(base)) if positions is None \
                else positions[i:i + step].astype(np.uint64)
            acc = (acc + int(_mix((p * _K) ^ v[i:i + step]).sum(dtype=np.uint64))) & MASK
    return acc


def sum64(values: torch.Tensor, positions: np.ndarray | torch.Tensor | None = None, base: int = 0) -> int:
    """Digest of `values` placed at `positions` (int64), or at base, base+1, ... if None."""
    values = values.detach().reshape(-1)
    if values.device.type != "cpu":
        values = values.cpu()
    values = values.contiguous()
    if isinstance(positions, torch.Tensor):
        positions = positions.numpy()
    if positions is not None:
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        if positions.size != values.numel():
            raise ValueError(f"{positions.size} positions for {values.numel()} values")
    lib = kernels.native()
    if lib is None:
        return sum64_reference(values, positions, base)
    return int(lib.dcr_sum64(values.data_ptr(), values.element_size(),
                             0 if positions is None else positions.ctypes.data, base, values.numel(),
                             kernels.num_threads()))


def sum64_at(target: torch.Tensor, positions: torch.Tensor, offset: int = 0) -> int:
    """The digest terms of target's elements at `positions` (int32/int64 tensor), read in
    place: sum64(target[positions], positions) without the gather. offset: target holds the
    elements from `offset` on of a larger tensor, in whose coordinates the positions are (and
    hashed): a part of a canonical tensor that a model keeps in a parameter of its own."""
    lib = kernels.native()
    flat = target.reshape(-1)
    if lib is None or not flat.is_contiguous() or flat.device.type != "cpu":
        p = positions.long()
        return sum64(flat[p - offset], p.cpu().numpy())
    if positions.numel() and (int(positions.max()) >= offset + flat.numel() or int(positions.min()) < offset):
        raise IndexError("position out of range")
    positions = positions.contiguous()
    # the kernel reads base[p] for each position p: base is where element 0 of the larger tensor would be
    base = flat.data_ptr() - offset * flat.element_size()
    return int(lib.dcr_sum64_at(base, flat.element_size(), positions.data_ptr(),
                                int(positions.dtype == torch.int64), positions.numel(), kernels.num_threads()))


def scatter_terms(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, op: int,
                  offset: int = 0) -> tuple[int, int]:
    """delta.scatter with the digest terms of the touched elements before and after, in one
    pass over the target (the receiver's apply and its check, fused). offset: as in sum64_at
    (target is a part of a larger tensor, from `offset` on; positions are the larger one's)."""
    lib = kernels.native()
    t = bits(target)
    if lib is None or positions.dtype not in (torch.int32, torch.int64) or not t.is_contiguous() or t.is_cuda:
        before = sum64_at(target, positions, offset)
        scatter(target, positions - offset if offset else positions, values, op)
        return before, sum64_at(target, positions, offset)
    if positions.numel() and int(positions[0]) < offset:  # (sorted: the kernel checks the rest)
        raise ValueError("scatter refused: positions out of range")
    positions = positions.contiguous()
    values = values.contiguous().view(t.dtype) if values.dtype != t.dtype else values.contiguous()
    sums = np.zeros(2, dtype=np.uint64)
    # the kernel writes base[p] for each position p: base is where element 0 of the larger tensor would be
    base = t.data_ptr() - offset * t.element_size()
    rc = lib.dcr_scatter_digest(base, offset + t.numel(), t.element_size(), positions.data_ptr(),
                                int(positions.dtype == torch.int64), values.data_ptr(), positions.numel(), op,
                                sums.ctypes.data)
    if rc < 0:
        raise ValueError(f"scatter refused: positions out of range or unsorted ({rc})")
    return int(sums[0]), int(sums[1])


def update_xor(d: int, positions, new: torch.Tensor, xor: torch.Tensor) -> int:
    """update() for an XOR delta: the old values are new ^ xor (what a sender holds)."""
    if isinstance(positions, torch.Tensor):  # converted once for both sums (the encoder calls this per chunk)
        positions = positions.numpy()
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    return update(d, positions, (bits(new) ^ bits(xor)).view(new.dtype), new)


def add_terms(acc: dict[str, tuple[int, int]], name: str, before: int, after: int) -> None:
    """Add one apply's [before, after] term sums to a tensor's running pair in acc (the sums
    of a version's pieces of one tensor, checked against the record's digests at the end)."""
    ob, oa = acc.get(name, (0, 0))
    acc[name] = ((ob + before) & MASK, (oa + after) & MASK)


def move(d: int, terms: list[int]) -> int:
    """The digest after changes whose [old, new] term sums are `terms` (codec.encode_chunk
    adds them up while it encodes)."""
    return (d - terms[0] + terms[1]) & MASK


def update(d: int, positions, old: torch.Tensor, new: torch.Tensor) -> int:
    """The digest after the elements at `positions` went from `old` to `new`."""
    return (d - sum64(old, positions) + sum64(new, positions)) & MASK


def hexd(d: int) -> str:
    return f"{d & MASK:016x}"

