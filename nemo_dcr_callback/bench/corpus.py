"""A real-gradient corpus of checkpoint pairs, built on the spot (nothing downloaded).

Synthetic deltas (a few large tensors, an even change rate) hide what real checkpoints cost:
hundreds of tensors, norms and biases whose change rate follows their magnitude, and (MoE)
thousands of small expert tensors. Each pair here is the BF16 copy of a transformers model's
fp32 master weights before and after one AdamW step, after a few steps of training on a
fixed token walk; the last step's learning rate is bisected to the target change rate.

- `dense`: a Qwen2-shaped model (QKV biases, norms, untied head), 12 layers, 147 tensors.
- `dense100m`: the same shape at 100M parameters (the refit overhead figure's size).
- `moe`: a Qwen3-MoE-shaped model, 6 layers x 64 experts, 1,152 expert tensors (named as its
  checkpoint names them: one tensor per expert).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Pair:
    kind: str  # "dense" or "moe"
    target: float  # the change rate the last step's learning rate was bisected to
    rate: float  # the change rate reached
    lr: float
    old: dict[str, torch.Tensor]  # canonical name -> BF16 tensor, before the step
    new: dict[str, torch.Tensor]  # after


def _config(kind: str):
    if kind == "dense":
        from transformers import Qwen2Config
        return Qwen2Config(hidden_size=256, intermediate_size=704, num_hidden_layers=12, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=2048, max_position_embeddings=128,
                           tie_word_embeddings=False)
    if kind == "dense100m":  # the size the refit overhead target names
        from transformers import Qwen2Config
        return Qwen2Config(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                           num_key_value_heads=4, vocab_size=16384, max_position_embeddings=128,
                           tie_word_embeddings=False)
    if kind == "moe":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                              num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              num_experts=64, num_experts_per_tok=4, vocab_size=2048,
                              max_position_embeddings=128, tie_word_embeddings=False, decoder_sparse_step=1,
                              mlp_only_layers=[])
    raise ValueError(f"unknown corpus kind {kind!r} (dense, dense100m or moe)")


def _model(kind: str, config=None):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(config if config is not None else _config(kind))


def canonical_names(model) -> list[str]:
    """The checkpoint's tensor names: transformers 5 fuses a mixture's experts in memory, its
    checkpoints hold one tensor per expert."""
    cfg = model.config
    out = []
    for n in model.state_dict():
        if ".mlp.experts." not in n:
            out.append(n)
        elif n.endswith("gate_up_proj"):
            layer = n.split(".")[2]
            for e in range(cfg.num_experts):
                for p in ("gate_proj", "up_proj", "down_proj"):
                    out.append(f"model.layers.{layer}.mlp.experts.{e}.{p}.weight")
    return out


def pairs(kind: str = "dense", rates: tuple[float, ...] = (0.01, 0.04), steps: int = 6, seed: int = 0,
          names_filter=None, config=None) -> list[Pair]:
    """One (old, new) BF16 pair per target change rate, from the same trained state; config
    (a transformers config) in place of the kind's, names_filter to keep some tensors only."""
    from nemo_dcr_callback.receiver.targets.hf_memory import canonical_views

    torch.manual_seed(seed)
    model = _model(kind, config)  # fp32 master weights
    vocab = model.config.vocab_size
    names = [n for n in canonical_names(model) if names_filter is None or names_filter(n)]
    views = canonical_views(model, names)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    walk = torch.randint(0, vocab, (4096,), generator=g)  # a fixed token walk to learn: real gradients

    def batch():
        starts = torch.randint(0, walk.numel() - 65, (8,), generator=g)
        return torch.stack([walk[s:s + 65] for s in starts.tolist()])

    def step(x, lr: float | None = None):
        loss = model(input_ids=x[:, :-1], labels=x[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        if lr is not None:
            for gr in opt.param_groups:
                gr["lr"] = lr
        opt.step()

    for _ in range(steps):
        step(batch())
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt_state = {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
                 for k, v in opt.state_dict()["state"].items()}
    x_last = batch()
    old = {n: views[n].to(torch.bfloat16) for n in names}
    total = sum(t.numel() for t in old.values())

    def trial(lr: float) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(master[n])
        sd = opt.state_dict()
        sd["state"] = {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
                       for k, v in opt_state.items()}
        opt.load_state_dict(sd)
        step(x_last, lr)
        return {n: views[n].detach().to(torch.bfloat16) for n in names}

    def rate_of(new) -> float:
        return sum(int((new[n].view(torch.int16) != old[n].view(torch.int16)).sum()) for n in names) / total

    out = []
    for target in rates:
        lo, hi = 1e-8, 1e-2
        for _ in range(20):  # bisection in log space on the last step's learning rate
            mid = (lo * hi) ** 0.5
            if rate_of(trial(mid)) < target:
                lo = mid
            else:
                hi = mid
        new = trial(hi)
        out.append(Pair(kind, target, rate_of(new), hi, old, new))
    return out


def save(state: dict[str, torch.Tensor], path: Path) -> Path:
    """state as one safetensors file (the corpus's checkpoints, for `nemo-dcr diff`)."""
    from safetensors.torch import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path
