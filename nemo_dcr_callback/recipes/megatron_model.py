"""A tiny Llama-style megatron-core GPT for tests, demos and benchmarks (CPU or GPU).

Built with the local layer spec (RMSNorm, SwiGLU, RoPE, grouped-query attention, no
biases), the shape of Llama / Qwen / Mistral checkpoints. `hf_config` gives the matching
transformers LlamaConfig, so a Hugging Face model built from it is the receiver.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TinyGPTConfig:
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    vocab_size: int = 250  # the tokenizer's; Megatron pads it (see padded_vocab)
    make_vocab_size_divisible_by: int = 64
    seq_length: int = 32
    tie_word_embeddings: bool = False
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5
    params_dtype: str = "bfloat16"
    init_method_std: float = 0.02
    add_qkv_bias: bool = False  # Qwen2's attention biases (with dcr.family=qwen2)
    # mixtures of experts (megatron-core's names; None: a dense MLP)
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    qk_layernorm: bool = False
    # multi-head latent attention (DeepSeek-V3)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = 32
    kv_lora_rank: int = 16
    qk_head_dim: int = 16
    qk_pos_emb_head_dim: int = 8
    v_head_dim: int = 16


    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.params_dtype)


def padded_vocab(cfg: TinyGPTConfig, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of make_vocab_size_divisible_by * TP."""
    m = cfg.make_vocab_size_divisible_by * tp
    return ((cfg.vocab_size + m - 1) // m) * m


def _moe_fields(cfg: TinyGPTConfig, tp: int) -> dict:
    from megatron.core import parallel_state as ps

    if not cfg.num_moe_experts:
        return {}
    return dict(
        num_moe_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_layer_freq=[0] * cfg.moe_first_dense_layers + [1] * (cfg.num_layers - cfg.moe_first_dense_layers),
        moe_router_score_function=cfg.moe_router_score_function,
        moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
        moe_router_num_groups=cfg.moe_router_num_groups, moe_router_group_topk=cfg.moe_router_group_topk,
        moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
        # allgather: the dispatcher gloo runs as is; no capacity, jitter or fusions (deterministic)
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_permute_fusion=False,
        moe_grouped_gemm=False, expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        sequence_parallel=tp > 1,  # megatron-core trains MoE with TP only so
    )


def _mla_fields(cfg: TinyGPTConfig) -> dict:
    if not cfg.multi_latent_attention:
        return {}
    return dict(multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
                v_head_dim=cfg.v_head_dim, rope_type="rope", rotary_base=cfg.rotary_base)


def transformer_config(cfg: TinyGPTConfig, tp: int, pp: int):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    dt = cfg.torch_dtype
    cls = MLATransformerConfig if cfg.multi_latent_attention else TransformerConfig
    return cls(
        **_moe_fields(cfg, tp), **_mla_fields(cfg), qk_layernorm=cfg.qk_layernorm or cfg.multi_latent_attention,
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        use_cpu_initialization=True, params_dtype=dt, pipeline_dtype=dt, bf16=dt == torch.bfloat16,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=cfg.norm_eps,
        add_bias_linear=False, add_qkv_bias=cfg.add_qkv_bias, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=cfg.init_method_std,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
    )


# The 2-layer model of the multi-process S3 and fault tests (vocab 256: no padding at TP 2).
TEST_GPT = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2,
                vocab_size=256)


