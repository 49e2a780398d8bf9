"""`nemo-dcr bench headline`: the figures the README and the top of docs/PERFORMANCE.md quote,
each the median of its runs, with the spread, the files, the date and the machine.

One table (METRICS) says where each figure comes from: the result files that are its runs (a
benchmark writes one per run, e.g. refit.json, refit_run2.json, refit_run3.json) and how to
read one value from each, or the repeated values inside one run (the overhead bench's runs,
the relay bench's rounds). Nothing is quoted from a best run: a file that is missing leaves
its runs out and the row says how many there were, and a figure with fewer than 3 runs says
so in its spread column. `--markdown` prints the table that docs/PERFORMANCE.md carries; a
test checks that the document and the files agree.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nemo_dcr_callback.bench.codec import TARGETS as CODEC_TARGETS
from nemo_dcr_callback.bench.refit import RATES
from nemo_dcr_callback.bench.refit import TARGETS as REFIT_TARGETS
from nemo_dcr_callback.bench.results import RESULTS, write_json

REFIT_RUNS = ("refit.json", "refit_run2.json", "refit_run3.json")
CODEC_RUNS = ("codec.json", "codec_run2.json", "codec_run3.json")


@dataclass(frozen=True)
class Metric:
    """One quoted figure. `value` reads one run's value from a file (a float), or a list of the
    run's own repeated values (then that one file holds the runs)."""

    name: str
    files: tuple[str, ...]
    value: Callable[[dict], float | list[float]]
    fmt: str  # a format for the median and the spread's ends
    target: str = "-"
    met: Callable[[float], bool] | None = None
    unit: str = "run"  # what one value is: a run, a round of one run, a trial


def _refit_row(kind: str, rate: float) -> Callable[[dict], float]:
    return lambda d: next(r for r in d["rows_by_deltas"][kind] if r["target_rate"] == rate)["speedup"]


def _codec(rate: float, f: Callable[[dict], float]) -> Callable[[dict], float]:
    return lambda d: f(next(r for r in d["results"] if round(r["target_rate"], 4) == rate))


def _relay(scenario: str, d: dict) -> dict:
    return next(s for s in d["scenarios"] if s["scenario"] == scenario)


def _fan_out(d: dict) -> list[float]:
    """8 receivers' time over one's, round by round (the rounds of the two scenarios in order)."""
    return [a / b for a, b in zip(_relay("dcr-relay", d)["round_time_s"], _relay("dcr-relay-1", d)["round_time_s"],
                                  strict=False)]


# the targets each benchmark states and checks itself
TARGET_SPEEDUP = REFIT_TARGETS
TARGET_RATIO = CODEC_TARGETS["ratio_ulp"]

METRICS: tuple[Metric, ...] = (
    *(Metric(f"refit speed-up over the dense checkpoint, {100 * x:.0f}% changed (537M params, S3, 100 Mbit/s, "
             "AdamW-like versions)", REFIT_RUNS, _refit_row("adamw", x), "{:.1f}x",
             f">= {TARGET_SPEEDUP[x]}x", lambda v, x=x: v >= TARGET_SPEEDUP[x]) for x in RATES),
    *(Metric(f"the same run's uniform control, {100 * x:.0f}%", REFIT_RUNS, _refit_row("uniform", x), "{:.1f}x")
      for x in RATES),
    *(Metric(f"codec ratio vs dense BF16, {100 * x:.0f}% changed", CODEC_RUNS,
             _codec(x, lambda r: r["ratio"]["codec"]), "{:.1f}x", f">= {TARGET_RATIO[x]}x",
             lambda v, x=x: v >= TARGET_RATIO[x]) for x in RATES),
    *(Metric(f"codec {stage}, GB/s per core, 3%", CODEC_RUNS, _codec(0.03, lambda r, s=key: r["gbps_per_core"][s]),
             "{:.1f}", f">= {CODEC_TARGETS[key]:g}", lambda v, f=CODEC_TARGETS[key]: v >= f)
      for stage, key in (("delta kernel", "kernel_input"), ("encode", "encode"), ("decode", "decode"),
                         ("apply", "apply"))),
    Metric("training-step overhead, file store (demo model, TP 2 x PP 2 on 2 cores, alternating blocks)",
           ("overhead_alternate.json",), lambda d: d["per_run_overhead"], "{:+.1%}", "<= +5%",
           lambda v: v <= 0.05),
    Metric("training-step overhead, S3 store (SeaweedFS on the same host)", ("overhead_s3.json",),
           lambda d: d["per_run_overhead"], "{:+.1%}", "<= +5%", lambda v: v <= 0.05),
    Metric("fan-out: 8 receivers in 2 regions over 1 (134M params, 3%, relay tree, 100 Mbit/s)", ("relay.json",),
           _fan_out, "{:.2f}x", "<= 1.3x", lambda v: v <= 1.3, unit="round"),
    Metric("inter-region bytes through the relay tree, per link over the payload", ("relay.json",),
           lambda d: list(_relay("dcr-relay", d)["link_x_payload"].values()), "{:.2f}x", "1x",
           lambda v: v <= 1.05, unit="link"),
)


