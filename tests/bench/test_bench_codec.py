"""`nemo-dcr bench codec`, small: it runs as a process, its deltas land bit-exact, and the
codec beats the simple schemes it is compared with on the same deltas."""

from __future__ import annotations

import json

from tests.helpers.cli import run


def test_bench_codec_smoke(tmp_path):
    out = tmp_path / "codec.json"
    p = run("bench", "codec", "--params", "300000", "--change-rates", "0.03", "--reps", "1", "--json", out)
    assert "bound" in p.stdout
    r = json.loads(out.read_text())["results"][0]
    assert r["bit_exact"] and 0.02 < r["change_rate"] < 0.04
    # The codec beats the simple schemes it is compared with (same deltas, same run).
    assert r["ratio"]["codec"] > r["ratio"]["simple"] > r["ratio"]["dense_zstd"]
    p = run("bench", "codec", "--change-rates", "2", ok=False)
    assert p.returncode == 2
