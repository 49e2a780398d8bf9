"""Canonical (checkpoint) tensors as views into a transformers model's own parameters.

transformers 5 keeps a mixture's experts fused in memory (`mlp.experts.gate_up_proj`
[experts, 2 * ffn, hidden], `mlp.experts.down_proj` [experts, hidden, ffn]) while its
checkpoints, and so this project's canonical names, hold one tensor per expert
(`mlp.experts.{e}.gate_proj.weight`, ...; Mixtral's `block_sparse_moe.experts.{e}.w1`). Each
such tensor is a contiguous block of the fused parameter: a view, so a StateDictTarget over
these views updates the live model in place. The table says which block; a family whose
memory names equal its checkpoint's needs none.
"""

from __future__ import annotations

import re

import torch

# canonical name pattern (groups: layer, expert) -> (in-memory parameter, part, parts): expert
# e's tensor is part `part` of `parts` equal row blocks of param[e] (gate rows, then up rows)
_FUSED = "model.layers.{0}.mlp.experts."
_EXPERTS = (
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight", _FUSED + "gate_up_proj", 0, 2),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight", _FUSED + "gate_up_proj", 1, 2),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight", _FUSED + "down_proj", 0, 1),
)
_MIXTRAL = (
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight",
     _FUSED + "gate_up_proj", 0, 2),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight",
     "model.layers.{0}.mlp.experts.gate_up_proj", 1, 2),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight",
     _FUSED + "down_proj", 0, 1),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight", "model.layers.{0}.mlp.gate.weight", None, None),
)
MEMORY_LAYOUTS: dict[str, tuple] = {"qwen3_moe": _EXPERTS, "deepseek_v3": _EXPERTS, "qwen2_moe": _EXPERTS,
                                    "mixtral": _MIXTRAL}


def canonical_views(model: torch.nn.Module, names) -> dict[str, torch.Tensor]:
    """name -> the model's tensor (or a view of its fused expert parameter) for each canonical
    name; an error names the first one the model does not hold."""
    own = model.state_dict(keep_vars=True)
    rules = [(re.compile(p), t, k, n) for p, t, k, n in MEMORY_LAYOUTS.get(model.config.model_type, ())]
    out = {}
    for name in names:
        if name in own:
            out[name] = own[name].data
            continue
        for rx, template, part, parts in rules:
            m = rx.fullmatch(name)
            if m is None:
                continue
            fused = own[template.format(*m.groups())].data
            if part is None:  # a rename
                out[name] = fused
            else:
                block = fused[int(m.group(2))]
                rows = block.shape[0] // parts
                out[name] = block[part * rows:(part + 1) * rows]
            break
        else:
            raise KeyError(f"{type(model).__name__} holds no tensor for {name!r}")
    return out
