"""`nemo-dcr bench trainer-memory` on a small model: two FSDP2 ranks under torchrun (gloo), the
`dcr` trainer engine over vLLM's ModuleSource. The sender's peak grows by at least its baseline
(one copy of the model); the other rank's stays far below one copy (it gathers one parameter at
a time and keeps none)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM (make test-vllm builds .venv-vllm)")


def test_only_the_sender_holds_the_model(tmp_path):
    from nemo_dcr_callback.bench import trainer_memory

    res = trainer_memory.run(hidden=512, layers=8, vocab=8000, versions=2, json_path=str(tmp_path / "m.json"))
    sender, other = res["rows"]
    model = sender["model_bytes"]
    assert model > 50e6 and sender["shard_bytes"] < 0.6 * model
    assert all(s["committed"] for s in sender["sends"]) and all(s["committed"] is None for s in other["sends"])
    assert sender["init"]["peak_above"] > model  # its baseline (and keyframe 0 beside it, once)
    for phase in [other["init"], *other["sends"]]:
        assert phase["peak_above"] < 0.5 * model, phase
