"""`nemo-dcr bench overhead`: training-step time with and without the DCR callback.

Runs scripts/train.py under torchrun (the demo model by default, TP 2 x PP 2 on CPU) with the
default callback config and with `trainer.callbacks=[]`, alternating A/B runs, and compares
the median wall time per step (the module logs `step_ms`: one step's start to the next's,
so the callback's work and its background thread's contention are included). While each
run trains it reads /proc for the CPU of the trainers and of the callback's workers and the
host's idle CPU, per step: on a host the training keeps busy, the overhead is the callback's
CPU, and this shows whether the workers' share came from idle time or from the training.
The overhead comes with a 90% bootstrap interval over the pairs of runs.

`--alternate K` measures inside each run instead: the callback publishes only in every other
block of K steps (NEMO_DCR_BENCH_ALTERNATE), and the blocks with it are compared with the
blocks without it, seconds apart, so the host's drift between runs drops out (no CPU split
by role in this mode).

`--store s3` publishes to a SeaweedFS S3 server the benchmark starts on this host (each run
its own prefix) instead of the default file store in the run folder: the production case,
where `dcr.context=auto` keeps the worker's mirror. The server's CPU is shared with the
training here, as it would not be with a remote store, so this is an upper bound.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from nemo_dcr_callback.bench import procstat
from nemo_dcr_callback.bench.results import machine, write_json
from nemo_dcr_callback.launcher import torchrun_cmd

STORES = ("file", "s3")


@contextlib.contextmanager
def _stores(kind: str):
    """A function giving each run its store: (Hydra overrides, environment). file: the
    recipe's default (a fresh store in each run's folder); s3: a prefix of its own on one
    SeaweedFS server that lives as long as the benchmark."""
    if kind not in STORES:
        raise ValueError(f"--store {kind}: one of {', '.join(STORES)}")
    if kind == "file":
        yield lambda: ([], {})
        return
    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.transport.seaweed import SeaweedS3

    work = Path(tempfile.mkdtemp(prefix="nemo-dcr-overhead-s3."))
    n = itertools.count(1)
    prefixes: list[str] = []

    def next_store() -> tuple[list[str], dict[str, str]]:
        prefixes.append(f"run-{next(n)}")
        # quoted: Hydra's override grammar takes the URL's ? and : otherwise
        return [f"dcr.store='{s3.url(f'{s3.bucket}/{prefixes[-1]}')}'"], s3.env()

    try:
        with SeaweedS3(work) as s3:
            yield next_store
            # the figure is the S3 store's only if the runs published there
            empty = [p for p in prefixes if not commit.list_versions(s3.store(p))]
            if empty:
                raise RuntimeError(f"bench overhead --store s3: no versions in {empty}: the runs did not publish to S3")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _role(cmd: str) -> str:
    """A launched process's part: a training rank, the callback's worker, or anything else."""
    if "multiprocessing" in cmd:
        return "worker"
    return "trainer" if "train.py" in cmd and "torch.distributed.run" not in cmd else "other"


def step_metrics(run_dir: Path) -> tuple[list[dict], dict[int, float]]:
    """A training recipe run's CSV log: its rows, and each step's wall time (`step_ms`) by step."""
    with open(next(run_dir.glob("logs/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    return rows, {int(r["step"]): float(r["step_ms"]) for r in rows if r.get("step_ms")}


def _run(tp: int, pp: int, steps: int, with_callback: bool, extra: list[str], warmup: int = 3,
         alternate: int = 0, env: dict[str, str] | None = None) -> tuple[list[float], dict, dict[int, float]]:
    """Step times of one run, and its CPU per step by role (trainers, workers, the host's idle
    CPU) from the start of step `warmup` to the start of the last step (rank 0 prints when each
    step starts), read from /proc while it trains."""
    from nemo_dcr_callback.recipes.lightning_gpt import STEP_CLOCK_ENV
    from nemo_dcr_callback.sender.callback import ALTERNATE_ENV

    run_dir = Path(tempfile.mkdtemp(prefix="nemo-dcr-overhead."))
    cmd = torchrun_cmd(tp * pp, ["-m", "nemo_dcr_callback.recipes.train", f"parallel.tensor_model_parallel_size={tp}",
                                 f"parallel.pipeline_model_parallel_size={pp}", f"trainer.max_steps={steps}",
                                 f"hydra.run.dir={run_dir}", *([] if with_callback else ["trainer.callbacks=[]"]),
                                 *extra])
    with open(run_dir / "launch.log", "w+") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, **(env or {}), STEP_CLOCK_ENV: "1",
                                  **({ALTERNATE_ENV: str(alternate)} if alternate else {})})
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
    rows, by_step = step_metrics(run_dir)
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
    return times, cpu, by_step


def _blocks(by_step: dict[int, float], k: int, skip: int = 2) -> list[dict[bool, list[float]]]:
    """A run with --alternate k, as pairs of adjacent blocks (an "off" block, then the "on"
    block after it): {True: on step times, False: off step times}. The row logged at step s
    times batch s-1 with its publish; the first `skip` batches of every block are left out
    (the first publish after an off block carries k + 1 steps of changes, and the worker's
    encoding of a block's last version runs into the next block), and so is block 0 (start-up)."""
    blocks: dict[int, list[float]] = {}
    for s, ms in by_step.items():
        b = s - 1
        if b // k >= 1 and b % k >= skip:
            blocks.setdefault(b // k, []).append(ms)
    return [{True: blocks[j + 1], False: blocks[j]} for j in sorted(blocks) if j % 2 and j + 1 in blocks]


def _run_alternate(tp: int, pp: int, steps: int, runs: int, k: int, extra: list[str], store) -> dict:
    """Runs that publish in every other block of k steps, compared block pair by block pair."""
    pairs: list[dict[bool, list[float]]] = []
    per_run = []
    for i in range(runs):
        print(f"nemo-dcr bench overhead: run {i + 1}/{runs}, the callback on in every other block of {k} steps ...",
              flush=True)
        over, env = store()
        _, _, by_step = _run(tp, pp, steps, True, [*over, *extra], alternate=k, env=env)
        ps = _blocks(by_step, k)
        if not ps:
            raise RuntimeError(f"no pair of blocks in {steps} steps with blocks of {k}: pass more --steps")
        pairs += ps
        per_run.append(_overhead(ps))
    return {"pairs": pairs, "per_run": per_run}


def _medians(pairs: list[dict[bool, list[float]]]) -> tuple[float, float]:
    """Median step time with and without the callback, over every step of the pairs."""
    return (statistics.median(t for p in pairs for t in p[True]),
            statistics.median(t for p in pairs for t in p[False]))


def _overhead(pairs: list[dict[bool, list[float]]]) -> float:
    with_cb, without = _medians(pairs)
    return with_cb / without - 1


def _table(with_cb: float, without: float) -> str:
    return (f"{'':>18} {'median step ms':>15}\n{'without callback':>18} {without:15.1f}\n"
            f"{'with callback':>18} {with_cb:15.1f}\n")


def _bootstrap(runs: list[dict[bool, list[float]]], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 90% interval of the overhead: pairs drawn with replacement, the pooled medians'
    ratio each time. Pairs, not steps, are the unit: a run's steps share that run's state of
    the host, and the run-to-run spread is the larger part of the noise here."""
    import random

    rng = random.Random(seed)
    est = sorted(_overhead([runs[rng.randrange(len(runs))] for _ in runs]) for _ in range(n))
    return est[int(0.05 * (n - 1))], est[int(0.95 * (n - 1))]


def run(tp: int = 2, pp: int = 2, steps: int = 30, pairs: int = 2, warmup: int = 3, json_path: str | None = None,
        extra: list[str] | None = None, alternate: int = 0, store: str = "file") -> dict:
    extra = extra or []
    if alternate < 0:
        raise ValueError(f"--alternate {alternate}: a block length (steps), or 0 for separate runs")
    with _stores(store) as next_store:
        if alternate:
            out = run_alternate(tp, pp, steps, pairs, alternate, extra, next_store)
        else:
            out = _run_pairs(tp, pp, steps, pairs, warmup, extra, next_store)
    out["store"] = store
    if json_path:
        write_json(json_path, out)
    return out


def _run_pairs(tp: int, pp: int, steps: int, pairs: int, warmup: int, extra: list[str], store) -> dict:
    """Separate runs with and without the callback, in pairs whose order alternates."""
    runs: list[dict[bool, list[float]]] = []  # per pair: step times with / without
    cpu: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(pairs):
        runs.append({})
        for cb in (True, False) if i % 2 == 0 else (False, True):
            print(f"nemo-dcr bench overhead: {'with' if cb else 'without'} the callback ...", flush=True)
            over, env = store()
            times, c, _ = _run(tp, pp, steps, cb, [*over, *extra] if cb else extra, warmup, env=env)
            runs[-1][cb] = times[warmup:]
            cpu[cb].append(c)
    a, b = _medians(runs)
    n_with, n_without = sum(len(r[True]) for r in runs), sum(len(r[False]) for r in runs)
    per_pair = [_overhead([r]) for r in runs]
    lo, hi = _bootstrap(runs)

    def med(cb: bool) -> dict[str, float]:  # CPU ms per step by role, median over the runs
        keys = {k for c in cpu[cb] for k in c}
        return {k: statistics.median(c.get(k, 0.0) for c in cpu[cb]) for k in sorted(keys) if k != "other"}

    out = {"benchmark": "overhead", "tp": tp, "pp": pp, "steps": steps, "pairs": pairs, "extra": extra,
           "median_step_ms_with": a, "median_step_ms_without": b, "overhead": a / b - 1,
           "samples_with": n_with, "samples_without": n_without, "target": 0.05,
           "per_pair_overhead": per_pair, "overhead_ci90": [lo, hi],
           "cpu_ms_per_step_with": med(True), "cpu_ms_per_step_without": med(False),
           "machine": machine()}
    print(_table(a, b) + f"overhead {100 * (a / b - 1):+.1f}% (target <= +5%), {n_with}/{n_without} steps, "
          f"TP {tp} x PP {pp} on CPU\n"
          f"  90% interval over pairs (bootstrap) {100 * lo:+.1f}% .. {100 * hi:+.1f}%; per pair: "
          + " ".join(f"{100 * x:+.1f}%" for x in per_pair))
    for cb in (False, True):
        m = med(cb)
        print(f"CPU per step {'with' if cb else 'without'} the callback (ms, median of runs): "
              + ", ".join(f"{k} {v:.0f}" for k, v in m.items()))
    return out


def run_alternate(tp: int, pp: int, steps: int, runs: int, k: int, extra: list[str], store) -> dict:
    """`--alternate K`: the overhead from steps with and without publishing inside the same
    runs, K-step blocks apart, so the host's drift between runs (a pair of separate runs moved
    by -3% to +16% on one afternoon here) does not enter the comparison."""
    if k < 3:
        raise ValueError(f"--alternate {k}: blocks need at least 3 steps (the first 2 of each are left out)")
    if steps < 3 * k:  # block 0 is start-up; a pair is an off block and the on block after it
        raise ValueError(f"--steps {steps}: --alternate {k} needs at least {3 * k} steps per run")
    res = _run_alternate(tp, pp, steps, runs, k, extra, store)
    pairs = res["pairs"]
    a, b = _medians(pairs)
    n_on, n_off = sum(len(p[True]) for p in pairs), sum(len(p[False]) for p in pairs)
    lo, hi = _bootstrap(pairs)
    out = {"benchmark": "overhead", "mode": f"alternate blocks of {k} steps", "tp": tp, "pp": pp, "steps": steps,
           "runs": runs, "extra": extra, "median_step_ms_with": a, "median_step_ms_without": b,
           "overhead": a / b - 1, "overhead_ci90": [lo, hi], "per_run_overhead": res["per_run"],
           "median_per_run": statistics.median(res["per_run"]), "block_pairs": len(pairs),
           "samples_with": n_on, "samples_without": n_off, "target": 0.05,
           "machine": machine(),
           # every measured step, so that runs of the same code can be pooled later
           "pairs": [{"on": p[True], "off": p[False]} for p in pairs]}
    print(_table(a, b) + f"overhead {100 * (a / b - 1):+.1f}% (target <= +5%), {n_on}/{n_off} steps in {len(pairs)} "
          f"pairs of {k}-step blocks, {runs} runs, TP {tp} x PP {pp} on CPU\n"
          f"  90% interval over block pairs (bootstrap) {100 * lo:+.1f}% .. {100 * hi:+.1f}%; per run: "
          + " ".join(f"{100 * x:+.1f}%" for x in res["per_run"]))
    return out
