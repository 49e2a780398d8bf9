"""Issue 34: the training entry point with a mixture of experts. scripts/train.py's recipe
(Lightning + megatron-core + the DCR callback) takes megatron-core's own names as Hydra
overrides (model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size,
parallel.expert_model_parallel_size, dcr.family); with dcr.verify every version is followed
by a receiver on rank 0 and compared bit for bit with the dense export (gather, convert)."""

from __future__ import annotations

import re
import subprocess

from nemo_dcr_callback.launcher import torchrun_cmd

STEPS = 3
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.vocab_size=256", "model.seq_length=16", "optimizer.lr=1e-3"]


def test_qwen3_moe_ep2_training_verifies_every_version(tmp_path):
    cmd = torchrun_cmd(2, ["-m", "nemo_dcr_callback.recipes.train", f"hydra.run.dir={tmp_path / 'run'}", *TINY,
                           "model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
                           "model.qk_layernorm=true", "parallel.expert_model_parallel_size=2",
                           "dcr.family=qwen3_moe", f"dcr.store=file://{tmp_path / 'store'}", "dcr.verify=true",
                           f"trainer.max_steps={STEPS}"])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    done = re.findall(r"dcr: version (\d+): the store's chain is bit-exact with the dense export \((\d+) tensors",
                      p.stdout)
    assert [int(v) for v, _ in done] == list(range(1, STEPS + 1)), p.stdout[-3000:]
    assert int(done[0][1]) == 45  # 2 layers x (4 experts x 3 + router + 7 attention/norm tensors) + 3