def build_model(cfg: TinyGPTConfig, seed: int = 1234):
    """The GPTModel for this rank's pipeline stage (parallel state must be initialised)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    torch.manual_seed(seed)
    if torch.cuda.is_available():  # the tracker that attention dropout forks (megatron_cpu stubs it on CPU)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    tcfg = transformer_config(cfg, tp, pp)
    if cfg.multi_latent_attention or cfg.moe_first_dense_layers:  # layers that differ: a block spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        from nemo_dcr_callback.recipes.megatron_cpu import SDPACoreAttention

        spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm")
        if cfg.multi_latent_attention:  # (the local spec's core attention cannot take MLA's head dims)
            for ls in spec.layer_specs:
                ls.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    else:
        spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False,
                                        qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
    return GPTModel(
        tcfg, spec,
        vocab_size=padded_vocab(cfg, tp), max_sequence_length=cfg.seq_length,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=cfg.tie_word_embeddings, position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
    )


# Each placement family's Hugging Face config: its transformers config class, its model class
# (config.json's `architectures`, which serving engines such as vLLM pick the model by) and
# the fields beyond the ones every family shares. A keyframe's config.json comes from here, so
# engines load it with no hand edits. llama-zc is served as Llama: its norms are converted.
def _dense(cfg: TinyGPTConfig) -> dict:
    return dict(num_key_value_heads=cfg.num_query_groups, intermediate_size=cfg.ffn_hidden_size)


def _qwen3(cfg: TinyGPTConfig) -> dict:
    return dict(_dense(cfg), head_dim=cfg.hidden_size // cfg.num_attention_heads, attention_bias=False)


def _qwen3_moe(cfg: TinyGPTConfig) -> dict:
    return dict(_qwen3(cfg), moe_intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                num_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[])


def _mixtral(cfg: TinyGPTConfig) -> dict:
    return dict(num_key_value_heads=cfg.num_query_groups, head_dim=cfg.hidden_size // cfg.num_attention_heads,
                intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk)


def _deepseek_v3(cfg: TinyGPTConfig) -> dict:
    moe_f = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    return dict(num_key_value_heads=cfg.num_attention_heads, intermediate_size=cfg.ffn_hidden_size,
                moe_intermediate_size=moe_f, n_routed_experts=cfg.num_moe_experts,
                n_shared_experts=(cfg.moe_shared_expert_intermediate_size or 0) // moe_f,
                num_experts_per_tok=cfg.moe_router_topk, n_group=cfg.moe_router_num_groups or 1,
                topk_group=cfg.moe_router_group_topk or 1, first_k_dense_replace=cfg.moe_first_dense_layers,
                q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
                qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
                routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0, norm_topk_prob=True,
                rope_interleave=True)


def _llama(cfg: TinyGPTConfig) -> dict:
    return dict(_dense(cfg), attention_bias=False, mlp_bias=False)


HF_FAMILIES: dict[str, tuple[str, str, Callable[[TinyGPTConfig], dict]]] = {
    # family: (transformers config class, model class, family fields)
    "llama": ("LlamaConfig", "LlamaForCausalLM", _llama),
    "llama-zc": ("LlamaConfig", "LlamaForCausalLM", _llama),
    "mistral": ("MistralConfig", "MistralForCausalLM", lambda cfg: dict(_dense(cfg), sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _dense),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _qwen3),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _qwen3_moe),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", _mixtral),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _deepseek_v3),
}


# What the family's Hugging Face model always has, so the Megatron model must have it too (else
# the keyframe lacks tensors its engines expect): TinyGPTConfig fields that must be set.
HF_REQUIRES: dict[str, tuple[str, ...]] = {
    "qwen2": ("add_qkv_bias",),
    "qwen3": ("qk_layernorm",),
    "qwen3_moe": ("qk_layernorm", "num_moe_experts"),
    "mixtral": ("num_moe_experts",),
    "deepseek_v3": ("multi_latent_attention", "num_moe_experts", "moe_router_enable_expert_bias"),
}

# The Hydra overrides that give each of those, with what megatron-core then also needs (the
# example sizes are the tests' tiny ones): a refusal names exactly what to type.
HF_REQUIRES_OVERRIDES: dict[str, tuple[tuple[str, str], ...]] = {
    "add_qkv_bias": (("add_qkv_bias", "true"),),
    "qk_layernorm": (("qk_layernorm", "true"),),
    "num_moe_experts": (("num_moe_experts", "4"), ("moe_ffn_hidden_size", "32")),
    "multi_latent_attention": (("multi_latent_attention", "true"),),
    # megatron-core takes the expert bias only with the sigmoid router
    "moe_router_enable_expert_bias": (("moe_router_enable_expert_bias", "true"),
                                      ("moe_router_score_function", "sigmoid")),
}


def _in_yaml(field: str) -> bool:
    """Is model.<field> a key of the packaged train_gpt.yaml (else Hydra needs `+` to add it)?"""
    from importlib.resources import files

    text = (files("nemo_dcr_callback") / "configs" / "train_gpt.yaml").read_text()
    return f"\n  {field}:" in text


def required_overrides(cfg: TinyGPTConfig, family: str) -> list[str]:
    """The Hydra overrides a training run of `family` still needs, `+` included where the key
    is not in the packaged config (empty: none)."""
    out: list[str] = []
    for f in HF_REQUIRES.get(family, ()):
        if not getattr(cfg, f):
            out += [f"{'' if _in_yaml(k) else '+'}model.{k}={v}" for k, v in HF_REQUIRES_OVERRIDES[f]
                    if str(getattr(cfg, k)).lower() != v]
    return list(dict.fromkeys(out))


def hf_config(cfg: TinyGPTConfig, family: str = "llama"):
    """The transformers config of the model's family (the receiver's), with `architectures`."""
    import transformers  # start-up cost: only where a keyframe's config is written

    if family not in HF_FAMILIES:
        raise ValueError(f"no Hugging Face config for family {family!r} (have {sorted(HF_FAMILIES)})")
    unset = [f for f in HF_REQUIRES.get(family, ()) if not getattr(cfg, f)]
    if unset:
        raise ValueError(f"family {family}: its Hugging Face model has what model.{unset[0]} makes; add these "
                         f"overrides: {' '.join(required_overrides(cfg, family))}")
    config_class, model_class, fields = HF_FAMILIES[family]
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_attention_heads, max_position_embeddings=max(cfg.seq_length, 64),
                  rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rotary_base, tie_word_embeddings=cfg.tie_word_embeddings,
                  torch_dtype=cfg.params_dtype, architectures=[model_class])
    return getattr(transformers, config_class)(**common, **fields(cfg))


def wrap_for_training(model, lr: float = 1e-3, distributed_optimizer: bool = False, seed: int = 1234):
    """Megatron DDP (contiguous BF16 param/grad buffers) and a Megatron Adam optimizer."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = model.config
    # As Megatron's training loop does: reduce grads across DP (and tied embeddings across
    # the first and last pipeline stages) at the end of each schedule.
    cfg.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                           use_distributed_optimizer=distributed_optimizer),
        model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, bf16=cfg.bf16, params_dtype=cfg.params_dtype,
                        use_distributed_optimizer=distributed_optimizer, clip_grad=1.0, adam_eps=1e-8),
        [ddp])
    return ddp, opt


