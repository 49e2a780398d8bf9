"""`make demo-rl` (`nemo-dcr demo --rl`): the asynchronous, agentic RL loop on one CPU machine.

    trainer (torchrun, 2 ranks, TP 2)                rollout worker (vLLM AsyncLLM, backend `dcr`)
      TIS policy gradient on groups <= k old    <--   r-NNNNNN.json: episodes, each token with the
      (pi / mu truncated at delta)                     version that sampled it and its logprob (mu)
      DCR callback: publish v+1 --> store -->          background: fetch, verify, decode, ack
                                                       64 episodes in flight, one request per turn;
                                                       pause (keep) -> apply -> resume while they run

The trainer (recipes/rl_train.py) and the worker (recipes/rl_rollout.py) share only the store
and the rollout folder. An arm is one such run; `run_arms` runs the main arm and its controls
one after the other (an lr=0 arm, a second seed), optionally kills the engine mid-run and
starts it again (it comes back on the newest committed version from the newest keyframe and
the deltas), prints one row per step and writes the measurements as JSON.
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
from nemo_dcr_callback.recipes import rl_rollout, rl_task, rl_train
from nemo_dcr_callback.transport.store import open_store

# The bound on the mean |log pi - log mu| over the tokens the engine sampled with the very weights
# the trainer holds. The same bits through two stacks (megatron's forward, fp32 products of bf16
# weights; vLLM's CPU kernels, bf16) differ by ~0.001-0.002 here, while one version off (one step
# at lr 1e-3) moves it by ~0.3-0.5 (an update that did not take: 0.46): 0.02 sits an order of
# magnitude from each (docs/PERFORMANCE.md, the RL loop).
LOGP_BOUND = 0.02
BUSY = 16  # requests in flight that make an update "under load" (the issue's bar: 30% of updates)
WINDOW_S = 1.0  # the throughput windows around updates
SLOT_S = 0.1  # their resolution


class TrainerFailed(RuntimeError):
    pass


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _worker(py: str, url: str, rollouts: Path, log: Path, args: list[str]) -> subprocess.Popen:
    cmd = [py, "-m", "nemo_dcr_callback.recipes.rl_rollout", "--store", url, "--rollouts", str(rollouts), *args]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    # its own session (the trainer's too): a kill takes every process it started with it
    return subprocess.Popen(cmd, stdout=open(log, "a"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _kill(p: subprocess.Popen) -> None:
    kill_tree(p.pid)  # its group and its tree: torchrun's ranks each run in a session of their own
    p.wait()


def run(steps: int = 30, workdir: str | None = None, kill_at: int = 0, restart: bool = True, check: bool = True,
        task: str = "search", max_staleness: int = 1, ahead: int = 2, seed: int = 0, lr: float | None = None,
        broken: str = "none", json_path: str | None = None, quiet: bool = False,
        overrides: tuple[str, ...] = (), worker_args: tuple[str, ...] = ()) -> dict:
    """One arm of the loop (both sides run in this interpreter's environment: vLLM's, with
    megatron-core)."""
    from nemo_dcr_callback.launcher import torchrun_cmd

    root = (Path(workdir) if workdir else Path("runs") / time.strftime("rl-%Y%m%d-%H%M%S")).resolve()
    rollouts, store_dir = root / "rollouts", root / "dcr-store"
    rollouts.mkdir(parents=True, exist_ok=True)
    url = "file://" + str(store_dir)
    py = sys.executable
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    say(f"nemo-dcr demo --rl: the {task} task; trainer on 2 CPU ranks (TP 2), a vLLM engine (backend dcr) "
        f"following {url}; {steps} steps, max staleness {max_staleness}, seed {seed}"
        + (f", lr {lr:g}" if lr is not None else "") + (f", BROKEN: {broken}" if broken != "none" else "")
        + f"; in {root}")
    wargs = ["--task", task, "--ahead", str(ahead), "--seed", str(seed), "--broken", broken,
             *(["--check"] if check else []), *worker_args]
    t0 = time.perf_counter()
    worker = _worker(py, url, rollouts, root / "rollout.log", wargs)
    trainer = subprocess.Popen(
        torchrun_cmd(2, ["-m", "nemo_dcr_callback.recipes.rl_train", f"rl.rollouts={rollouts}", f"dcr.store={url}",
                         f"trainer.max_steps={steps}", f"rl.max_staleness={max_staleness}", f"rl.task={task}",
                         f"trainer.seed={1234 + seed}", f"hydra.run.dir={root}",
                         *([f"optimizer.lr={lr}"] if lr is not None else []), *overrides]),
        stdout=open(root / "trainer.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    restarts, killed_at, shown = [], None, 0
    try:
        while trainer.poll() is None:
            rows = _jsonl(rollouts / rl_train.STEP_LOG)
            for r in rows[shown:]:
                say(_live_row(r))
            shown = len(rows)
            if kill_at and killed_at is None and len(rows) >= kill_at:
                killed_at = time.time()
                _kill(worker)
                say(f"  killed the rollout engine after step {len(rows)} (SIGKILL to its process group)"
                    + ("; starting it again" if restart else ""))
                if restart:
                    worker = _worker(py, url, rollouts, root / "rollout.log", wargs)
                restarts.append({"after_step": len(rows), "killed": killed_at, "restarted": restart})
            if worker.poll() is not None and not (killed_at and not restart):
                raise RuntimeError(f"the rollout worker exited ({worker.returncode}): see {root / 'rollout.log'}:\n"
                                   + (root / "rollout.log").read_text()[-3000:])
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
    out = report(root, url, steps, task, max_staleness, restarts, wall)
    out.update({"seed": seed, "lr": lr, "broken": broken, "ahead": ahead})
    say(summary(out))
    if json_path:
        from nemo_dcr_callback.bench.results import write_json

        write_json(json_path, out)
    return out


def _live_row(r: dict) -> str:
    same = r.get("same_version_absdiff")
    return (f"  step {r['step']:>3}  reward {r['reward']:.3f}  turns {r.get('turns', 0):.2f}  trained on "
            f"v{r['trained_on']} (staleness {r['staleness']}, tokens {r.get('token_staleness', {})})  ratio "
            f"{r.get('ratio_mean', 1):.3f}"
            f"+-{r.get('ratio_std', 0):.3f} clip {r.get('clip_frac', 0):.3f}  same-version |dlogp| "
            + ("-" if same is None else f"{same:.4f}") + f"  dropped {r['dropped']}+{r.get('dropped_groups', 0)}g")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def throughput_windows(times: list[float], updates: list[float], busy: list[float], w: float = WINDOW_S) -> dict:
    """Tokens per second while the engine had requests, within w / 2 of an update against the
    rest: the run cut into 0.1 s slots, only the slots with a busy sample counted (busy: the
    worker's 50 ms samples while it had any request; a slot it spent waiting for the trainer
    would count as slow). Wall clock, one process."""
    import bisect

    if not times or not busy:
        return {"around_updates": None, "without_updates": None}
    ups = sorted(updates)
    slots = sorted({int(b / SLOT_S) for b in busy})
    count: dict[int, int] = {}
    for t in times:
        count[int(t / SLOT_S)] = count.get(int(t / SLOT_S), 0) + 1
    near, far = [], []
    for k in slots:
        mid = (k + 0.5) * SLOT_S
        i = bisect.bisect_left(ups, mid - w / 2)
        (near if i < len(ups) and ups[i] <= mid + w / 2 else far).append(count.get(k, 0))
    rate = (lambda xs: sum(xs) / (len(xs) * SLOT_S) if xs else None)  # noqa: E731
    return {"around_updates": rate(near), "without_updates": rate(far), "busy_s_around": len(near) * SLOT_S,
            "busy_s_without": len(far) * SLOT_S, "window_s": w}


def report(root: Path, url: str, steps: int, task: str, k: int, restarts: list[dict], wall: float) -> dict:
    store = open_store(url)
    train = _jsonl(root / "rollouts" / rl_train.STEP_LOG)
    events = _jsonl(root / "rollouts" / rl_rollout.LOG)
    updates = [e for e in events if e["event"] == "update"]
    starts = [e for e in events if e["event"] == "start"]
    batches = [e for e in events if e["event"] == "batch"]
    launched = {(e["instance"], e["group"]) for e in events if e["event"] == "launch"}
    written = {(b["instance"], g) for b in batches for g in b["groups"]}
    checked = {e["check"]["version"] for e in updates + starts if e.get("check")}
    applied = sorted({v for e in updates + starts for v in e["applied"]})
    rows = []
    for r in train:
        v = r["step"]  # the version this step published
        rec = commit.read_record(store, v)
        dec = commit.read_decision(store, v)
        rows.append({**r, "version": v, "decision": dec["decision"] if dec else None,
                     "delta_bytes": rec["bytes"] if rec else None, "dense_bytes": 2 * rec["params"] if rec else None,
                     "change_rate": rec["changed"] / max(rec["params"], 1) if rec else None})
    last5 = [r["reward"] for r in rows[-5:]]
    stale = [r["staleness"] for r in rows]
    tok_stale: dict[str, int] = {}
    for r in rows:
        for s, n in r.get("token_staleness", {}).items():
            tok_stale[s] = tok_stale.get(s, 0) + n
    same = [r["same_version_absdiff"] for r in rows if r.get("same_version_absdiff") is not None]
    tokens = [t for e in events if e["event"] == "tokens" for t in e["times"]]
    busy = [t for e in events if e["event"] == "tokens" for t in e.get("busy", [])]
    at = [u["at"] for u in updates]
    rates = [r["change_rate"] for r in rows if r["change_rate"] is not None]
    ratio = [r["dense_bytes"] / r["delta_bytes"] for r in rows if r["delta_bytes"]]
    t = rl_task.TASKS[task]
    return {
        "benchmark": "rl_loop", "task": task, "steps": steps, "max_staleness": k, "wall_s": wall,
        "no_feedback_ceiling": t.no_feedback_ceiling() if not t.secret else None,
        "random_policy_reward": t.random_reward(),
        "reward_first5": statistics.mean(r["reward"] for r in rows[:5]) if rows else None,
        "reward_last5": statistics.mean(last5) if last5 else None,
        "staleness_counts": {str(s): stale.count(s) for s in sorted(set(stale))},
        "token_staleness": tok_stale, "max_staleness_consumed": max(stale) if stale else None,
        "dropped_batches": rows[-1]["dropped"] if rows else 0,
        "dropped_groups": rows[-1].get("dropped_groups", 0) if rows else 0,
        "updates": {"count": len(updates), "in_flight": [u["in_flight"] for u in updates],
                    "busy_fraction": (sum(u["in_flight"] >= BUSY for u in updates) / len(updates)) if updates else None,
                    "pause_s_median": _median([u["pause_s"] for u in updates]),
                    "pause_s_max": max((u["pause_s"] for u in updates), default=None),
                    "pause_call_s_median": _median([u["pause_call_s"] for u in updates]),
                    "apply_s_median": _median([u["apply_s"] for u in updates])},
        "throughput": throughput_windows(tokens, at, busy),
        "episodes": sum(b["episodes"] for b in batches),
        "episodes_spanning_versions": sum(b["multi_version"] for b in batches),
        "logprob_check": {"same_version_absdiff_median": _median(same),
                          "same_version_absdiff_max": max(same, default=None), "steps_with_same_version": len(same),
                          "ratio_std_median": _median([r["ratio_std"] for r in rows if "ratio_std" in r]),
                          "clip_frac_mean": statistics.mean(r["clip_frac"] for r in rows) if rows else None},
        "change_rate_median": _median(rates), "delta_ratio_median": _median(ratio),
        "restarts": restarts, "engine_starts": [{k2: s[k2] for k2 in ("version", "keyframe", "applied", "start_s")}
                                                for s in starts],
        # a killed engine's episodes in flight are lost with it (the trainer never sees them): its
        # groups launched and never written (the last instance's at the stop are not counted)
        "episodes_lost_in_kills": sum(s["group"] for s in starts[:-1]
                                      for i, _ in launched - written if i == s["instance"]),
        "versions_applied": applied, "versions_checked": sorted(checked),
        "rows": rows,
    }


def summary(out: dict) -> str:
    u, th, lc = out["updates"], out["throughput"], out["logprob_check"]
    f = (lambda x, spec=".3f": "-" if x is None else format(x, spec))  # noqa: E731
    return (f"\n{out['task']}: reward first 5 steps {f(out['reward_first5'])}, last 5 {f(out['reward_last5'])} "
            f"(random policy {f(out['random_policy_reward'])}, no-feedback ceiling {f(out['no_feedback_ceiling'])}); "
            f"staleness {out['staleness_counts']}, tokens by staleness {out['token_staleness']}, "
            f"{out['dropped_batches']} batch(es) and {out['dropped_groups']} group(s) dropped\n"
            f"  {u['count']} updates, {f(u['busy_fraction'], '.0%')} with >= {BUSY} requests in flight; pause "
            f"(client) median {f(u['pause_s_median'] and 1e3 * u['pause_s_median'], '.1f')} ms, max "
            f"{f(u['pause_s_max'] and 1e3 * u['pause_s_max'], '.1f')} ms; tokens/s around updates "
            f"{f(th['around_updates'], '.0f')} vs {f(th['without_updates'], '.0f')} without\n"
            f"  {out['episodes_spanning_versions']} of {out['episodes']} episodes span 2+ versions; same-version "
            f"|log pi - log mu| median {f(lc['same_version_absdiff_median'], '.4f')}, max "
            f"{f(lc['same_version_absdiff_max'], '.4f')}; change rate {f(out['change_rate_median'], '.1%')}, "
            f"delta {f(out['delta_ratio_median'], '.1f')}x smaller than dense; {len(out['versions_checked'])} versions "
            f"checked bit-exact against the dense export; {out['wall_s']:.0f} s")


MARGIN = 0.10  # stated before the runs: the main arm's last-5 reward must clear the no-feedback ceiling by this


def run_arms(steps: int = 40, control_steps: int = 12, workdir: str | None = None, kill_at: int = 0,
             task: str = "search", max_staleness: int = 1, ahead: int = 2, arms: tuple[str, ...] = ("main", "lr0",
                                                                                                    "seed2"),
             json_path: str | None = None, quiet: bool = False, **kw) -> dict:
    """The main arm and its controls, one after the other, each a whole loop of its own: `lr0`
    (the same seed, learning rate 0: the reward an unchanged policy gets through the same loop)
    and `seed2` (another seed for the trainer's initialisation and the worker's draws)."""
    root = (Path(workdir) if workdir else Path("runs") / time.strftime("rl-%Y%m%d-%H%M%S")).resolve()
    plan = {"main": dict(steps=steps, seed=0, kill_at=kill_at), "lr0": dict(steps=control_steps, seed=0, lr=0.0),
            "seed2": dict(steps=steps, seed=1), "stale": dict(steps=control_steps, seed=0, max_staleness=2, ahead=4)}
    out: dict = {"benchmark": "rl_loop", "task": task, "margin": MARGIN, "arms": {}}
    for name in arms:
        args = {"max_staleness": max_staleness, "ahead": ahead, **plan[name]}
        out["arms"][name] = run(workdir=str(root / name), task=task, quiet=quiet, **args, **kw)
    main = out["arms"].get("main")
    t = rl_task.TASKS[task]
    if main is not None and main["reward_last5"] is not None:
        v = {"reward_last5": main["reward_last5"]}
        if not t.secret:
            v["ceiling_plus_margin"] = t.no_feedback_ceiling() + MARGIN
            v["clears_ceiling"] = main["reward_last5"] >= v["ceiling_plus_margin"]
        if "lr0" in out["arms"]:
            v["lr0_reward_last5"] = out["arms"]["lr0"]["reward_last5"]
            v["at_least_2x_lr0"] = main["reward_last5"] >= 2 * v["lr0_reward_last5"]
        if "seed2" in out["arms"]:
            v["seed2_reward_last5"] = out["arms"]["seed2"]["reward_last5"]
        v["busy_updates"] = main["updates"]["busy_fraction"]
        out["verdicts"] = v
        if not quiet:
            print("\nverdicts: " + json.dumps(v), flush=True)
    from nemo_dcr_callback.bench.results import machine, write_json

    out["machine"] = machine()
    if json_path:
        write_json(json_path, out)
    return out
