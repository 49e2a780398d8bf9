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

from dataclasses import dataclass

import torch

from nemo_dcr_callback import kernels

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
        from nemo_dcr_callback import cuda_kernels

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


OP_XOR, OP_OVERWRITE, OP_ULP = 0, 1, 2


def scatter(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, op: int) -> None:
    """target[positions] (^=, =, ulp+=) values, in place. Positions are validated first.
    A CUDA target goes to the CUDA kernel (positions and values may be on the host)."""
    if target.is_cuda:
        from nemo_dcr_callback import cuda_kernels

        return cuda_kernels.scatter_cuda(target, positions, values, op)
    if positions.is_cuda or values.is_cuda:  # a host target (a pinned baseline), deltas on a GPU
        positions, values = positions.cpu(), values.cpu()
    t = bits(target)
    values = values.contiguous().view(t.dtype) if values.dtype != t.dtype else values.contiguous()
    lib = kernels.native()
    if lib is not None and positions.dtype in (torch.int32, torch.int64):
        positions = positions.contiguous()
        rc = lib.dcr_scatter(t.data_ptr(), t.numel(), t.element_size(), positions.data_ptr(),
                             int(positions.dtype == torch.int64), values.data_ptr(),
                             positions.numel(), op)
        if rc < 0:
            raise ValueError(f"scatter refused: positions out of range or unsorted ({rc})")
        return
    scatter_reference(t, positions, values, op)


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


def undo(baseline: torch.Tensor, delta: SparseDelta) -> None:
    """Restore the baseline from before take_delta (baseline ^= xor at the positions)."""
    scatter(baseline, delta.positions, delta.xor, OP_XOR)


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
