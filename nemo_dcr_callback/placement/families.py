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

Mixtures of experts: an `expert` rule's Megatron tensor has an expert axis (SequentialMLP's
sharded `mlp.experts.experts.*`: global [layers, experts, rows, cols]); "{expert}" in its
names is the global expert index, so each expert's rows land in its own canonical tensors
(Hugging Face checkpoints store experts one per tensor). Expert parameters are replicated
over expert-data-parallel ranks, not data-parallel ones (maps.py splits them accordingly).
Layers that are not all alike (DeepSeek's first dense layers) have per-layer keys
("decoder.layers.3.mlp...."): the layer index is taken out of the key before the lookup.

`dtype` names a canonical dtype other than the checkpoint's (an fp32 router bias stays fp32).

`transform` marks params whose canonical values are not a bit copy of the training values
(for example zero-centred gamma, served as value + 1): they take the residual path.
"""

from __future__ import annotations

import re
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
    expert: bool = False  # the Megatron tensor has an expert axis; "{expert}" in hf
    dtype: str | None = None  # canonical dtype, if not the checkpoint's (e.g. "float32")


@dataclass(frozen=True)
class Family:
    name: str
    rules: tuple[Rule, ...]
    by_key: dict[str, Rule] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "by_key", {r.megatron: r for r in self.rules})

    def rule(self, key: str) -> Rule:
        return self.lookup(key)[0]

    def lookup(self, key: str) -> tuple[Rule, int | None]:
        """The rule of a sharded key, and the layer index if the key names one (per-layer keys
        of models whose layers differ)."""
        layer = None
        m = _LAYER_KEY.match(key)
        if m:
            layer, key = int(m.group(2)), m.group(1) + m.group(3)
        if key not in self.by_key:
            raise KeyError(f"family {self.name!r} has no rule for Megatron key {key!r}")
        return self.by_key[key], layer


_LAYER_KEY = re.compile(r"^(decoder\.layers\.)(\d+)\.(.*)$")


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

# ------------------------------------------------------------------ mixtures of experts
_E = _L + "mlp.experts.{expert}."
_ROUTED = (
    Rule("decoder.layers.mlp.router.weight", (_L + "mlp.gate.weight",)),
    Rule("decoder.layers.mlp.experts.experts.linear_fc1.weight", (_E + "gate_proj.weight", _E + "up_proj.weight"),
         MapKind.GATED, expert=True),
    Rule("decoder.layers.mlp.experts.experts.linear_fc2.weight", (_E + "down_proj.weight",), expert=True),
)
QWEN3_MOE = Family("qwen3_moe", QWEN3.rules + _ROUTED)

_X = _L + "block_sparse_moe.experts.{expert}."
MIXTRAL = Family("mixtral", _LLAMA_RULES + (
    Rule("decoder.layers.mlp.router.weight", (_L + "block_sparse_moe.gate.weight",)),
    Rule("decoder.layers.mlp.experts.experts.linear_fc1.weight", (_X + "w1.weight", _X + "w3.weight"),
         MapKind.GATED, expert=True),
    Rule("decoder.layers.mlp.experts.experts.linear_fc2.weight", (_X + "w2.weight",), expert=True),
))

# DeepSeek-V3: multi-head latent attention (local spec names: its norms keep their module
# names), dense first layers, routed experts with a shared expert, and the router's score
# correction bias (Megatron's expert_bias, an fp32 buffer; Hugging Face keeps it fp32).
_A = _L + "self_attn."
DEEPSEEK_V3 = Family("deepseek_v3", (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), MapKind.VOCAB),
    Rule("decoder.layers.input_layernorm.weight", (_L + "input_layernorm.weight",)),
    Rule("decoder.layers.pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",)),
    Rule("decoder.layers.self_attention.linear_q_down_proj.weight", (_A + "q_a_proj.weight",)),
    Rule("decoder.layers.self_attention.q_layernorm.weight", (_A + "q_a_layernorm.weight",)),
    Rule("decoder.layers.self_attention.linear_q_up_proj.weight", (_A + "q_b_proj.weight",)),
    Rule("decoder.layers.self_attention.linear_q_proj.weight", (_A + "q_proj.weight",)),  # q_lora_rank None
    Rule("decoder.layers.self_attention.linear_kv_down_proj.weight", (_A + "kv_a_proj_with_mqa.weight",)),
    Rule("decoder.layers.self_attention.kv_layernorm.weight", (_A + "kv_a_layernorm.weight",)),
    Rule("decoder.layers.self_attention.linear_kv_up_proj.weight", (_A + "kv_b_proj.weight",)),
    Rule("decoder.layers.self_attention.linear_proj.weight", (_A + "o_proj.weight",)),
    Rule("decoder.layers.mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
         MapKind.GATED),
    Rule("decoder.layers.mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",)),
    # transformers keeps the router in fp32 (DeepseekV3's _keep_in_fp32_modules_strict): its
    # canonical values are the bf16 weights cast up, sent the residual way
    Rule("decoder.layers.mlp.router.weight", (_L + "mlp.gate.weight",), dtype="float32"),
    *_ROUTED[1:],
    Rule("decoder.layers.mlp.router.expert_bias", (_L + "mlp.gate.e_score_correction_bias",), dtype="float32"),
    Rule("decoder.layers.mlp.shared_experts.linear_fc1.weight",
         (_L + "mlp.shared_experts.gate_proj.weight", _L + "mlp.shared_experts.up_proj.weight"), MapKind.GATED),
    Rule("decoder.layers.mlp.shared_experts.linear_fc2.weight", (_L + "mlp.shared_experts.down_proj.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), MapKind.VOCAB, tied_skip=True),
))

FAMILIES = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, LLAMA_ZERO_CENTERED, QWEN3_MOE, MIXTRAL, DEEPSEEK_V3)}
