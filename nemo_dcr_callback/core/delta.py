"""The delta stage: bit-level XOR of a shard against its baseline, compacted.

`take_delta(current, baseline)` is the one pass after an optimizer step: it returns the
changed positions and XOR values and moves the baseline to the current bits. The returned
`SparseDelta` is the undo log until the joint commit: `undo(baseline, delta)` restores the
previous baseline bit for bit (x ^ d ^ d = x), so an aborted refit costs no model copy.

Everything works on raw bit patterns (any dtype of 1, 2, 4 or 8 bytes), so NaN, Inf, -0.0
and subnormals are ordinary values. The compiled kernel (kernels.native()) does the work;
`take_delta_reference` is the pure-torch oracle the tests compare it with.
"""

from __future__ import annotations

import torch

from nemo_dcr_callback.core import cuda_kernels, kernels
from nemo_dcr_callback.core.bitops import scatter
from nemo_dcr_callback.core.rawbits import OP_XOR, SparseDelta, bits, index_dtype


def _check_pair(current: torch.Tensor, baseline: torch.Tensor) -> None:
    if current.dtype != baseline.dtype or current.shape != baseline.shape:
        raise ValueError(
            f"shard and baseline differ: {current.dtype}{tuple(current.shape)} vs "
            f"{baseline.dtype}{tuple(baseline.shape)}"
        )
    if current.device.type != "cpu" or baseline.device.type != "cpu":
        raise ValueError("the CPU delta kernel takes CPU tensors")


def take_delta_reference(current: torch.Tensor, baseline: torch.Tensor, keep_new: bool = False) -> SparseDelta:
    """Pure-torch oracle: same contract and output as the compiled kernel."""
    _check_pair(current, baseline)
    c, b = bits(current), bits(baseline)
    x = c ^ b
    pos = torch.nonzero(x).reshape(-1)
    vals = x[pos]
    new = c[pos]
    b[pos] = new
    return SparseDelta(pos.to(index_dtype(c.numel())), vals, c.numel(), current.dtype,
                       new if keep_new else None)


class Scratch:
    """Reusable worst-case output buffers for take_delta (one per caller thread): a shard
    pass then allocates only what changed, not n-sized buffers every step."""

    def __init__(self):
        self.bufs: dict[tuple[torch.dtype, str], torch.Tensor] = {}

    def get(self, dtype: torch.dtype, role: str, n: int) -> torch.Tensor:
        t = self.bufs.get((dtype, role))
        if t is None or t.numel() < n:
            t = self.bufs[(dtype, role)] = torch.empty(n, dtype=dtype)
        return t[:n]


def output_capacity(numel: int, threads: int | None = None) -> int:
    """Elements the kernel may write for a tensor of numel (its per-thread headroom included)."""
    return numel + 64 * ((threads or kernels.num_threads()) + 2)


def take_delta(current: torch.Tensor, baseline: torch.Tensor, threads: int | None = None,
               keep_new: bool = False, scratch: Scratch | None = None,
               out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None) -> SparseDelta:
    """One fused pass: XOR, compaction, baseline <- current. Returns the undo log.

    keep_new also returns the new values at the changed positions, which the encoder
    needs for ulp coding (written in the same pass, so the encoder does no gather).
    out: (positions, xor, new) buffers of output_capacity(numel) elements that the kernel
    writes into and the returned delta views (a publisher's shared-memory segment: the deltas
    reach the worker with no copy); else they are copied out of worst-case scratch.
    CUDA shards go to the CUDA kernel (cuda_kernels.take_delta_cuda: device outputs).
    """
    if current.is_cuda:
        return cuda_kernels.take_delta_cuda(current, baseline, keep_new=keep_new)
    lib = kernels.native()
    if lib is None:
        return take_delta_reference(current, baseline, keep_new)
    _check_pair(current, baseline)
    c, b = bits(current), bits(baseline)
    n = c.numel()
    threads = threads or kernels.num_threads()
    cap = output_capacity(n, threads)
    idt = index_dtype(n)
    if out is not None:
        pos, val, new = out
        if (pos.dtype != idt or val.dtype != c.dtype or min(pos.numel(), val.numel()) < cap
                or (keep_new and (new is None or new.dtype != c.dtype or new.numel() < cap))):
            raise ValueError(f"delta output buffers do not fit a {c.dtype} tensor of {n} elements")
        new = new if keep_new else None
    else:
        get = scratch.get if scratch is not None else (lambda dt, _role, k: torch.empty(k, dtype=dt))
        pos = get(idt, "pos", cap)
        val = get(c.dtype, "val", cap)
        new = get(c.dtype, "new", cap) if keep_new else None
    count = lib.dcr_delta(c.data_ptr(), b.data_ptr(), n, c.element_size(), pos.data_ptr(),
                          int(idt == torch.int64), val.data_ptr(), kernels.ptr(new), threads)
    if count < 0:
        raise RuntimeError(f"dcr_delta failed ({count})")
    if out is not None:  # views of the caller's buffers
        return SparseDelta(pos[:count], val[:count], n, current.dtype, new[:count] if keep_new else None)
    # Copy out of the worst-case scratch so the undo log holds only what changed. numpy's
    # copy, not torch's: a torch copy this size wakes the intra-op (OpenMP) pool, whose threads
    # then spin between the shard's tensors and doubled the pass's CPU on a shared machine.
    return SparseDelta(_copy(pos, count), _copy(val, count), n, current.dtype,
                       _copy(new, count) if keep_new else None)


def _copy(t: torch.Tensor, count: int) -> torch.Tensor:
    """A single-threaded copy of t[:count] (integer dtypes: positions and raw bits)."""
    if count == 0:  # numpy's empty arrays come with stride 0, which torch's .view() refuses
        return t.new_empty(0)
    return torch.from_numpy(t[:count].numpy().copy())


def undo(baseline: torch.Tensor, delta: SparseDelta) -> None:
    """Restore the baseline from before take_delta (baseline ^= xor at the positions)."""
    scatter(baseline, delta.positions, delta.xor, OP_XOR)
