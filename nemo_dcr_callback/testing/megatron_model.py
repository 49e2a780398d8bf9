"""A tiny Llama-style megatron-core GPT for tests, demos and benchmarks (CPU or GPU).

Built with the local layer spec (RMSNorm, SwiGLU, RoPE, grouped-query attention, no
biases), the shape of Llama / Qwen / Mistral checkpoints. `hf_config` gives the matching
transformers LlamaConfig, so a Hugging Face model built from it is the receiver.
"""

from __future__ import annotations

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


    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.params_dtype)


def padded_vocab(cfg: TinyGPTConfig, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of make_vocab_size_divisible_by * TP."""
    m = cfg.make_vocab_size_divisible_by * tp
    return ((cfg.vocab_size + m - 1) // m) * m


def transformer_config(cfg: TinyGPTConfig, tp: int, pp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dt = cfg.torch_dtype
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        use_cpu_initialization=True, params_dtype=dt, pipeline_dtype=dt, bf16=dt == torch.bfloat16,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=cfg.norm_eps,
        add_bias_linear=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
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
    return GPTModel(
        transformer_config(cfg, tp, pp), get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab(cfg, tp), max_sequence_length=cfg.seq_length,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=cfg.tie_word_embeddings, position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
    )


def hf_config(cfg: TinyGPTConfig):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, max_position_embeddings=max(cfg.seq_length, 64),
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rotary_base, tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=False, mlp_bias=False, torch_dtype=cfg.params_dtype,
    )


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
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro, batch, seq1 = tokens.shape
    seq = seq1 - 1
    data = iter([tokens[i] for i in range(micro)])

    def forward_step(data_iterator, model):
        t = next(data_iterator)
        inp, labels = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        pos = torch.arange(seq).unsqueeze(0).expand(batch, -1)
        out = model(inp, pos, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    from nemo_dcr_callback.testing.megatron_cpu import gemm_mode

    ddp.zero_grad_buffer()
    opt.zero_grad()
    with gemm_mode():  # bf16 GEMMs through fp32 on CPUs without AVX-512 (see megatron_cpu)
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=[ddp], num_microbatches=micro,
            seq_length=seq, micro_batch_size=batch, forward_only=False)
    ok, _, _ = opt.step()
    if not ok:
        raise RuntimeError("optimizer step skipped (overflow)")
    if ps.is_pipeline_last_stage() and losses:
        return float(sum(x["loss"] for x in losses) / len(losses))
    return None
