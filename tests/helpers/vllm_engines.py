"""vLLM engines for the tests in tests/integrations/vllm (run in .venv-vllm by `make test-vllm`;
this module imports vLLM: import it after `pytest.importorskip("vllm")`). A tiny transformers
model's dense checkpoints per version (the oracle: vLLM's own full load of each), engines with
the DCR worker extension, greedy generation, and stopping an engine now."""

from __future__ import annotations

import torch
import vllm

EXT = "nemo_dcr_callback.integrations.vllm.DCRWorkerExtension"
VERSIONS = 3  # dense_versions' versions after version 0
PROMPTS = [{"prompt_token_ids": [1, 5, 9, 33, 2, 71]}, {"prompt_token_ids": [7, 7, 100, 3]}]


def dense_versions(tmp_path, family: str = "llama", versions: int = VERSIONS, adam: float = 0.0):
    """llama: untied embeddings, GQA; qwen2: QKV biases, tied embeddings, a vocabulary vLLM
    pads (500 -> 512 rows, the padding zeroed by its loader)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, tie_word_embeddings=False, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=500, tie_word_embeddings=True, **common))
    model = model.to(torch.bfloat16)
    if family != "llama":
        with torch.no_grad():  # (transformers initialises biases to zero: give them bits to change)
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.normal_(0, 0.02)
    dirs = []
    g = torch.Generator().manual_seed(1)
    # the canonical tensors are the checkpoint's (a tied lm_head is not one of them)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    states = [{k: v.clone() for k, v in model.state_dict().items() if k not in tied}]
    for v in range(versions + 1):
        if v:
            nxt = optimizer_step(states[-1], g, adam)
            states.append(nxt)
            model.load_state_dict(nxt, strict=not tied)
        d = tmp_path / f"v{v}"
        model.save_pretrained(d)
        dirs.append(d)
    return states, dirs


def optimizer_step(state: dict[str, torch.Tensor], g: torch.Generator, adam: float = 0.0) -> dict[str, torch.Tensor]:
    """An optimizer-like step: 3% of every tensor's values scaled by 1 +- 5%; adam > 0 also
    moves every value by that much (an Adam-like step: it carries only the smallest values past
    half an ulp, so a value changes the more likely the smaller it is, which context coding
    exploits; 1e-6: about 5% changed in all)."""
    nxt = {}
    for k, t in state.items():
        x = t.float()
        m = torch.rand(t.shape, generator=g) < 0.03
        x[m] *= 1 + 0.05 * torch.randn(int(m.sum()), generator=g)
        if adam:
            x += adam * torch.sign(torch.randn(t.shape, generator=g))
        nxt[k] = x.to(t.dtype)
    return nxt


def start_engine(model_dir, max_model_len: int = 128, tp: int = 1):
    return vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                    max_model_len=max_model_len, worker_extension_cls=EXT, seed=0, tensor_parallel_size=tp,
                    gpu_memory_utilization=0.1)  # (on CPU: a share of RAM, free at start; two engines run at once)


def generate(llm):
    out = llm.generate(PROMPTS, vllm.SamplingParams(max_tokens=8, temperature=0, logprobs=2), use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in out]


def stop_engine(llm) -> None:
    """Stop the engine's processes now (not whenever the last reference goes): the next
    engine's start checks that enough memory is free."""
    import gc

    llm.llm_engine.engine_core.shutdown()
    gc.collect()