def train_step(ddp, opt, tokens: torch.Tensor, cfg: TinyGPTConfig) -> float | None:
    """One optimizer step on a batch of token ids [micro_batches, batch, seq + 1] through the
    pipeline schedule. Returns the mean loss on the last stage (None elsewhere)."""
    micro, batch, seq1 = tokens.shape
    seq = seq1 - 1
    data = iter([tokens[i] for i in range(micro)])

    def forward_step(data_iterator, model):
        t = next(data_iterator)
        inp, labels = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        pos = torch.arange(seq, device=inp.device).unsqueeze(0).expand(batch, -1)  # (on the batch's device)
        out = model(inp, pos, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    return run_schedule(ddp, opt, forward_step, data, micro, seq, batch)


def run_schedule(ddp, opt, forward_step, data, micro: int, seq: int, batch: int,
                 collect: list | None = None) -> float | None:
    """Forward and backward of `micro` micro-batches through Megatron's pipeline schedule, then
    the optimizer step; the mean of the losses' "loss" on the last stage (None elsewhere).
    `collect` receives each micro-batch's reported dict (the last stage's)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from nemo_dcr_callback.recipes.megatron_cpu import gemm_mode

    ddp.zero_grad_buffer()
    opt.zero_grad()
    with gemm_mode():  # bf16 GEMMs through fp32 on CPUs without AVX-512 (see megatron_cpu)
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=[ddp], num_microbatches=micro,
            seq_length=seq, micro_batch_size=batch, forward_only=False)
    ok, _, _ = opt.step()
    if not ok:
        raise RuntimeError("optimizer step skipped (overflow)")
    if collect is not None:
        collect.extend(losses or [])
    if ps.is_pipeline_last_stage() and losses:
        return float(sum(x["loss"] for x in losses) / len(losses))
    return None
