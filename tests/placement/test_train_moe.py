"""Issue 34: the training entry point with a mixture of experts. scripts/train.py's recipe
(Lightning + megatron-core + the DCR callback) takes megatron-core's own names as Hydra
overrides (model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size,
parallel.expert_model_parallel_size, dcr.family); with dcr.verify every version is followed
by a receiver on rank 0 and compared bit for bit with the dense export (gather, convert)."""

from __future__ import annotations

import subprocess

import pytest
from safetensors import safe_open

from nemo_dcr_callback.launcher import torchrun_cmd
from nemo_dcr_callback.protocol import keys
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers import training

STEPS = 3
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.vocab_size=256", "model.seq_length=16", "optimizer.lr=1e-3"]


@pytest.mark.slow  # (about 17 s; make test keeps the MoE refit)
def test_qwen3_moe_ep2_training_verifies_every_version(tmp_path):
    cmd = torchrun_cmd(2, ["-m", "nemo_dcr_callback.recipes.train", f"hydra.run.dir={tmp_path / 'run'}", *TINY,
                           "model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
                           "model.qk_layernorm=true", "parallel.expert_model_parallel_size=2",
                           "dcr.family=qwen3_moe", f"dcr.store=file://{tmp_path / 'store'}", "dcr.verify=true",
                           f"trainer.max_steps={STEPS}"])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    done = training.verified(p.stdout)
    assert [v for v, _, _ in done] == list(range(1, STEPS + 1)), p.stdout[-3000:]
    # bit-exact alone would pass with frozen weights: every version changed elements, as the
    # verify replay counted them and as the store's version records say
    assert all(c > 0 for _, _, c in done), done
    store = FileStore(tmp_path / "store")
    assert all(c > 0 for c in training.changed(store, range(1, STEPS + 1)).values())
    # the canonical tensors of the keyframe (the dense export): qwen3_moe's Hugging Face names
    with safe_open(str(tmp_path / "store" / keys.keyframe_model(0)), "pt") as f:
        names = set(f.keys())
    assert names == _qwen3_moe_names(layers=2, experts=4), sorted(names ^ _qwen3_moe_names(2, 4))
    # 2 layers x (4 experts x 3 + router + 8 attention/norm tensors) + 3 = 45
    assert all(n == len(names) == 45 for _, n, _ in done), done


def _qwen3_moe_names(layers: int, experts: int) -> set[str]:
    """Hugging Face Qwen3-MoE names: per layer 8 attention and norm tensors (input and
    post-attention layernorms, q/k/v/o projections, q_norm, k_norm), the router (mlp.gate)
    and 3 per expert (gate, up, down); then embeddings, final norm and an untied lm_head."""
    out = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(layers):
        pre = f"model.layers.{i}."
        out |= {pre + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                  "mlp.gate.weight")}
        out |= {f"{pre}mlp.experts.{e}.{w}_proj.weight" for e in range(experts) for w in ("gate", "up", "down")}
    return out
