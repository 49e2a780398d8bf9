"""`nemo-dcr bench vllm` on a tiny model: it runs, every path applies the same versions (the
bench asserts DCR's), and it reports what the closing notes quote."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM (make test-vllm builds .venv-vllm)")


def test_bench_vllm_runs(tmp_path):
    import json

    from nemo_dcr_callback.bench import vllm as bench

    out = tmp_path / "vllm.json"
    res = bench.run(rates=(0.03,), hidden=256, layers=2, vocab=512, json_path=str(out), reps=1)
    (row,) = res["rows"]
    assert row["version"] == 1 and 0.5 < row["lines_touched"] < 0.7  # 1 - 0.97^32 = 0.62
    assert row["dcr_load_s"] > 0 and row["dense_load_s"] > 0 and row["vllm_patch_load_s"] > 0
    assert json.loads(out.read_text())["medians"][0]["rate"] == 0.03


def test_bench_vllm_backend_runs(tmp_path):
    """`bench vllm --backend`: through vLLM's weight-transfer API, each version is sent as far
    fewer bytes than the dense checkpoint, and the engine's pause is measured both ways."""
    import json

    from nemo_dcr_callback.bench import vllm as bench

    out = tmp_path / "vllm_backend.json"
    res = bench.run_backend(rates=(0.03,), hidden=256, layers=2, vocab=512, json_path=str(out), reps=1)
    (row,) = res["rows"]
    assert row["version"] == 1 and row["dense_vs_sent"] > 3  # 3% of the values changed, by one ulp
    assert row["dcr_pause_s"] > 0 and row["dense_pause_s"] > 0
    assert json.loads(out.read_text())["medians"][0]["rate"] == 0.03
