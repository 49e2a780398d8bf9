#!/usr/bin/env python
"""What a receiver could condition a position's change on, beyond the old exponent (issue 48).

Real AdamW steps on the corpus's Qwen2-shaped model (nemo_dcr_callback/bench/corpus.py: a
fixed token walk, 6 warm-up steps at 1e-3), then three consecutive versions at one learning
rate. For the last version it prints the binary entropy of "changed" per position given the
old exponent alone and given the exponent and: whether the position changed in the previous
version; the previous version's change density of its row, of its column; this version's own
row density (an oracle no receiver has). Also how often a repeated change keeps its sign.
Deterministic (seeded); docs/PERFORMANCE.md "2026-12-06 (afternoon)" has its table.
  .venv/bin/python scripts/experiments/context_history.py --lr 5e-7 --lr 2e-6 [--json FILE]
"""

from __future__ import annotations

import argparse
import math

import torch

from nemo_dcr_callback.bench import corpus
from nemo_dcr_callback.receiver.targets.hf_memory import canonical_views

BUCKETS = torch.tensor([0.0001, 0.003, 0.01, 0.03, 0.1])  # change densities of a row or column


def versions(lr: float, n: int = 3) -> tuple[list[torch.Tensor], list[torch.Size]]:
    """n + 1 flat BF16 bit snapshots of the model, n AdamW steps at lr apart, and the shapes."""
    torch.manual_seed(0)
    model = corpus._model("dense")
    names = corpus.canonical_names(model)
    views = canonical_views(model, names)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    walk = torch.randint(0, model.config.vocab_size, (4096,), generator=g)

    def step(rate: float) -> None:
        for gr in opt.param_groups:
            gr["lr"] = rate
        s = torch.randint(0, walk.numel() - 65, (8,), generator=g)
        x = torch.stack([walk[a:a + 65] for a in s.tolist()])
        loss = model(input_ids=x[:, :-1], labels=x[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()

    def snap() -> torch.Tensor:
        return torch.cat([views[k].detach().to(torch.bfloat16).reshape(-1).view(torch.int16) for k in names])

    for _ in range(6):
        step(1e-3)
    out = [snap()]
    for _ in range(n):
        step(lr)
        out.append(snap())
    return out, [views[k].shape for k in names]


def entropy(changed: torch.Tensor, keys: torch.Tensor) -> float:
    """Bits per position of `changed` given `keys`: the per-key binary entropy, averaged."""
    _, inv = torch.unique(keys, return_inverse=True)
    cnt = torch.bincount(inv).double()
    p = (torch.bincount(inv, weights=changed.double()) / cnt).clamp(1e-12, 1 - 1e-12)
    return float((cnt * -(p * torch.log2(p) + (1 - p) * torch.log2(1 - p))).sum() / changed.numel())


def densities(changed: torch.Tensor, shapes: list[torch.Size]) -> tuple[torch.Tensor, ...]:
    """Each position's row and column change-density bucket (2-D tensors; 0 elsewhere)."""
    row, col = torch.zeros(changed.numel(), dtype=torch.int64), torch.zeros(changed.numel(), dtype=torch.int64)
    o = 0
    for s in shapes:
        n = math.prod(s)
        if len(s) == 2 and s[0] > 1 and s[1] > 1:
            m = changed[o:o + n].view(s).double()
            row[o:o + n] = torch.bucketize(m.mean(1, keepdim=True).expand(s).reshape(-1), BUCKETS.double())
            col[o:o + n] = torch.bucketize(m.mean(0, keepdim=True).expand(s).reshape(-1), BUCKETS.double())
        o += n
    return row, col


def measure(lr: float) -> dict:
    snaps, shapes = versions(lr)
    a, b, c = snaps[-3], snaps[-2], snaps[-1]
    c1, c2 = a != b, b != c
    exp = (b.to(torch.int64) >> 7) & 0xFF
    row1, col1 = densities(c1, shapes)
    row2, _ = densities(c2, shapes)
    base = entropy(c2, exp)
    both = c1 & c2
    d1 = (b.to(torch.int32) - a.to(torch.int32))[both]
    d2 = (c.to(torch.int32) - b.to(torch.int32))[both]
    return {"lr": lr, "change_rate": c2.double().mean().item(), "h_exponent_mbit": 1e3 * base,
            "h_with_previous_change_mbit": 1e3 * entropy(c2, exp * 2 + c1.to(torch.int64)),
            "h_with_previous_row_density_mbit": 1e3 * entropy(c2, exp * 8 + row1),
            "h_with_previous_column_density_mbit": 1e3 * entropy(c2, exp * 8 + col1),
            "h_with_this_row_density_oracle_mbit": 1e3 * entropy(c2, exp * 8 + row2),
            "p_change_if_changed_before": c2[c1].double().mean().item(),
            "p_change_otherwise": c2[~c1].double().mean().item(),
            "repeats_share_of_changes": both.double().sum().item() / max(int(c2.sum()), 1),
            "repeats_keeping_sign": ((d1 > 0) == (d2 > 0)).double().mean().item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, action="append", help="learning rate of the three versions (repeatable)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = [measure(lr) for lr in a.lr or [5e-7, 2e-6]]
    print(f"{'change':>7} {'H|exp':>7} {'+prev':>7} {'+row':>7} {'+col':>7} {'+row now':>8}  "
          "(mbit per position; + the context named)  P(c|c before) P(c|not)  repeats  sign kept")
    for r in rows:
        h = r["h_exponent_mbit"]
        cols = [r[k] for k in ("h_with_previous_change_mbit", "h_with_previous_row_density_mbit",
                               "h_with_previous_column_density_mbit", "h_with_this_row_density_oracle_mbit")]
        print(f"{100 * r['change_rate']:6.2f}% {h:7.2f} " + " ".join(f"{x:7.2f}" for x in cols)
              + f"  ({', '.join(f'{100 * (1 - x / h):.1f}%' for x in cols)} less)  "
              f"{r['p_change_if_changed_before']:.3f} {r['p_change_otherwise']:.4f}  "
              f"{100 * r['repeats_share_of_changes']:.0f}%  {r['repeats_keeping_sign']:.3f}")
    if a.json:
        from nemo_dcr_callback.bench.results import machine, write_json
        write_json(a.json, {"experiment": "context_history", "rows": rows, "machine": machine()})


if __name__ == "__main__":
    main()
