"""Tensor factories for tests: special bit patterns (NaN payloads, infinities, subnormals),
random tensors and perturbed copies."""

from __future__ import annotations

import torch

from nemo_dcr_callback.core.rawbits import bits

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# NaN (quiet and signalling payloads), +-Inf, +-0.0, subnormals, max finite, per dtype.
SPECIALS = {
    torch.bfloat16: [0x7FC0, 0x7F81, 0xFFC1, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F],
    torch.float16: [0x7E00, 0x7C01, 0xFE01, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF],
    torch.float32: [0x7FC00000, 0x7F800001, 0xFFC00001, 0x7F800000, 0xFF800000, 0, 0x80000000, 1,
                    0x807FFFFF, 0x7F7FFFFF],
}


def from_bits(pattern: list[int], dtype: torch.dtype) -> torch.Tensor:
    w = torch.empty(0, dtype=dtype).element_size()
    signed = [p - (1 << (8 * w)) if p >= 1 << (8 * w - 1) else p for p in pattern]
    return torch.tensor(signed, dtype=bits(torch.empty(1, dtype=dtype)).dtype).view(dtype)


def perturb(t: torch.Tensor, rate: float, gen: torch.Generator, specials: bool = False) -> torch.Tensor:
    """A copy of t with about `rate` of its elements changed (random bits, +-1 ulp, specials)."""
    out = t.clone()
    b = bits(out)
    n = b.numel()
    if n == 0 or rate == 0:
        return out
    k = max(1, round(rate * n)) if rate < 1 else n
    idx = torch.randperm(n, generator=gen)[:k]
    mode = torch.randint(0, 3, (k,), generator=gen)
    w = out.element_size()
    flips = torch.randint(1, 1 << min(8 * w - 1, 15), (k,), generator=gen).to(b.dtype)
    new = b[idx].clone()
    new = torch.where(mode == 0, new ^ flips, new)
    new = torch.where(mode == 1, new ^ 1, new)
    new = torch.where(mode == 2, new + 1, new)
    same = new == b[idx]
    new = torch.where(same, new ^ 1, new)
    b[idx] = new
    if specials and out.dtype in SPECIALS and n >= 1:
        sp = bits(from_bits(SPECIALS[out.dtype], out.dtype))
        m = min(n, sp.numel())
        b[torch.randperm(n, generator=gen)[:m]] = sp[:m]
    return out


def random_tensor(shape, dtype: torch.dtype, gen: torch.Generator, specials: bool = True) -> torch.Tensor:
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    else:
        t = torch.randint(-100, 100, shape, generator=gen).to(dtype)
    if specials and dtype in SPECIALS and t.numel():
        b = bits(t)
        sp = bits(from_bits(SPECIALS[dtype], dtype))
        m = min(b.numel(), sp.numel())
        b[:m] = sp[:m]
    return t


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Every tensor of b has the same bits in a."""
    return all(torch.equal(bits(a[k]), bits(b[k])) for k in b)


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same FP8 bytes (compared as bytes: FP8 NaNs compare unequal as values)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def adam_like(numel: int, lr: float, seed: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new): weights of mixed magnitude moved by about lr each (an Adam step), so small
    weights change far more often than large ones, which is what context coding exploits."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=g) * torch.logspace(-3, 0, numel)[torch.randperm(numel, generator=g)]
    step = lr * torch.sign(torch.randn(numel, generator=g))
    return master.to(dtype), (master + step).to(dtype)
