"""What TRL's AsyncGRPOTrainer needs on a CPU with no hub, for tests/integrations/trl: a tiny
Llama with a byte-level tokenizer and a chat template TRL recognises, a reward function the
rollout worker's spawned child can import, and a CPU stand-in for the one GPU-only kernel."""

from __future__ import annotations

import importlib.resources
import types
from pathlib import Path

import torch

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
VOCAB = 320  # 256 bytes, the specials, reserved tokens up to a multiple of 64


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def tiny_checkpoint(path: Path) -> Path:
    """A random BF16 Llama (vLLM serves it; the hub is out of reach) and its tokenizer, whose
    chat template is TRL's own Qwen2.5 one: TRL's rollout worker renders prompts with it and
    knows how to parse its responses (add_response_schema refuses templates it does not know)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB - 256 - len(SPECIALS))]
    template = importlib.resources.files("trl").joinpath("chat_templates/qwen2_5.jinja").read_text()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=SPECIALS[:1] + reserved)
    hf.chat_template = template
    assert len(hf) == VOCAB, len(hf)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id,
                         bos_token_id=None)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id)
    model.save_pretrained(path)
    hf.save_pretrained(path)
    return path


def mean_token_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """Varies between any two different completions, so every group has advantages to learn
    from (module level: TRL pickles reward functions into its spawned rollout worker)."""
    return [sum(ids) / (VOCAB * max(len(ids), 1)) for ids in completion_ids]


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                      causal=True, window_size=(-1, -1), **kwargs):
    """flash_attn_varlen_func's semantics in plain torch: each segment's queries attend to its
    keys, causally aligned bottom-right (a segment is the tail of its root-to-segment path)."""
    assert causal and tuple(window_size) == (-1, -1), "only what Llama's tree attention asks for"
    out = []
    rep = q.shape[1] // k.shape[1]  # grouped-query attention: each KV head serves `rep` query heads
    for s in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[s]:cu_seqlens_q[s + 1]].transpose(0, 1)
        ks = k[cu_seqlens_k[s]:cu_seqlens_k[s + 1]].transpose(0, 1).repeat_interleave(rep, 0)
        vs = v[cu_seqlens_k[s]:cu_seqlens_k[s + 1]].transpose(0, 1).repeat_interleave(rep, 0)
        lq, lk = qs.shape[1], ks.shape[1]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                                    scale=softmax_scale).transpose(0, 1))
    return torch.cat(out)


def cpu_flash_attn() -> types.SimpleNamespace:
    """Stands in for TRL's `packing._flash_attn()`, which fetches FlashAttention-3 from the
    hub: a CUDA kernel this machine can neither download nor run."""
    return types.SimpleNamespace(flash_attn_varlen_func=_varlen_attention)