@dataclass
class Row:
    name: str
    target: str
    median: float | None
    lo: float | None
    hi: float | None
    n: int
    unit: str
    files: list[str]
    dates: list[str]
    machines: list[str]
    met: bool | None
    fmt: str

    def cells(self) -> list[str]:
        f = self.fmt.format
        med = "not measured" if self.median is None else f"**{f(self.median)}**"
        spread = "-" if self.lo is None else f"{f(self.lo)} .. {f(self.hi)}"
        if self.n < 3 and self.unit in ("run", "round"):
            spread += f" (only {self.n} {self.unit}{'s' if self.n != 1 else ''}: not a median of 3)"
        else:
            spread += f" ({self.n} {self.unit}s)"
        target = self.target if self.met is None else f"{self.target}: {'met' if self.met else '**not met**'}"
        return [self.name, target, med, spread, ", ".join(self.files) or "-", ", ".join(sorted(set(self.dates))),
                "; ".join(sorted(set(self.machines)))]


def _machine(m: dict | None) -> str:
    if not m:
        return "no machine record"
    simd = m.get("simd")
    return f"{m.get('cpu', '?')}{' (' + ', '.join(simd) + ')' if simd else ''}, {m.get('cores', '?')} cores"


def evaluate(results: Path = RESULTS) -> list[Row]:
    rows = []
    for m in METRICS:
        values, files, dates, machines = [], [], [], []
        for name in m.files:
            p = results / name
            if not p.exists():
                continue
            d = json.loads(p.read_text())
            v = m.value(d)
            values += v if isinstance(v, list) else [v]
            files.append(name)
            dates.append((d.get("machine") or {}).get("date", "undated"))
            machines.append(_machine(d.get("machine")))
        med = statistics.median(values) if values else None
        rows.append(Row(m.name, m.target, med, min(values, default=None), max(values, default=None), len(values),
                        m.unit, files, dates, machines, None if med is None or m.met is None else m.met(med), m.fmt))
    return rows


HEADER = ["figure", "target", "median", "spread (min .. max)", "file", "date", "machine"]


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run(results: Path = RESULTS, json_path: str | None = None, md: bool = False) -> list[Row]:
    rows = evaluate(Path(results))
    if md:
        print(markdown(rows), end="")
    else:
        for r in rows:
            c = r.cells()
            print(f"{c[2]:>14}  {c[3]:<40} {c[1]:<22} {c[0]}")
    if json_path:
        write_json(json_path, {"benchmark": "headline", "rows": [
            {"figure": r.name, "target": r.target, "median": r.median, "min": r.lo, "max": r.hi, "n": r.n,
             "unit": r.unit, "met": r.met, "files": r.files, "dates": r.dates, "machines": r.machines}
            for r in rows]})
    return rows
