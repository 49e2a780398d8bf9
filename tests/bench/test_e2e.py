"""`nemo-dcr bench e2e` (issue 51): the device run's logic, on the CPU with the tiny model.
The GPU run itself is scripts/device_check.sh --e2e; this is its dry run's core."""

from __future__ import annotations

import pytest

from nemo_dcr_callback.bench import e2e


def test_the_device_model_is_about_a_billion_params():
    assert 0.9e9 < e2e._params(e2e.MODELS["1b"]) < 1.1e9


@pytest.mark.slow  # three training runs and two receivers: about 40 s
def test_tiny_run_end_to_end_every_version_bit_exact(tmp_path):
    res = e2e.run("tiny", steps=3, json_path=str(tmp_path / "e2e.json"), workdir=str(tmp_path / "work"))
    assert res["device"] == "cpu"
    assert res["params"] == e2e._params(e2e.MODELS["tiny"])  # the estimate is the model's count
    assert res["versions_applied"] == res["digests_checked"] == 3
    assert res["versions_checked"] == res["versions_bit_exact"] == 3 and res["met"]["bit_exact"]
    assert res["base"]["step_ms"] > 0 and res["dcr"]["step_ms"] > 0
    assert res["base"]["peak_memory_bytes"] > 0 and res["dcr"]["peak_memory_kind"] == "host_max_rss"
    assert res["dcr"]["change_rate"] > 0 and res["dcr"]["bytes"] > 0
    assert (tmp_path / "e2e.json").exists()


@pytest.mark.slow  # a training run that fails at start-up: about 15 s
def test_a_failed_run_is_reported_and_leaves_no_receiver_waiting(tmp_path, monkeypatch):
    """A device lent for minutes must not be spent on a receiver waiting for versions that a
    crashed trainer will never publish; the runs before it are kept in the JSON."""
    started = []
    real = e2e._Receiver.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        started.append(self.p)

    monkeypatch.setattr(e2e._Receiver, "__init__", spy)
    bad = dict(e2e.MODELS["tiny"], num_attention_heads=3)  # 256 is not divisible by 3: the trainer fails
    with pytest.raises(RuntimeError, match="training run .* failed"):
        e2e._with_receiver(tmp_path, "dcr", 2, bad, "cpu", [], False, timeout=120)
    assert started and started[0].wait(10) is not None  # killed, not left polling


@pytest.mark.slow  # a 0.98B-param model built on the CPU: about a minute, 4 GB
def test_the_device_model_exports_what_transformers_loads(tmp_path):
    """The GPU run's model, checked here for what a wrong table entry would cost a lent device:
    megatron-core builds it with the estimated parameter count, and its dense export (the
    keyframe the receiver loads) has exactly the transformers Llama's names and shapes."""
    import os
    import subprocess
    import sys

    from nemo_dcr_callback.launcher import free_port

    code = """
import torch
from nemo_dcr_callback.bench.e2e import MODELS, _params
from nemo_dcr_callback.placement import FAMILIES, dense_export
from nemo_dcr_callback.recipes.lightning_gpt import init_distributed
from nemo_dcr_callback.recipes.megatron_model import TinyGPTConfig, build_model, hf_config
from transformers import AutoModelForCausalLM
init_distributed(1, 1)
cfg = TinyGPTConfig(**MODELS["1b"])
m = build_model(cfg)
assert sum(p.numel() for p in m.parameters()) == _params(MODELS["1b"])
exp = dense_export(m, FAMILIES["llama"], cfg.vocab_size)
with torch.device("meta"):
    sd = AutoModelForCausalLM.from_config(hf_config(cfg, "llama"), dtype=torch.bfloat16).state_dict()
assert sorted(sd) == sorted(exp), (sorted(set(sd) ^ set(exp)))[:5]
assert all(tuple(sd[k].shape) == tuple(exp[k].shape) for k in exp)
print("ok", len(exp))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "MASTER_PORT": str(free_port())}, cwd=tmp_path)
    assert r.returncode == 0 and "ok 165" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
