"""`make demo-rl` (`nemo-dcr demo --rl`): the asynchronous RL loop on one CPU machine.

    trainer (torchrun, 2 ranks, TP 2)          rollout worker (vLLM engine, its own process)
      GRPO step on batch b (version <= k old) <-- r-NNNNNN.json: episodes of version v
      DCR callback: publish v+1 --> store --> background: fetch, verify, decode, ack
                                              between batches: apply (the pause) --> generate on v+1

The trainer (recipes/rl_train.py) and the worker (recipes/rl_rollout.py) share only the store
and the rollout folder. This module starts both, optionally kills the worker mid-run and starts
it again (it comes back on the newest committed version from the keyframe and the deltas),
then prints one row per step and writes the measurements as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nemo_dcr_callback import safe_io
from nemo_dcr_callback.launcher import kill_tree
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.recipes import rl_rollout, rl_train
from nemo_dcr_callback.tools import planner
from nemo_dcr_callback.transport.store import open_store

LINK_MBIT = 100.0  # the link the dense refit's time is modelled on (the planner), as bench refit's


class TrainerFailed(RuntimeError):
    pass


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _worker(py: str, url: str, rollouts: Path, log: Path, check: bool, secret: str) -> subprocess.Popen:
    cmd = [py, "-m", "nemo_dcr_callback.recipes.rl_rollout", "--store", url, "--rollouts", str(rollouts),
           "--secret", secret] + (["--check"] if check else [])
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    # its own session (the trainer's too): a kill takes every process it started with it
    return subprocess.Popen(cmd, stdout=open(log, "a"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _kill(p: subprocess.Popen) -> None:
    kill_tree(p.pid)  # its group and its tree: torchrun's ranks each run in a session of their own
    p.wait()


def _dense_refit_s(co, params: int, rate: float, mbit: float) -> tuple[float, float]:
    """The planner's dense refit and DCR refit over one link of `mbit` (seconds), with its
    coefficients `co`."""
    p = planner.plan(planner.PlanInput(params=params, rate=min(max(rate, 1e-4), 0.99), link_MBps=mbit / 8,
                                       transport="s3", receivers=1), co)
    return p["dense_one_copy_s"], p["total_s"]


def run(steps: int = 30, workdir: str | None = None, kill_at: int = 0, restart: bool = True, check: bool = True,
        secret: str = "first",
        max_staleness: int = 1, json_path: str | None = None, quiet: bool = False,
        overrides: tuple[str, ...] = ()) -> dict:
    """The loop (both sides run in this interpreter's environment: vLLM's, with megatron-core)."""
    from nemo_dcr_callback.launcher import torchrun_cmd

    root = (Path(workdir) if workdir else Path("runs") / time.strftime("rl-%Y%m%d-%H%M%S")).resolve()
    rollouts, store_dir = root / "rollouts", root / "dcr-store"
    rollouts.mkdir(parents=True, exist_ok=True)
    url = "file://" + str(store_dir)
    py = sys.executable
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    say(f"nemo-dcr demo --rl: trainer on 2 CPU ranks (TP 2), a vLLM engine following {url}, {steps} steps, "
        f"max staleness {max_staleness}, in {root}")
    t0 = time.perf_counter()
    worker = _worker(py, url, rollouts, root / "rollout.log", check, secret)
    trainer = subprocess.Popen(
        torchrun_cmd(2, ["-m", "nemo_dcr_callback.recipes.rl_train", f"rl.rollouts={rollouts}", f"dcr.store={url}",
                         f"trainer.max_steps={steps}", f"rl.max_staleness={max_staleness}", f"hydra.run.dir={root}",
                         *overrides]),
        stdout=open(root / "trainer.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    restarts, killed_at = [], None
    try:
        while trainer.poll() is None:
            done = len(_jsonl(rollouts / rl_train.STEP_LOG))
            if kill_at and killed_at is None and done >= kill_at:
                killed_at = time.time()
                _kill(worker)
                say(f"  killed the rollout engine after step {done} (SIGKILL to its process group)"
                    + ("; starting it again" if restart else ""))
                if restart:
                    worker = _worker(py, url, rollouts, root / "rollout.log", check, secret)
                restarts.append({"after_step": done, "killed": killed_at, "restarted": restart})
            if worker.poll() is not None and not (killed_at and not restart):
                raise RuntimeError(f"the rollout worker exited ({worker.returncode}): see {root / 'rollout.log'}")
            time.sleep(0.2)
    finally:
        safe_io.write_whole(rollouts / rl_rollout.STOP, b"")  # (never through a link planted there)
        if trainer.poll() is None:  # the ranks too: left running, they would go on writing the store
            _kill(trainer)
        try:
            worker.wait(timeout=120)
        except subprocess.TimeoutExpired:
            _kill(worker)
    wall = time.perf_counter() - t0
    if trainer.returncode != 0:
        raise TrainerFailed(f"the trainer failed ({trainer.returncode}) after {wall:.0f} s: see "
                            f"{root / 'trainer.log'}:\n" + (root / "trainer.log").read_text()[-3000:])
    return _report(root, url, steps, max_staleness, restarts, wall, json_path, say)


def _report(root: Path, url: str, steps: int, k: int, restarts: list[dict], wall: float, json_path: str | None,
            say) -> dict:
    co = planner.Coefficients.load()
    store = open_store(url)
    train = _jsonl(root / "rollouts" / rl_train.STEP_LOG)
    events = _jsonl(root / "rollouts" / rl_rollout.LOG)
    batches = [e for e in events if e["event"] == "batch"]
    updates = [e for e in events if e["event"] in ("update", "start")]
    applied_at: dict[int, dict] = {}  # version -> the update (or start) that applied it
    for e in updates:
        for v in e["applied"]:
            applied_at.setdefault(v, e)
    checked = {e["check"]["version"] for e in updates if e.get("check")}
    rows = []
    for r in train:
        v = r["step"]  # the version this step published
        rec = commit.read_record(store, v)
        dec = commit.read_decision(store, v)
        ap = applied_at.get(v)
        params = rec["params"] if rec else 0
        rate = rec["changed"] / max(params, 1) if rec else 0.0
        dense_s, dcr_model_s = _dense_refit_s(co, params, rate, LINK_MBIT) if rec else (float("nan"), float("nan"))
        rows.append({**r, "version": v, "decision": dec["decision"] if dec else None,
                     "delta_bytes": rec["bytes"] if rec else None, "dense_bytes": 2 * params,
                     "change_rate": rate,
                     "pause_s": ap["pause_s"] if ap and ap["event"] == "update" else None,
                     "refit_s": ap["time"] - rec["time"] if ap and rec else None,
                     "applied": ap is not None, "checked": v in checked,
                     "dense_refit_link_s": dense_s, "dcr_refit_link_s": dcr_model_s})
    say(f"\n{'step':>4} {'reward':>7} {'stale':>5} {'delta':>9} {'dense':>9} {'ratio':>6} {'pause ms':>8} "
        f"{'refit s':>7} {'dense@link s':>12} {'dcr@link s':>10}  engine")
    for r in rows:
        ratio = r["dense_bytes"] / r["delta_bytes"] if r["delta_bytes"] else float("nan")
        pause = "" if r["pause_s"] is None else f"{1e3 * r['pause_s']:.1f}"
        refit = "" if r["refit_s"] is None else f"{r['refit_s']:.2f}"
        say(f"{r['step']:>4} {r['reward']:7.3f} {r['staleness']:>5} {(r['delta_bytes'] or 0) / 1e3:7.1f}kB "
            f"{r['dense_bytes'] / 1e3:7.1f}kB {ratio:5.1f}x "
            f"{pause:>8} {refit:>7} {r['dense_refit_link_s']:12.3f} "
            f"{r['dcr_refit_link_s']:10.3f}  "
            + ("bit-exact" if r["checked"] else "applied" if r["applied"] else "not applied"))
    first = [r["reward"] for r in rows[:5]]
    last = [r["reward"] for r in rows[-5:]]
    gen_s = sum(b["gen_s"] for b in batches)
    pause_s = sum(u["pause_s"] for u in updates if u["event"] == "update")
    tokens = sum(b["tokens"] for b in batches)
    stale = [r["staleness"] for r in rows]
    dropped = rows[-1]["dropped"] if rows else 0
    out = {
        "benchmark": "rl_loop", "steps": steps, "max_staleness": k, "wall_s": wall, "restarts": restarts,
        "reward_first5": statistics.mean(first) if first else None,
        "reward_last5": statistics.mean(last) if last else None,
        "reward_rise": (statistics.mean(last) / max(statistics.mean(first), 1e-9)) if first else None,
        "staleness_counts": {str(s): stale.count(s) for s in sorted(set(stale))}, "dropped_batches": dropped,
        "max_staleness_consumed": max(stale) if stale else None,
        "generation": {"tokens": tokens, "gen_s": gen_s, "pause_s": pause_s,
                       "tokens_per_s_without_pauses": tokens / gen_s if gen_s else None,
                       "tokens_per_s_with_pauses": tokens / (gen_s + pause_s) if gen_s else None,
                       "pause_cost_tokens": pause_s * tokens / gen_s if gen_s else None},
        "versions_applied": sorted(applied_at), "versions_checked": sorted(checked), "link_mbit": LINK_MBIT,
        "rows": rows,
    }
    from nemo_dcr_callback.bench.results import machine, write_json

    out["machine"] = machine()
    say(f"\nmean reward: first 5 steps {out['reward_first5']:.3f}, last 5 {out['reward_last5']:.3f} "
        f"({out['reward_rise']:.2f}x); staleness {out['staleness_counts']}, {dropped} stale batch(es) dropped; "
        f"generation {out['generation']['tokens_per_s_without_pauses']:.0f} tokens/s without the pauses, "
        f"{out['generation']['tokens_per_s_with_pauses']:.0f} with them; {len(checked)} versions checked bit-exact "
        f"against the dense export; {wall:.0f} s")
    if json_path:
        write_json(json_path, out)
    return out
