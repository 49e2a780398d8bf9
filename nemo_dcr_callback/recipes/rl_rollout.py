"""The RL loop's rollout worker (`nemo-dcr demo --rl`): a vLLM engine following the trainer's
store through the DCR worker extension, generating episodes of the task (recipes/rl_task.py)
in batches, each on one policy version, written to the rollout folder for the trainer.

    python -m nemo_dcr_callback.recipes.rl_rollout --store URL --rollouts DIR [--check]

Between two batches the engine applies what the background follower has readied (fetched,
verified, decoded and acked while the engine generated): the engine's pause is the apply.
With --check every version it comes to hold is compared, bit for bit, with the trainer's dense
export of it (the oracle: gather and convert on the trainer; dcr.verify writes it). A worker
started again (after a crash) loads the keyframe, applies every committed version since, and
goes on numbering batches after the last one written: the trainer sees no gap.
Stops when <rollouts>/STOP exists, or after --batches.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

from nemo_dcr_callback import safe_io
from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.protocol.records import read_limit
from nemo_dcr_callback.recipes import rl_task
from nemo_dcr_callback.transport.store import open_store

STOP = "STOP"
LOG = "rollout.jsonl"


def export_keyframe(store, out: Path, timeout: float = 600.0) -> Path:
    """The model folder the engine starts from: the store's keyframe 0 (config and weights),
    waiting for the trainer to write it."""
    deadline = time.monotonic() + timeout
    while not (store.exists(keys.keyframe_model(0)) and store.exists(keys.keyframe_config(0))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{store.url} has no keyframe after {timeout:.0f} s: has the trainer started?")
        time.sleep(0.1)
    # (in the shared rollout folder: a link planted at the folder or its files is refused)
    os.close(safe_io.open_dir(out.parent, out.name, create=True))
    for name, key in ((keys.CONFIG_FILE, keys.keyframe_config(0)), (keys.MODEL_FILE, keys.keyframe_model(0))):
        safe_io.write_whole(out / name, store.get(key, limit=read_limit(key)))
    return out


_BATCH_NAME = re.compile(r"r-([0-9]{6})\.json")


def _next_batch(folder: Path) -> int:
    done = [int(m.group(1)) for p in folder.iterdir() if (m := _BATCH_NAME.fullmatch(p.name))]
    return max(done) + 1 if done else 0


_said: set[str] = set()


def taken(folder: Path) -> int:
    """How many batches the trainer has taken (consumed or dropped): its queue's cursor (0
    before it wrote one, or while it is unreadable: a link, a folder, too large, not a number;
    said once per reason)."""
    try:
        return rl_task.read_cursor(folder)
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as exc:
        if str(exc) not in _said:
            _said.add(str(exc))
            rl_task.warn(f"the trainer's cursor is unreadable, taken as 0: {exc}")
        return 0


def generate(llm, version: int, pairs: list[tuple[int, int]], group: int, secret: str):
    """One batch: `group` episodes of each prompt, two turns, the environment between them.
    (No per-request seed: vLLM gives every request with one seed the same draws, so every
    prompt's group would guess alike; the engine's own seed still seeds its sampling.)"""
    import vllm

    sp = vllm.SamplingParams(n=group, max_tokens=1, temperature=1.0, allowed_token_ids=rl_task.DIGITS)
    outs = llm.generate([{"prompt_token_ids": rl_task.prompt(a, b)} for a, b in pairs], sp, use_tqdm=False)
    episodes = [rl_task.first_turn(a, b, c.token_ids[0], version, gi, secret)
                for gi, ((a, b), o) in enumerate(zip(pairs, outs, strict=True)) for c in o.outputs]
    again = [e for e in episodes if e.tokens[-1] != rl_task.RIGHT]
    if again:
        sp2 = vllm.SamplingParams(n=1, max_tokens=1, temperature=1.0, allowed_token_ids=rl_task.DIGITS)
        outs2 = llm.generate([{"prompt_token_ids": list(e.tokens)} for e in again], sp2, use_tqdm=False)
        for e, o in zip(again, outs2, strict=True):
            rl_task.second_turn(e, o.outputs[0].token_ids[0], secret)
    return episodes, len(episodes) + len(again)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemo_dcr_callback.recipes.rl_rollout")
    ap.add_argument("--store", required=True)
    ap.add_argument("--rollouts", required=True, help="folder the trainer reads batches from")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per batch")
    ap.add_argument("--group", type=int, default=8, help="episodes per prompt (the GRPO group)")
    ap.add_argument("--secret", choices=sorted(rl_task.SECRETS), default="first")
    ap.add_argument("--receiver-id", default="rollout-0")
    ap.add_argument("--check", action="store_true", help="check every version held against its dense export")
    ap.add_argument("--batches", type=int, default=0, help="stop after this many batches (0: at STOP)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ahead", type=int, default=1, help="batches written and not yet taken by the trainer, at most")
    a = ap.parse_args(argv)
    # collective_rpc's answers (dicts) cross vLLM's engine-core pipe pickled, between this
    # process and the engine it starts (as the tests run it)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import vllm

    from nemo_dcr_callback.integrations.vllm_serve import EXT

    folder = Path(a.rollouts)
    folder.mkdir(parents=True, exist_ok=True)
    store = open_store(a.store)
    model_dir = export_keyframe(store, folder / "engine-v0")
    t0 = time.perf_counter()
    llm = vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                   max_model_len=2 * rl_task.SEQ, worker_extension_cls=EXT, seed=a.seed, gpu_memory_utilization=0.1)
    llm.collective_rpc("dcr_attach", args=(store.url,), kwargs={"receiver_id": a.receiver_id})
    # (re)start: every version committed by now, from the keyframe's deltas
    up = llm.collective_rpc("dcr_update", kwargs={"wait": True})[0]
    if up["refused"]:
        raise SystemExit(f"rl_rollout: version refused at start: {up['refused']}")
    log = rl_task.open_log(folder / LOG)

    def check(version: int) -> dict | None:
        if not a.check or version < 1:
            return None
        deadline = time.monotonic() + 120  # the trainer writes the export after publishing the version
        while not store.exists(commit.verify_key(version)) and time.monotonic() < deadline:
            time.sleep(0.05)
        c = llm.collective_rpc("dcr_check_export", args=(version,))[0]
        if c["differ"]:
            raise SystemExit(f"rl_rollout: version {version} differs from its dense export in {c['differ'][:3]}")
        return c

    start = {"event": "start", "version": up["version"], "applied": up["applied"], "start_s": time.perf_counter() - t0,
             "check": check(up["version"]), "time": time.time()}
    log.write(json.dumps(start) + "\n")
    log.flush()
    print(f"rl_rollout: engine on version {up['version']} after {start['start_s']:.1f} s "
          f"(applied {up['applied'] or 'none'})", flush=True)
    i = _next_batch(folder)
    rng = random.Random(a.seed * 1000003 + i)
    written = 0
    while not (folder / STOP).exists() and not (a.batches and written >= a.batches):
        # between batches: apply what is ready (the engine's pause), and the KV cache of the old
        # weights goes; then generate only if the trainer has taken the last batch (at most
        # `ahead` waiting): a worker running ahead would only make stale rollouts
        up = llm.collective_rpc("dcr_update", kwargs={"wait": False})[0]
        if up["refused"]:
            print(f"rl_rollout: a version was refused: {up['refused']}", file=sys.stderr, flush=True)
        if up["applied"]:
            if not llm.reset_prefix_cache():  # (nothing runs between batches: a refusal is a fault)
                raise RuntimeError(f"rl_rollout: the engine refused to reset its prefix cache after version "
                                   f"{up['version']}: its cached KV is from the old weights")
            log.write(json.dumps({"event": "update", "applied": up["applied"], "pause_s": up["pause_s"],
                                  "fetch_decode_s": up["fetch_decode_s"], "held": up["version"],
                                  "check": check(up["version"]), "time": time.time()}) + "\n")
            log.flush()
        if i - taken(folder) >= a.ahead:
            time.sleep(0.02)
            continue
        version = up["version"]
        tg = time.perf_counter()
        episodes, tokens = generate(llm, version, rl_task.prompts(a.prompts, rng), a.group, a.secret)
        gen_s = time.perf_counter() - tg
        batch = {"batch": i, "version": version, "episodes": [e.to_json() for e in episodes], "gen_s": gen_s,
                 "tokens": tokens, "time": time.time()}
        rl_task.write_whole(rl_task.batch_path(folder, i), json.dumps(batch))  # the trainer reads whole batches
        log.write(json.dumps({"event": "batch", "batch": i, "version": version, "gen_s": gen_s, "tokens": tokens,
                              "applied": [], "time": time.time()}) + "\n")
        log.flush()
        written += 1
        i += 1
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
