"""The RL loop's rollout worker (`nemo-dcr demo --rl`): a vLLM AsyncLLM engine with the `dcr`
weight-transfer backend (selected by configuration, as a user runs it), playing episodes of a
task (recipes/rl_task.py) with many in flight, one request per turn, and taking each new
policy version while they run:

    python -m nemo_dcr_callback.recipes.rl_rollout --store URL --rollouts DIR [--check]

- Episodes: `--in-flight` at once (groups of `--group` sharing a prompt and a secret). Each turn
  is one request, sampled over the task's values with the engine's processed logprobs (the
  behaviour policy mu, normalised over those values as the trainer normalises pi); the engine
  labels every output token with the weight version that sampled it (vLLM's weight_versions),
  so an episode that spans updates says which version sampled which turn.
- Updates: the backend follows the store in the background (fetch, verify, decode, ack). Once
  a newer version is committed and this engine has acked it (readied), the worker pauses the
  engine with mode `keep` (running requests stay, with their tokens; the pause resets the
  prefix cache, preempting them, so their KV is recomputed with the new weights), applies
  (update_weights), labels the new version (finish_weight_update) and resumes. The pause is
  measured here, as the client sees it, with the requests in flight at its start.
- Batches: completed groups are written to the rollout folder, `--groups` per batch, at most
  `--ahead` batches ahead of the trainer's cursor; the trainer drops what is too stale.
- With --check every version the engine comes to hold is compared, bit for bit, with the
  trainer's dense export of it (the oracle: gather and convert on the trainer; dcr.verify
  writes it), after the resume.
- A worker started again (after a crash) loads the newest committed keyframe, applies every
  committed version since (a replay bounded by the trainer's keyframe_every), and goes on
  numbering batches after the last one written: the trainer sees no gap. Episodes that were
  in flight in a killed worker are lost with it: the report counts them from this log
  ("launch" events without a batch).

Stops when <rollouts>/STOP exists, or after --batches.
"""

from __future__ import annotations

import argparse
import asyncio
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
# a deliberately wrong update, the logprob check's negative control: "unapplied" labels each new
# version without applying it (an update that silently did not take: the engine samples with
# old weights under the new version's name; no digest is asked, as none is for a no-op)
BROKEN = ("none", "unapplied")


