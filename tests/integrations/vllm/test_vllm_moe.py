"""Issue 34: a mixture of experts in a real vLLM engine (the CPU build runs Qwen3-MoE). vLLM
fuses each layer's experts into w13_weight [experts, 2 * ffn, hidden] and w2_weight; its own
FusedMoE weight loader places the checkpoint's per-expert tensors
(`mlp.experts.{e}.gate_proj.weight`, ...). On CPU vLLM then pads and prepacks both for its
grouped GEMM (fused_moe/experts/cpu_moe.py); the extension keeps the loader-layout weights,
applies there and packs the changed layers again with vLLM's own code. Oracle: a fresh engine
loaded from the last version's dense checkpoint: the same parameters bit for bit (vLLM's
packed tensors included) and the same greedy tokens and logprobs."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (make test-vllm builds .venv-vllm)")

import torch  # noqa: E402

from tests.helpers.vllm_engines import generate, optimizer_step, start_engine, stop_engine  # noqa: E402

VERSIONS = 2


def _states(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         max_position_embeddings=256)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    dirs = [tmp_path / "v0"]
    model.save_pretrained(dirs[0])
    from safetensors.torch import load_file

    states = [load_file(str(dirs[0] / "model.safetensors"))]  # the checkpoint's names: one tensor per expert
    g = torch.Generator().manual_seed(1)
    for v in range(1, VERSIONS + 1):
        nxt = optimizer_step(states[-1], g)
        states.append(nxt)
        d = tmp_path / f"v{v}"
        d.mkdir()
        for f in dirs[0].iterdir():
            if f.suffix == ".json":
                (d / f.name).write_bytes(f.read_bytes())
        from safetensors.torch import save_file

        save_file(nxt, str(d / "model.safetensors"), metadata={"format": "pt"})
        dirs.append(d)
    return states, dirs


def test_qwen3_moe_engine_follows_bit_exact(tmp_path):
    from nemo_dcr_callback.testing.tensor_sender import publish
    from nemo_dcr_callback.transport.store import FileStore

    states, dirs = _states(tmp_path)
    assert sum(".experts." in k for k in states[0]) == 2 * 8 * 3
    store = FileStore(tmp_path / "store")
    a = start_engine(dirs[0])
    assert a.collective_rpc("dcr_attach", args=(store.url,)) == [0]
    for v in range(1, VERSIONS + 1):
        publish(store, v, v - 1, states[v - 1], states[v])
        got = a.collective_rpc("dcr_update")[0]
        assert got["version"] == v and got["refused"] is None, got["refused"]
    a.reset_prefix_cache()
    b = start_engine(dirs[VERSIONS])
    pa, pb = a.collective_rpc("dcr_params")[0], b.collective_rpc("dcr_params")[0]
    assert any("w13_weight" in n for n in pa)
    assert [n for n in pb if pa.get(n) != pb[n]] == [], "parameters differ from a fresh load"
    assert generate(a) == generate(b), "generation differs from a fresh load"
    stop_engine(b)
    stop_engine(a)
