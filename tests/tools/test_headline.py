"""bench/headline.py: the quoted figures are medians of their runs, and docs/PERFORMANCE.md's
current table is exactly what the committed result files give."""

from __future__ import annotations

import json
from pathlib import Path

from nemo_dcr_callback.bench import headline

ROOT = Path(__file__).resolve().parents[2]


def _refit(path: Path, speedups: dict[float, float], date: str) -> None:
    rows = {kind: [{"target_rate": x, "speedup": s} for x, s in speedups.items()] for kind in ("adamw", "uniform")}
    path.write_text(json.dumps({"rows_by_deltas": rows, "machine": {"cpu": "AMD EPYC", "simd": ["avx2"],
                                                                    "cores": 2, "date": date}}))


def _row(rows, start: str) -> headline.Row:
    return next(r for r in rows if r.name.startswith(start))


def test_the_median_of_the_runs_is_quoted_not_the_best(tmp_path):
    for name, s, date in (("refit.json", 100.0, "2026-12-07"), ("refit_run2.json", 130.0, "2026-12-07"),
                          ("refit_run3.json", 120.0, "2026-12-08")):
        _refit(tmp_path / name, {0.01: s, 0.03: s / 2, 0.05: s / 3}, date)
    r = _row(headline.evaluate(tmp_path), "refit speed-up over the dense checkpoint, 1%")
    assert (r.median, r.lo, r.hi, r.n) == (120.0, 100.0, 130.0, 3)
    cells = r.cells()
    assert cells[2] == "**120.0x**" and cells[3] == "100.0x .. 130.0x (3 runs)"
    assert cells[1] == ">= 200x: **not met**" and cells[5] == "2026-12-07, 2026-12-08"
    assert cells[6] == "AMD EPYC (avx2), 2 cores"


def test_fewer_than_three_runs_says_so_and_a_missing_figure_is_not_measured(tmp_path):
    _refit(tmp_path / "refit.json", {0.01: 250.0, 0.03: 90.0, 0.05: 60.0}, "2026-12-07")
    rows = headline.evaluate(tmp_path)
    r = _row(rows, "refit speed-up over the dense checkpoint, 1%")
    assert r.cells()[3] == "250.0x .. 250.0x (only 1 run: not a median of 3)" and r.met is True
    s3 = _row(rows, "training-step overhead, S3 store")
    assert s3.cells()[2] == "not measured" and s3.met is None


def test_performance_md_carries_the_current_table():
    """The table under "Current figures" is `nemo-dcr bench headline --markdown` of the committed
    files, character for character: a figure changes in the document only with its files."""
    doc = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    table = headline.markdown(headline.evaluate(ROOT / "benchmarks" / "results"))
    assert table in doc, "docs/PERFORMANCE.md's current table is not `make headline`'s: run it and paste the table"
