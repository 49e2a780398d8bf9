"""Keyframes as the training recipe publishes them, one per placement family: scripts/train.py
(Lightning + megatron-core + the callback) on one rank for one step, with the model settings
each family's Hugging Face model needs."""

from __future__ import annotations

import subprocess
from pathlib import Path

from nemo_dcr_callback.launcher import torchrun_cmd
from nemo_dcr_callback.protocol import keys

from . import REPO

# head_dim 32: the smallest vLLM's CPU attention takes
TINY = ["model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=352", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.vocab_size=256", "model.seq_length=16"]
MOE = ["model.num_moe_experts=4", "model.moe_ffn_hidden_size=32"]
FAMILY_ARGS = {
    "llama": [],
    "mistral": [],
    "qwen2": ["model.add_qkv_bias=true"],
    "qwen3": ["model.qk_layernorm=true"],
    "qwen3_moe": ["model.qk_layernorm=true", *MOE],
    "mixtral": MOE,
    "deepseek_v3": ["model.multi_latent_attention=true", "model.moe_shared_expert_intermediate_size=32",
                    "model.moe_first_dense_layers=1", "+model.moe_router_enable_expert_bias=true",
                    "+model.moe_router_score_function=sigmoid", *MOE],
}


def publish_keyframe(tmp_path: Path, family: str) -> Path:
    """The recipe's keyframe of `family` (one rank, one step), as a checkpoint folder."""
    store = tmp_path / "store"
    cmd = torchrun_cmd(1, [str(REPO / "scripts" / "train.py"), f"hydra.run.dir={tmp_path}", "trainer.max_steps=1",
                           *TINY, *FAMILY_ARGS[family], f"dcr.family={family}", f"dcr.store=file://{store}"])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return store / keys.keyframe_dir(0)
