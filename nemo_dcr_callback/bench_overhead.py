"""`nemo-dcr bench overhead`: training-step time with and without the DCR callback.

Runs scripts/train.py under torchrun (the demo model by default, TP 2 x PP 2 on CPU) with the
default callback config and with `trainer.callbacks=[]`, alternating A/B runs, and compares
the median wall time per step (the module logs `step_ms`: one step's start to the next's,
so the callback's work and its background thread's contention are included). While each
run trains it reads /proc for the CPU of the trainers and of the callback's workers and the
host's idle CPU, per step: on a host the training keeps busy, the overhead is the callback's
CPU, and this shows whether the workers' share came from idle time or from the training.
"""

from __future__ import annotations

import csv
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from nemo_dcr_callback import procstat
from nemo_dcr_callback.launch import torchrun_cmd
from nemo_dcr_callback.results import write_json

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"


def _role(cmd: str) -> str:
    """A launched process's part: a training rank, the callback's worker, or anything else."""
    if "multiprocessing" in cmd:
        return "worker"
    return "trainer" if "train.py" in cmd and "torch.distributed.run" not in cmd else "other"


def _run(tp: int, pp: int, steps: int, with_callback: bool, extra: list[str], warmup: int = 3
         ) -> tuple[list[float], dict]:
    """Step times of one run, and its CPU per step by role (trainers, workers, the host's idle
    CPU) from the start of step `warmup` to the start of the last step (rank 0 prints when each
    step starts), read from /proc while it trains."""
    from nemo_dcr_callback.lightning_gpt import STEP_CLOCK_ENV

    run_dir = Path(tempfile.mkdtemp(prefix="nemo-dcr-overhead."))
    cmd = torchrun_cmd(tp * pp, [str(SCRIPT), f"parallel.tensor_model_parallel_size={tp}",
                                 f"parallel.pipeline_model_parallel_size={pp}", f"trainer.max_steps={steps}",
                                 f"hydra.run.dir={run_dir}", *([] if with_callback else ["trainer.callbacks=[]"]),
                                 *extra])
    with open(run_dir / "launch.log", "w+") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, STEP_CLOCK_ENV: "1"})
        samples = []
        while p.poll() is None:
            samples.append((time.monotonic(), procstat.host_idle_s(), procstat.tree(p.pid)))
            time.sleep(0.25)
        log.seek(0)
        text = log.read()
        if p.returncode != 0:
            raise RuntimeError(text[-4000:])
    starts = {int(w[1]): float(w[2]) for w in (ln.split() for ln in text.splitlines())
              if len(w) == 3 and w[0] == STEP_CLOCK_ENV}
    rows = list(csv.DictReader(open(next(run_dir.glob("logs/version_*/metrics.csv")))))
    times = [float(r["step_ms"]) for r in rows if r.get("step_ms")]
    cpu: dict[str, float] = {}
    # the training part of the run, after the warm-up steps (before: imports, model building,
    # the callback's workers starting, whose CPU is not a step's)
    first, last = starts.get(warmup), starts.get(max(starts, default=-1))
    inside = [s for s in samples if first is not None and first <= s[0] <= last]
    if len(inside) > 4:
        a, b = inside[0], inside[-1]
        per_step = statistics.median(times) / 1e3 / (b[0] - a[0])  # seconds of this window -> steps
        for pid, (c, cmd) in b[2].items():
            if pid in a[2]:
                role = _role(cmd)
                cpu[role] = cpu.get(role, 0.0) + 1e3 * (c - a[2][pid][0]) * per_step
        cpu["host_idle"] = 1e3 * (b[1] - a[1]) * per_step
    shutil.rmtree(run_dir, ignore_errors=True)
    return times, cpu


def run(tp: int = 2, pp: int = 2, steps: int = 30, pairs: int = 2, warmup: int = 3, json_path: str | None = None,
        extra: list[str] | None = None) -> dict:
    extra = extra or []
    with_cb: list[float] = []
    without: list[float] = []
    cpu: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(pairs):
        for cb in (True, False) if i % 2 == 0 else (False, True):
            print(f"nemo-dcr bench overhead: {'with' if cb else 'without'} the callback ...", flush=True)
            times, c = _run(tp, pp, steps, cb, extra, warmup)
            (with_cb if cb else without).extend(times[warmup:])
            cpu[cb].append(c)
    a, b = statistics.median(with_cb), statistics.median(without)

    def med(cb: bool) -> dict[str, float]:  # CPU ms per step by role, median over the runs
        keys = {k for c in cpu[cb] for k in c}
        return {k: statistics.median(c.get(k, 0.0) for c in cpu[cb]) for k in sorted(keys) if k != "other"}

    out = {"benchmark": "overhead", "tp": tp, "pp": pp, "steps": steps, "pairs": pairs, "extra": extra,
           "median_step_ms_with": a, "median_step_ms_without": b, "overhead": a / b - 1,
           "samples_with": len(with_cb), "samples_without": len(without), "target": 0.05,
           "cpu_ms_per_step_with": med(True), "cpu_ms_per_step_without": med(False),
           "machine": f"{os.cpu_count()} cores"}
    print(f"{'':>18} {'median step ms':>15}\n{'without callback':>18} {b:15.1f}\n{'with callback':>18} {a:15.1f}\n"
          f"overhead {100 * (a / b - 1):+.1f}% (target <= +5%), {len(with_cb)}/{len(without)} steps, "
          f"TP {tp} x PP {pp} on CPU")
    for cb in (False, True):
        m = med(cb)
        print(f"CPU per step {'with' if cb else 'without'} the callback (ms, median of runs): "
              + ", ".join(f"{k} {v:.0f}" for k, v in m.items()))
    if json_path:
        write_json(json_path, out)
    return out
