"""Synthetic policies and Adam-like updates with a chosen BF16 change rate.

Used by `make demo`, `nemo-dcr bench codec` and the tests where no trainer is involved.
FP32 master weights (matrices ~ N(0, 0.02), norm-like vectors near 1.0) take one Adam step
(direction m_hat / (sqrt(v_hat) + eps) after a few steps of random gradients); the step
size is bisected so that the fraction of BF16 values that change hits the target rate.
The XOR values that come out are the natural +-1 ulp carry chains seen in real training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SyntheticPolicy:
    """FP32 master weights and a fixed Adam step direction per tensor."""

    master: dict[str, torch.Tensor]
    direction: dict[str, torch.Tensor]

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.master.values())

    def bf16(self) -> dict[str, torch.Tensor]:
        return {k: v.to(torch.bfloat16) for k, v in self.master.items()}

    def step(self, lr: float) -> None:
        for k, w in self.master.items():
            w.sub_(self.direction[k], alpha=lr)

    def change_rate(self, lr: float, sample: int = 1 << 22) -> float:
        """Fraction of BF16 values an lr-sized step would change (on a sample)."""
        changed = total = 0
        for k, w in self.master.items():
            n = min(w.numel(), max(1, sample * w.numel() // self.numel))
            a = w.reshape(-1)[:n]
            b = a - lr * self.direction[k].reshape(-1)[:n]
            changed += int((a.to(torch.bfloat16).view(torch.int16) != b.to(torch.bfloat16).view(torch.int16)).sum())
            total += n
        return changed / max(total, 1)

    def lr_for_rate(self, rate: float, iters: int = 40) -> float:
        """Bisect (in log space) the step size that changes `rate` of the BF16 values."""
        lo, hi = 1e-9, 1.0
        for _ in range(iters):
            mid = (lo * hi) ** 0.5
            if self.change_rate(mid) < rate:
                lo = mid
            else:
                hi = mid
        return (lo * hi) ** 0.5


def layer_shapes(params: int, hidden: int | None = None) -> dict[str, tuple[int, ...]]:
    """A Llama-like list of tensors adding up to about `params` elements (hidden 1024, or
    smaller for small models so that there are a few layers)."""
    if hidden is None:
        hidden = 1024
        while hidden > 64 and 4 * (10 * hidden * hidden) > params:
            hidden //= 2
    shapes: dict[str, tuple[int, ...]] = {"model.norm.weight": (hidden,)}
    per_layer = 4 * hidden * hidden + 3 * hidden * (hidden * 2) + 2 * hidden
    layers = max(1, (params - 2 * 256 * hidden) // per_layer)
    vocab = max(256, (params - layers * per_layer - hidden) // (2 * hidden))  # fills the rest
    shapes["model.embed_tokens.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for m in ("q", "k", "v", "o"):
            shapes[p + f"self_attn.{m}_proj.weight"] = (hidden, hidden)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (2 * hidden, hidden)
        shapes[p + "mlp.up_proj.weight"] = (2 * hidden, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, 2 * hidden)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def make_policy(params: int = 1 << 26, seed: int = 0, hidden: int | None = None,
                adam_steps: int = 5) -> SyntheticPolicy:
    g = torch.Generator().manual_seed(seed)
    master, direction = {}, {}
    for name, shape in layer_shapes(params, hidden).items():
        if "norm" in name:
            w = 1.0 + 0.05 * torch.randn(shape, generator=g)
        else:
            w = 0.02 * torch.randn(shape, generator=g)
        m = torch.zeros(shape)
        v = torch.zeros(shape)
        for _ in range(adam_steps):
            grad = torch.randn(shape, generator=g)
            m.mul_(0.9).add_(grad, alpha=0.1)
            v.mul_(0.999).addcmul_(grad, grad, value=0.001)
        m_hat = m / (1 - 0.9**adam_steps)
        v_hat = v / (1 - 0.999**adam_steps)
        master[name] = w
        direction[name] = m_hat / (v_hat.sqrt() + 1e-8)
    return SyntheticPolicy(master, direction)
