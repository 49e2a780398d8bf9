"""Model families as declarative tables: Megatron sharded key -> Hugging Face name(s), with
a mapping kind. The engine in maps.py interprets them; a new family is a new table.

Kinds (how rows of Megatron's global tensor land in the canonical tensors; columns follow
unchanged, so TP column splits are an offset and a row stride):
- PLAIN: same shape, row for row (norms, o_proj / down_proj, which TP splits by column).
- VOCAB: embedding / output layer: rows past the real vocabulary are Megatron's padding
  and belong to no canonical tensor.
- QKV: linear_qkv rows are, per query group, [q rows of the group's heads, k, v]; split
  into q_proj / k_proj / v_proj (grouped-query interleave).
- GATED: linear_fc1 is [gate; up] globally, and each TP rank holds [gate_r; up_r].

`transform` marks params whose canonical values are not a bit copy of the training values
(for example zero-centred gamma, served as value + 1): they take the residual path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum


class MapKind(Enum):
    PLAIN = "plain"
    VOCAB = "vocab"
    QKV = "qkv"
    GATED = "gated"


@dataclass(frozen=True)
class Rule:
    megatron: str  # sharded-state-dict key (layer-stacked keys carry no layer index)
    hf: tuple[str, ...]  # canonical name(s); "{layer}" is the global layer index
    kind: MapKind = MapKind.PLAIN
    transform: str | None = None  # None (bit copy) or "plus_one" (zero-centred gamma)
    tied_skip: bool = False  # not a canonical tensor when embeddings are tied


@dataclass(frozen=True)
class Family:
    name: str
    rules: tuple[Rule, ...]
    by_key: dict[str, Rule] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "by_key", {r.megatron: r for r in self.rules})

    def rule(self, key: str) -> Rule:
        if key not in self.by_key:
            raise KeyError(f"family {self.name!r} has no rule for Megatron key {key!r}")
        return self.by_key[key]


_L = "model.layers.{layer}."
_LLAMA_RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), MapKind.VOCAB),
    Rule("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (_L + "input_layernorm.weight",)),
    Rule("decoder.layers.self_attention.linear_qkv.weight",
         (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
         MapKind.QKV),
    Rule("decoder.layers.self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",)),
    Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight", (_L + "post_attention_layernorm.weight",)),
    Rule("decoder.layers.mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
         MapKind.GATED),
    Rule("decoder.layers.mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), MapKind.VOCAB, tied_skip=True),
)

LLAMA = Family("llama", _LLAMA_RULES)
MISTRAL = Family("mistral", _LLAMA_RULES)
QWEN2 = Family("qwen2", _LLAMA_RULES + (
    Rule("decoder.layers.self_attention.linear_qkv.bias",
         (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"), MapKind.QKV),
))
QWEN3 = Family("qwen3", _LLAMA_RULES + (
    Rule("decoder.layers.self_attention.q_layernorm.weight", (_L + "self_attn.q_norm.weight",)),
    Rule("decoder.layers.self_attention.k_layernorm.weight", (_L + "self_attn.k_norm.weight",)),
))

# Megatron trained with zero-centred gamma (apply_layernorm_1p), served as a Llama checkpoint
# whose norm weights are gamma + 1: the norms take the residual path.
_NORMS = {"decoder.layers.self_attention.linear_qkv.layer_norm_weight",
          "decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.final_layernorm.weight"}
LLAMA_ZERO_CENTERED = Family("llama-zc", tuple(replace(r, transform="plus_one") if r.megatron in _NORMS else r
                                                for r in _LLAMA_RULES))

FAMILIES = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, LLAMA_ZERO_CENTERED)}
