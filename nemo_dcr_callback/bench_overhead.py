"""`nemo-dcr bench overhead`: training-step time with and without the DCR callback.

Runs scripts/train.py under torchrun (the demo model by default, TP 2 x PP 2 on CPU) with the
default callback config and with `trainer.callbacks=[]`, alternating A/B runs, and compares
the median wall time per step (the module logs `step_ms`: one step's start to the next's,
so the callback's work and its background thread's contention are included).
"""

from __future__ import annotations

import csv
import statistics
import subprocess
import tempfile
from pathlib import Path

from nemo_dcr_callback.launch import torchrun_cmd
from nemo_dcr_callback.results import write_json

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"


def _run(tp: int, pp: int, steps: int, with_callback: bool, extra: list[str]) -> list[float]:
    run_dir = Path(tempfile.mkdtemp(prefix="nemo-dcr-overhead."))
    cmd = torchrun_cmd(tp * pp, [str(SCRIPT), f"parallel.tensor_model_parallel_size={tp}",
                                 f"parallel.pipeline_model_parallel_size={pp}", f"trainer.max_steps={steps}",
                                 f"hydra.run.dir={run_dir}", *([] if with_callback else ["trainer.callbacks=[]"]),
                                 *extra])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stdout[-2000:] + p.stderr[-2000:])
    rows = list(csv.DictReader(open(next(run_dir.glob("logs/version_*/metrics.csv")))))
    return [float(r["step_ms"]) for r in rows if r.get("step_ms")]


def run(tp: int = 2, pp: int = 2, steps: int = 30, pairs: int = 2, warmup: int = 3, json_path: str | None = None,
        extra: list[str] | None = None) -> dict:
    extra = extra or []
    with_cb: list[float] = []
    without: list[float] = []
    for i in range(pairs):
        for cb in (True, False) if i % 2 == 0 else (False, True):
            print(f"nemo-dcr bench overhead: {'with' if cb else 'without'} the callback ...", flush=True)
            times = _run(tp, pp, steps, cb, extra)[warmup:]
            (with_cb if cb else without).extend(times)
    a, b = statistics.median(with_cb), statistics.median(without)
    out = {"benchmark": "overhead", "tp": tp, "pp": pp, "steps": steps, "pairs": pairs, "extra": extra,
           "median_step_ms_with": a, "median_step_ms_without": b, "overhead": a / b - 1,
           "samples_with": len(with_cb), "samples_without": len(without), "target": 0.05}
    print(f"{'':>18} {'median step ms':>15}\n{'without callback':>18} {b:15.1f}\n{'with callback':>18} {a:15.1f}\n"
          f"overhead {100 * (a / b - 1):+.1f}% (target <= +5%), {len(with_cb)}/{len(without)} steps, "
          f"TP {tp} x PP {pp} on CPU")
    if json_path:
        write_json(json_path, out)
    return out
