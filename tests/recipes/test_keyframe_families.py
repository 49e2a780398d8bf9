"""Every family's keyframe is a checkpoint its family's engines load (issue 47, item 0).

The training recipe (scripts/train.py: Lightning + megatron-core + the callback) writes version
0's keyframe: the dense export and a config.json from recipes/megatron_model.HF_FAMILIES. A
keyframe for qwen3 used to say "model_type": "llama" while holding q_norm/k_norm, and one for
qwen3_moe had no `architectures`: engines refused both. Here transformers'
AutoModelForCausalLM loads each family's keyframe with nothing missing or left over, and holds
the keyframe's bits (checked against its record's digests when it is read: the dense
export's), as its own save_pretrained writes them back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol.rebuild import load_keyframe
from nemo_dcr_callback.recipes.megatron_model import HF_FAMILIES
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.keyframes import FAMILY_ARGS, publish_keyframe

FAST = {"qwen3", "qwen3_moe"}  # the two that engines refused; make test-all runs every family


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in FAST else pytest.mark.slow)
                                    for f in FAMILY_ARGS])
def test_the_recipe_keyframe_loads_in_transformers(tmp_path, family):
    import transformers

    folder = publish_keyframe(tmp_path, family)
    config_class, model_class, _ = HF_FAMILIES[family]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [model_class]
    assert config["model_type"] == getattr(transformers, config_class).model_type
    tensors, _ = load_keyframe(FileStore(tmp_path / "store"), 0)  # (checked against its record's digests)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True,
                                                                    dtype=torch.bfloat16)
    assert type(model).__name__ == model_class
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert not info["unexpected_keys"] and set(info["missing_keys"]) <= tied, info
    # what the model holds, in the checkpoint's names: transformers fuses MoE experts when it
    # loads (gate_up_proj) and splits them again when it saves
    model.save_pretrained(tmp_path / "saved")
    held = {}
    for f in sorted((tmp_path / "saved").glob("*.safetensors")):
        held.update(load_file(f))
    assert set(held) == set(tensors) - tied or set(held) == set(tensors), sorted(set(held) ^ set(tensors))[:4]
    bad = [n for n, t in held.items() if not torch.equal(bits(t.contiguous()), bits(tensors[n]))]
    assert not bad, f"{family}: {bad[:3]} differ from the keyframe"


def test_every_placement_family_has_a_hugging_face_config():
    from nemo_dcr_callback.placement import FAMILIES

    assert set(FAMILIES) == set(HF_FAMILIES)


def test_a_family_whose_model_lacks_what_its_engines_expect_is_refused():
    from nemo_dcr_callback.recipes.megatron_model import TinyGPTConfig, hf_config

    with pytest.raises(ValueError, match="model.qk_layernorm"):
        hf_config(TinyGPTConfig(), "qwen3")  # (the keyframe would lack q_norm and k_norm)
    assert hf_config(TinyGPTConfig(qk_layernorm=True), "qwen3").architectures == ["Qwen3ForCausalLM"]


def test_a_refused_family_names_the_exact_overrides():
    """Issue 67: deepseek_v3 without the router's expert bias said "set
    model.moe_router_enable_expert_bias", a key the Hydra config lacks (it needs `+`), and
    megatron-core then also wanted the sigmoid router: three runs to get there. The refusal
    now names every override, `+` where the key is not in configs/train_gpt.yaml."""
    from nemo_dcr_callback.recipes.megatron_model import TinyGPTConfig, hf_config

    with pytest.raises(ValueError) as e:
        hf_config(TinyGPTConfig(multi_latent_attention=True, num_moe_experts=4, moe_ffn_hidden_size=32),
                  "deepseek_v3")
    assert str(e.value).endswith("add these overrides: +model.moe_router_enable_expert_bias=true "
                                 "+model.moe_router_score_function=sigmoid"), e.value
    with pytest.raises(ValueError, match=r"overrides: model\.qk_layernorm=true$"):
        hf_config(TinyGPTConfig(), "qwen3")


@pytest.mark.slow
def test_the_named_overrides_are_enough(tmp_path):
    """The recipe refused as a new user would run it, then run again with exactly the
    overrides its error names: it trains and publishes (real torchrun, megatron-core)."""
    import subprocess

    from nemo_dcr_callback.launcher import torchrun_cmd
    from tests.helpers import REPO
    from tests.helpers.keyframes import MOE, TINY

    base = [str(REPO / "scripts" / "train.py"), f"hydra.run.dir={tmp_path}", "trainer.max_steps=1", *TINY,
            "dcr.family=deepseek_v3", "model.multi_latent_attention=true", *MOE,
            f"dcr.store=file://{tmp_path / 'store'}"]
    p = subprocess.run(torchrun_cmd(1, base), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "add these overrides: " in out, out[-3000:]
    named = out.split("add these overrides: ")[1].splitlines()[0].split()
    p = subprocess.run(torchrun_cmd(1, base + named), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, (named, (p.stdout + p.stderr)[-3000:])