def export_keyframe(store, out: Path, timeout: float = 600.0, version: int = 0) -> Path:
    """The model folder the engine starts from: keyframe `version` (config and weights) of the
    store, waiting for the trainer to write it."""
    deadline = time.monotonic() + timeout
    while not (store.exists(keys.keyframe_model(version)) and store.exists(keys.keyframe_config(version))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{store.url} has no keyframe after {timeout:.0f} s: has the trainer started?")
        time.sleep(0.1)
    # (in the shared rollout folder: a link planted at the folder or its files is refused)
    os.close(safe_io.open_dir(out.parent, out.name, create=True))
    for name, key in ((keys.CONFIG_FILE, keys.keyframe_config(version)),
                      (keys.MODEL_FILE, keys.keyframe_model(version))):
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


def newest_ready(store, held: int, receiver_id: str | None) -> int | None:
    """The newest committed version above `held` that this engine has acked (readied in the
    background: its apply is a copy), or None. receiver_id None: the newest committed."""
    for v in sorted((v for v in commit.list_versions(store) if v > held), reverse=True):
        d = commit.read_decision(store, v)
        if d is not None and d["decision"] == "commit":
            return v if receiver_id is None or receiver_id in commit.read_acks(store, v) else None
    return None


def start_version(store) -> int:
    """Where a (re)started engine begins: the newest keyframe of a committed version."""
    from nemo_dcr_callback.protocol.rebuild import latest_keyframe

    return latest_keyframe(store) or 0


class Worker:
    """The engine, its episodes in flight and its updates (see the module docstring)."""

    def __init__(self, a, engine, store, folder: Path, task: rl_task.Task, log, held: int):
        self.a, self.engine, self.store, self.folder, self.task, self.log = a, engine, store, folder, task, log
        self.held = held
        self.running = 0  # requests in the engine now
        self.inflight_groups = 0
        self.done_groups: list[list[rl_task.Episode]] = []
        self.next_batch = _next_batch(folder)
        self.rng = random.Random(a.seed * 1000003 + self.next_batch)
        self.instance = os.getpid()
        self.group_n = 0
        self.request_n = 0
        self.token_times: list[float] = []
        self.busy_times: list[float] = []  # sampled every 50 ms while requests were in the engine
        self.stopping = False
        self.error: BaseException | None = None

    def event(self, ev: dict) -> None:
        self.log.write(json.dumps({**ev, "time": time.time()}) + "\n")
        self.log.flush()

    # -------------------------------------------------------------- episodes
    async def turn(self, ep: rl_task.Episode) -> tuple[int, float, int]:
        """One request: the policy's next guess, its logprob under the behaviour policy and the
        weight version that sampled it (the engine's label)."""
        import vllm

        sp = vllm.SamplingParams(max_tokens=1, temperature=1.0, allowed_token_ids=self.task.allowed, logprobs=0)
        self.request_n += 1
        rid = f"{self.instance}-{self.request_n}"
        final = None
        self.running += 1
        try:
            async for out in self.engine.generate({"prompt_token_ids": list(ep.tokens)}, sp, request_id=rid):
                final = out
        finally:
            self.running -= 1
        c = final.outputs[0]
        tok = c.token_ids[0]
        spans = c.weight_versions or []
        if len(spans) != 1:
            raise RuntimeError(f"request {rid}: {len(spans)} weight-version spans for one token ({spans})")
        self.token_times.append(time.time())
        return tok, float(c.logprobs[0][tok].logprob), int(spans[0].version)

    async def play(self, ep: rl_task.Episode, secret: int) -> None:
        while True:
            tok, lp, v = await self.turn(ep)
            if not rl_task.play(self.task, ep, secret, tok, lp, v):
                return

    async def group(self) -> None:
        g = self.group_n
        self.group_n += 1
        eps, secret = rl_task.start_group(self.task, self.rng, g, self.a.group)
        self.event({"event": "launch", "instance": self.instance, "group": g})
        try:
            await asyncio.gather(*(self.play(e, secret) for e in eps))
        finally:
            self.inflight_groups -= 1
        self.done_groups.append(eps)
        if len(self.done_groups) >= self.a.groups:
            self.write_batch()

    def write_batch(self) -> None:
        groups, self.done_groups = self.done_groups[:self.a.groups], self.done_groups[self.a.groups:]
        eps = [e for g in groups for e in g]
        i = self.next_batch
        version = min(e.version for e in eps)
        batch = {"batch": i, "version": version, "episodes": [e.to_json() for e in eps],
                 "tokens": sum(len(e.mine) for e in eps), "time": time.time()}
        rl_task.write_whole(rl_task.batch_path(self.folder, i), json.dumps(batch))  # the trainer reads whole batches
        self.event({"event": "batch", "batch": i, "instance": self.instance, "groups": [g[0].group for g in groups],
                    "version": version, "versions": sorted({v for e in eps for v in e.versions}),
                    "multi_version": sum(1 for e in eps if len(set(e.versions)) > 1), "episodes": len(eps),
                    "reward": sum(e.reward for e in eps) / len(eps), "turns": batch["tokens"]})
        self.next_batch += 1

    def room(self) -> bool:
        """Launch another group? Only while the batches it would complete stay within --ahead of
        the trainer's cursor (a worker running further ahead only makes rollouts to drop)."""
        queued = len(self.done_groups) + self.inflight_groups
        batches_ahead = self.next_batch - taken(self.folder) + queued // self.a.groups
        return self.inflight_groups * self.a.group < self.a.in_flight and batches_ahead < self.a.ahead

    async def launcher(self) -> None:
        tasks: set[asyncio.Task] = set()
        while not self.stopping:
            if self.room():
                self.inflight_groups += 1
                t = asyncio.create_task(self.group())
                tasks.add(t)
                t.add_done_callback(self._done)
                t.add_done_callback(tasks.discard)
                continue
            await asyncio.sleep(0.01)
        for t in list(tasks):
            t.cancel()

    def _done(self, t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None and self.error is None:
            self.error = t.exception()
            self.stopping = True

    # -------------------------------------------------------------- updates
    async def update(self, v: int) -> None:
        """pause (keep) -> apply -> label -> resume, timed as the client sees it."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        e, broken = self.engine, self.a.broken
        inflight = self.running
        t0 = time.perf_counter()
        await e.start_weight_update()
        # the pause resets the prefix cache and preempts the kept requests (their KV is recomputed
        # with the new weights), or fails
        await e.pause_generation(mode="keep", clear_cache=True)
        t1 = time.perf_counter()
        try:
            if broken != "unapplied":
                await e.update_weights(WeightTransferUpdateRequest(update_info={"version": v}))
            await e.finish_weight_update(weight_version=str(v))
            t2 = time.perf_counter()
        finally:
            await e.resume_generation()
        t3 = time.perf_counter()
        applied = list(range(self.held + 1, v + 1))
        self.held = v
        check = await self.check(v)
        self.event({"event": "update", "applied": applied, "held": v, "in_flight": inflight,
                    "pause_s": t3 - t1, "pause_call_s": t3 - t0, "apply_s": t2 - t1, "check": check,
                    "at": time.time() - (time.perf_counter() - t1)})

    async def check(self, v: int) -> dict | None:
        if not self.a.check or v < 1 or self.a.broken != "none":  # (a broken run is the logprobs' to catch)
            return None
        from nemo_dcr_callback.integrations.vllm_transfer import check_export

        deadline = time.monotonic() + 120  # the trainer writes the export after publishing the version
        while not await asyncio.to_thread(self.store.exists, commit.verify_key(v)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rl_rollout: no dense export of version {v} after 120 s (dcr.verify?)")
            await asyncio.sleep(0.05)
        c = (await self.engine.collective_rpc(check_export, args=(v,)))[0]
        if c["differ"]:
            raise RuntimeError(f"rl_rollout: version {v} differs from its dense export in {c['differ'][:3]}")
        return {k: c[k] for k in ("version", "checked", "differ")}

    async def follower(self) -> None:
        # (unapplied: the backend readies only so far ahead of what it holds; the labels go on)
        rid = self.a.receiver_id if self.a.broken == "none" else None
        while not self.stopping:
            v = await asyncio.to_thread(newest_ready, self.store, self.held, rid)
            if v is None:
                await asyncio.sleep(0.05)
                continue
            await self.update(v)

    async def watch_stop(self) -> None:
        while not self.stopping:
            if (self.folder / STOP).exists() or (self.a.batches and self.next_batch - self.first >= self.a.batches):
                self.stopping = True
            if self.running:  # (the throughput comparison takes only windows where the engine had work)
                self.busy_times.append(time.time())
            await asyncio.sleep(0.05)

    async def run(self) -> None:
        self.first = self.next_batch
        jobs = [asyncio.create_task(c) for c in (self.launcher(), self.follower(), self.watch_stop())]
        try:
            while not self.stopping:
                await asyncio.sleep(0.05)
                for j in jobs:
                    if j.done() and j.exception() is not None:
                        raise j.exception()
            if self.error is not None:
                raise self.error
        finally:
            self.stopping = True
            for j in jobs:
                j.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            self.event({"event": "tokens", "instance": self.instance, "times": self.token_times,
                        "busy": self.busy_times})


async def amain(a) -> int:
    # collective_rpc's callables and answers cross vLLM's engine-core pipe pickled, between this
    # process and the engine it starts
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import AsyncEngineArgs
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.v1.engine.async_llm import AsyncLLM

    task = rl_task.TASKS[a.task]
    folder = Path(a.rollouts)
    folder.mkdir(parents=True, exist_ok=True)
    store = open_store(a.store)
    t0 = time.perf_counter()
    model_dir = await asyncio.to_thread(export_keyframe, store, folder / "engine-v0", 600.0, 0)  # (the trainer is up)
    kf = start_version(store)
    if kf:  # a restart past keyframe 0: the newest one
        model_dir = await asyncio.to_thread(export_keyframe, store, folder / f"engine-v{kf}", 600.0, kf)
    args = AsyncEngineArgs(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                           max_model_len=2 * task.seq, seed=a.seed, gpu_memory_utilization=0.1,
                           weight_transfer_config={"backend": "dcr"}, logprobs_mode="processed_logprobs",
                           max_num_seqs=max(a.in_flight, 8))
    engine = AsyncLLM.from_engine_args(args)
    try:
        await engine.init_weight_transfer_engine(WeightTransferInitRequest(
            init_info={"store": store.url, "receiver_id": a.receiver_id, "version": kf}))
        # (re)start: every version committed by now, from the keyframe's deltas
        newest = newest_ready(store, kf, None) or kf
        if newest > kf:
            await engine.start_weight_update()
            await engine.update_weights(WeightTransferUpdateRequest(update_info={"version": newest}))
            await engine.finish_weight_update(weight_version=str(newest))
        else:
            await engine.update_weight_version(str(newest))  # (the label vLLM puts on every output token)
        log = rl_task.open_log(folder / LOG)
        w = Worker(a, engine, store, folder, task, log, newest)
        w.event({"event": "start", "version": newest, "keyframe": kf, "applied": list(range(kf + 1, newest + 1)),
                 "start_s": time.perf_counter() - t0, "check": await w.check(newest), "instance": w.instance,
                 "task": task.name, "group": a.group})
        print(f"rl_rollout: engine on version {newest} (keyframe {kf}) after {time.perf_counter() - t0:.1f} s",
              flush=True)
        await w.run()
        log.close()
    finally:
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemo_dcr_callback.recipes.rl_rollout")
    ap.add_argument("--store", required=True)
    ap.add_argument("--rollouts", required=True, help="folder the trainer reads batches from")
    ap.add_argument("--task", choices=sorted(rl_task.TASKS), default="search")
    ap.add_argument("--group", type=int, default=8, help="episodes per group (a prompt and a secret: GRPO's group)")
    ap.add_argument("--groups", type=int, default=8, help="groups per batch")
    ap.add_argument("--in-flight", type=int, default=64, help="episodes played at once")
    ap.add_argument("--receiver-id", default="rollout-0")
    ap.add_argument("--check", action="store_true", help="check every version held against its dense export")
    ap.add_argument("--broken", choices=BROKEN, default="none",
                    help="a deliberately wrong update (a negative control of the logprob check)")
    ap.add_argument("--batches", type=int, default=0, help="stop after this many batches (0: at STOP)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ahead", type=int, default=2, help="batches written and not yet taken by the trainer, at most")
    a = ap.parse_args(argv)
    for name in ("group", "groups", "in_flight", "ahead"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return asyncio.run(amain(a))


if __name__ == "__main__":
    sys.exit(main())
