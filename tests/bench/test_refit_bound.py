"""`bench refit --bound`: the refit's versions against the bytes its targets allow and the
context model's information bound, on a policy small enough for `make test`. The bound is
computed independently of the codec (entropies of the changes given the old exponent), so a
codec or a bound that went wrong would cross the other."""

from __future__ import annotations

import json

from nemo_dcr_callback.bench import refit_bound
from nemo_dcr_callback.bench.refit import TARGETS


def test_rows_set_each_target_beside_the_codecs_and_the_bound(tmp_path, capsys):
    out = refit_bound.run(1 << 21, rates=(0.01, 0.05), json_path=str(tmp_path / "b.json"), quiet=True)
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == out["rows"]
    table = capsys.readouterr().out
    assert "200x" in table and "55x" in table
    for r in out["rows"]:
        assert abs(r["change_rate"] - r["target_rate"]) < 0.3 * r["target_rate"], r
        assert r["target_speedup"] == TARGETS[r["target_rate"]]
        assert r["allowed_bytes"] == r["dense_bytes"] / r["target_speedup"]
        # AdamW-like steps: context coding beats plain, and neither beats the order-0 bound of
        # its own model by much (a wrong bound, or bytes lost from a stream, would)
        assert r["context_bytes"] <= r["plain_bytes"]  # (a chunk codes context only where it wins)
        assert r["plain_bytes"] > 0.95 * r["xor_bound_bytes"]
        assert r["context_bytes"] > 0.9 * r["bound_bytes"]
        assert r["bound_bytes"] < r["xor_bound_bytes"]
    assert out["rows"][1]["context_bytes"] < out["rows"][1]["plain_bytes"]
    assert out["rows"][0]["bound_ratio"] > out["rows"][1]["bound_ratio"]
