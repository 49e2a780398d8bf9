"""What the soak checks, continuously and at the end (docs/FAULTS.md, "The chaos soak"):

1. a receiver applies only committed versions (every apply, against the decisions seen in the
   store), bit-exact with the dense export of that version: the transformers receivers compare
   every version (`--verify`), the directory receivers are stopped on a sample and their files
   compared with the export (the FP8 one with the export converted by `convert`);
2. gc never deletes a committed version a live registered receiver still needs;
3. every receiver holds the newest committed version within `converge_s` of the faults stopping;
4. no trainer step waits longer than the ack timeout (plus slack) because of a receiver or a
   relay: gaps are excused only while the trainer itself or S3 is under a fault;
5. RSS of every long-lived process grows at most 10% after warm-up (the minute after its own
   "ready": a receiver's ready event, a relay listening, the trainer's first step; not after
   its start, which measured start-up speed on a loaded machine; the S3 server, whose caches
   fill to their configured sizes: under a ceiling), and the store's bytes stay
   below 2 keyframes + (keyframe_every + 2 gc intervals + 20) versions (export and delta)."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

from nemo_dcr_callback.protocol import commit
from tests.soak import accounting
from tests.soak.fleet import STOP_WITHIN_S, stop_trainer
from tests.soak.oracle import DenseOracle

RSS_GROWTH = 0.10
# warm-up: the minute after the process said it was ready. Measured from its start instead (a
# minute, or a quarter of its life), a vLLM engine still loading on 2 loaded cores "grew 63%"
# (1,935 -> 3,155 MB, flat after that) on one seed and passed on the next: the verdict
# measured the machine's load (issue 68)
RSS_WARMUP_S = 60.0
RSS_MIN_LIFE_S = 180.0  # from ready
# what each kind of process prints once it serves (its own log, first match per instance)
STEP_CLOCK = re.compile(r"NEMO_DCR_STEP_CLOCK ([0-9]+) ([0-9]+\.[0-9]+)")
READY = (("trainer", "NEMO_DCR_STEP_CLOCK "), ("relay", ": listening on "), ("rx", '"event": "ready"'))
# SeaweedFS (the store, not the product) fills its read cache and Go heap to their configured
# sizes (run.S3_ARGS, S3_ENV): its bound is a ceiling. Measured with a put/get/delete churn:
# default flags, 113 -> 585 MB in 100 s, then flat; the soak's long runs grew 430 -> 546 MB.
S3_RSS_CEILING_MB = 640.0
# A relay's part cache is memory it is configured to fill (run.py starts them with this much):
# its growth is allowed that on top of the 10%. With the default 1 GB cache, relay-region's
# RSS grew 10.6% over 1,200 s of the long soak (263 -> 290 MB): the cache filling, not a leak.
RELAY_CACHE_MB = 32
STALL_SLACK_S = 10.0
RECEIVERS = ("rx-hf", "rx-s3", "rx-dir", "rx-fp8")
# the receivers a fault on each part reaches (the rest: all of them)
BEHIND = {"relay-region": ("rx-hf", "rx-dir"), "relay-root": ("rx-hf", "rx-dir", "rx-fp8", "rx-vllm")}


class Watch(DenseOracle):
    """Polls the store (decisions, registrations, bytes), tails the receivers' JSON lines and
    samples RSS; collects violations as they happen."""

    def __init__(self, store, procs: dict, cfg, receivers: tuple[str, ...] = RECEIVERS):
        self.store, self.procs, self.cfg, self.receivers = store, procs, cfg, receivers
        self.t0 = time.monotonic()
        self.decisions: dict[int, str] = {}
        self.decided_at: dict[int, float] = {}
        self.held: dict[str, int] = {}
        self.applied: dict[str, list[tuple[int, float]]] = {r: [] for r in receivers}
        self.ready: dict[str, int] = {r: 0 for r in receivers}
        self.verified = 0
        self.samples: list[dict] = []
        self.disk: list[tuple[float, int, int, dict]] = []
        self.gc_runs: list[dict] = []
        self.violations: list[str] = []
        self.first_violation_t: float | None = None
        self.steps: list[tuple[int, int, float]] = []  # (trainer start, step index, monotonic)
        self.convergence: dict = {}
        self.trainer_stopped_at: float | None = None
        self._offsets: dict[str, int] = {}
        self._log_instance: dict[str, int] = {}  # process -> the instance its log is at
        self._trainer_start = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-watch")
        self._store_thread = threading.Thread(target=self._run_store, daemon=True, name="soak-watch-store")

    # ------------------------------------------------------------------ loop
    def start(self) -> None:
        self._thread.start()
        self._store_thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._store_thread.join(30)
        self._tail()

    def violate(self, msg: str) -> None:
        with self._lock:
            t = time.monotonic() - self.t0
            if self.first_violation_t is None:
                self.first_violation_t = t
            self.violations.append(f"t+{t:.1f}s: {msg}")
        print(f"soak: VIOLATION: {msg}", flush=True)

    def _run(self) -> None:
        """The logs and RSS, every 0.5 s (apart from the store's polls: S3 under a fault makes
        those wait, and the apply times read from the logs would come late)."""
        n = 0
        try:
            while not self._stop.wait(0.5):
                n += 1
                self._tail()
                if n % 4 == 0:
                    self._rss()
        except Exception as exc:  # a dead watch checks nothing: the run must not pass without it
            self.violate(f"the soak's watch thread failed: {type(exc).__name__}: {exc}")
            raise

    def _run_store(self) -> None:
        n = 0
        while not self._stop.wait(0.5):
            n += 1
            self._poll_store()
            if n % 10 == 0:
                self._disk()

    def _poll_store(self) -> None:
        try:
            for v in commit.list_versions(self.store):
                if v in self.decisions:
                    continue
                d = commit.read_decision(self.store, v)
                if d is not None:
                    self.decisions[v] = d["decision"]
                    self.decided_at[v] = time.monotonic()
        except Exception:  # noqa: BLE001 - S3 under a fault: the next poll sees it
            pass

    def committed(self) -> list[int]:
        return sorted(v for v, d in list(self.decisions.items()) if d == "commit")  # (the store thread adds)

    def committed_count(self) -> int:
        return len(self.committed())

    def newest(self) -> int:
        c = self.committed()
        return c[-1] if c else 0

    def wait_committed(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.committed_count() < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no committed version in {timeout:.0f} s; trainer: "
                                   + self.procs["trainer"].tail())
            time.sleep(0.2)

    # ------------------------------------------------------------------ logs
    def _tail(self) -> None:
        for name, p in list(self.procs.items()):  # (start() adds rx-vllm while this runs)
            mark = next((m for prefix, m in READY if name.startswith(prefix)), None)
            if mark is None:
                continue
            try:
                with open(p.log, "rb") as f:
                    f.seek(self._offsets.get(name, 0))
                    data = f.read()
            except OSError:
                continue
            cut = data.rfind(b"\n") + 1
            self._offsets[name] = self._offsets.get(name, 0) + cut
            now = time.monotonic()
            for line in data[:cut].decode(errors="replace").splitlines():
                if line.startswith("===== start "):  # (Proc.start: the instance the next lines are of)
                    self._log_instance[name] = int(line.split()[2])
                inst = self._log_instance.get(name, -1)
                if mark in line and 0 <= inst < len(p.instances):
                    p.instances[inst].setdefault("ready", now)
                if name not in self.receivers and name != "trainer":
                    continue
                if name == "trainer":
                    self._trainer_line(line)
                else:
                    self._receiver_line(name, line, now)

    def _trainer_line(self, line: str) -> None:
        if line.startswith("===== start"):
            self._trainer_start += 1
        else:  # (both ranks print it: two lines once met on one, and that failed the watch thread)
            self.steps += [(self._trainer_start, int(i), float(t)) for i, t in STEP_CLOCK.findall(line)]

    def _receiver_line(self, name: str, line: str, now: float) -> None:
        if "MISMATCH" in line:
            self.violate(f"{name}: {line.strip()[:300]}")
        if not line.startswith("{"):
            return
        try:
            ev = json.loads(line)
        except ValueError:
            return
        if ev.get("event") == "ready":
            self.held[name] = ev["version"]
            self.ready[name] += 1
        elif ev.get("event") == "applied":
            v = ev["version"]
            self.held[name] = v
            self.applied[name].append((v, now))
            if ev.get("bit_exact") is False:
                self.violate(f"{name}: version {v} differs from its dense export in {ev.get('mismatch')}")
            elif ev.get("bit_exact"):
                self.verified += 1
            if self.decisions.get(v) == "abort":
                self.violate(f"{name} applied version {v}, which was aborted")

    # ------------------------------------------------------------------ resources
    def _rss(self) -> None:
        from tests.soak.fleet import rss

        now = time.monotonic()
        for p in list(self.procs.values()):
            if p.alive() and p.instances:
                p.instances[-1]["rss"].append((now, rss(p.track())))

    def _disk(self) -> None:
        by: dict[str, int] = {}
        try:
            pages = self.store.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.store.bucket, Prefix=self.store._key(""))
            for page in pages:
                for o in page.get("Contents", []):
                    top = o["Key"].split("/")[1] if "/" in o["Key"] else o["Key"]
                    by[top] = by.get(top, 0) + o["Size"]
        except Exception:  # noqa: BLE001 - S3 under a fault
            return
        phys = 0
        for root, _, files in os.walk(self.procs["s3"].log.parent.parent / "s3"):
            for f in files:
                try:
                    phys += os.path.getsize(os.path.join(root, f))
                except OSError:
                    pass
        self.disk.append((time.monotonic(), sum(by.values()), phys, by))

    # ------------------------------------------------------------------ gc and lost versions
    def gc(self, env: dict, url: str) -> None:
        t = time.monotonic()
        try:
            out = subprocess.run([sys.executable, "-m", "nemo_dcr_callback.cli", "gc", "--store", url,
                                  "--live-s", str(self.cfg.live_s)], env=env, capture_output=True, text=True,
                                 timeout=120)
            m = re.search(r"deleted (\d+) objects", out.stdout)
            row = {"t": round(t - self.t0, 1), "rc": out.returncode, "deleted": int(m.group(1)) if m else None,
                   "s": round(time.monotonic() - t, 2)}
            if out.returncode != 0:
                row["error"] = (out.stderr or out.stdout)[-300:]
        except subprocess.TimeoutExpired:
            row = {"t": round(t - self.t0, 1), "rc": None, "error": "timed out"}
        self.gc_runs.append(row)
        self._check_needed()

    def _check_needed(self) -> None:
        """Every committed version a live receiver still needs is still in the store."""
        try:
            regs = commit.receivers(self.store, self.cfg.live_s)
            newest = self.newest()
            for rid, reg in regs.items():
                for v in self.committed():
                    if reg["version"] < v <= newest and (commit.read_record(self.store, v) is None
                                                         or commit.read_decision(self.store, v) is None):
                        self.violate(f"committed version {v} is gone from the store, but {rid} (holding "
                                     f"{reg['version']}) still needs it")
                        return
        except Exception:  # noqa: BLE001 - S3 under a fault: checked at the next gc
            pass

    # ------------------------------------------------------------------ the end
    def progress(self) -> str:
        held = ", ".join(f"{r} {self.held.get(r, '-')}" for r in self.receivers)
        aborted = sum(1 for d in list(self.decisions.values()) if d == "abort")
        return f"committed {self.committed_count()} (newest {self.newest()}), aborted {aborted}; held: {held}"

    def converge(self, trainer, converge_s: float, t_heal: float) -> None:
        """After the faults: the trainer publishes 3 more versions and stops; every receiver must
        hold the newest committed version within converge_s (accounting.late_to_converge)."""
        base = self.committed_count()
        deadline = time.monotonic() + 240
        while self.committed_count() < base + 3:
            if time.monotonic() > deadline:
                self.violate("the trainer committed no 3 versions in 240 s after the faults stopped")
                return
            time.sleep(0.2)
        trainer.wanted = False
        self.trainer_stopped_at = time.monotonic()
        stopped = stop_trainer(trainer, STOP_WITHIN_S)  # (a clean stop is an invariant: issue 68)
        if stopped is not True:
            self.violate(f"the trainer, sent SIGTERM, {stopped}")
        self._poll_store()
        time.sleep(1.0)
        self._poll_store()
        target, t_stop = self.newest(), time.monotonic()
        while True:
            behind = {r: self.held.get(r, -1) for r in self.receivers if self.held.get(r, -1) < target}
            late = accounting.late_to_converge(self, behind, t_stop, converge_s, time.monotonic())
            if late:
                self.violate(f"receivers not at the newest committed version {target} within {converge_s:.0f} s: "
                             f"{late}")
            if late or not behind:
                break
            time.sleep(0.2)
        self.convergence = {"newest": target, "after_trainer_stop_s": round(time.monotonic() - t_stop, 2),
                            "after_faults_stop_s": round(time.monotonic() - t_heal, 2)}

    def report(self, fired: list[dict], exits) -> dict:
        self._check_stalls(fired, exits)
        accounting.check_exits(self, exits)
        accounting.check_gc(self, fired)
        rss = self._check_rss()
        disk = self._check_disk()
        kinds: dict[str, int] = {}
        for f in fired:
            kinds[f"{f['kind']} {f['target']}"] = kinds.get(f"{f['kind']} {f['target']}", 0) + 1
        recov = self._recoveries(fired)
        steps_per_start: dict[int, int] = {}
        for s, _, _ in self.steps:
            steps_per_start[s] = steps_per_start.get(s, 0) + 1
        return {
            "violations": self.violations, "first_violation_t": self.first_violation_t,
            "versions": {"committed": self.committed_count(),
                         "aborted": sum(d == "abort" for d in list(self.decisions.values())),
                         "newest": self.newest()},
            "served": {r: {"applied": len(self.applied[r]), "starts": self.ready[r], "held": self.held.get(r)}
                       for r in self.receivers},
            "verified_applies": self.verified,
            "dense_samples": self.samples,
            "faults": {"fired": len(fired), "by_kind": kinds, "rows": fired, "recoveries": recov},
            "exits": [{"t": round(e.t - self.t0, 1), "process": e.name, "rc": e.rc, "cause": e.cause,
                       "tail": e.tail[-400:]} for e in exits],
            "trainer_starts": len(steps_per_start), "gc": self.gc_runs, "rss": rss, "disk": disk,
            "convergence": self.convergence, "stall": self.stall,
        }

    def _fault_windows(self, fired: list[dict]) -> list[tuple[float, float]]:
        """Where a long step is the trainer's own fault or the store's, not a receiver's."""
        out = []
        for f in fired:
            if f["target"] in ("trainer", "s3"):
                end = f["end_at"] if f["end_at"] is not None else f["fired_at"]
                out.append((self.t0 + f["fired_at"] - 1.0, self.t0 + end + 60.0))
        return out

    def _check_stalls(self, fired: list[dict], exits) -> None:
        windows = self._fault_windows(fired)
        bound = self.cfg.ack_timeout + STALL_SLACK_S
        worst = 0.0
        # each gap between two steps of one trainer start, and from a start's last step to its
        # end (a trainer that hangs has no next step: its exit, or the soak's stop, ends the gap)
        # (the soak's stop request ends a gap too, not the exit up to STOP_WITHIN_S after it)
        stop = [self.trainer_stopped_at] if self.trainer_stopped_at is not None else []
        ends = sorted([*(e.t for e in exits if e.name == "trainer"), *stop])
        gaps = [(a, b) for a, b in zip(self.steps, self.steps[1:], strict=False) if a[0] == b[0]]
        for i, (start, _, t_last) in enumerate(self.steps):
            if i + 1 == len(self.steps) or self.steps[i + 1][0] != start:
                end = next((t for t in ends if t > t_last), None)
                if end is not None:
                    gaps.append(((start, 0, t_last), (start, 0, end)))
        for (_, _, t0), (_, _, t1) in gaps:
            if t0 < self.t0:
                continue
            gap = t1 - t0
            excused = any(a <= t1 and t0 <= b for a, b in windows)
            if not excused:
                worst = max(worst, gap)
                if gap > bound:
                    self.violate(f"a trainer step waited {gap:.1f} s (bound {bound:.0f} s) at t+{t0 - self.t0:.0f}s "
                                 "with neither the trainer nor S3 under a fault")
        self.stall = {"worst_unexcused_gap_s": round(worst, 2), "bound_s": bound}
        # and training's versions keep committing: a trainer stepping while every version
        # aborts (its ranks disagreeing on the base after an abort) stalls the fleet as surely
        commits = sorted(t for v, t in list(self.decided_at.items()) if self.decisions[v] == "commit" and t >= self.t0)
        worst_c = 0.0
        for t0, t1 in zip(commits, commits[1:], strict=False):
            if any(a <= t1 and t0 <= b for a, b in windows):
                continue
            worst_c = max(worst_c, t1 - t0)
            if self.cfg.progress_s and t1 - t0 > self.cfg.progress_s:
                self.violate(f"no version committed for {t1 - t0:.0f} s (bound {self.cfg.progress_s:.0f} s) from "
                             f"t+{t0 - self.t0:.0f}s, with neither the trainer nor S3 under a fault")
        self.stall["worst_commit_gap_s"] = round(worst_c, 2)

    def _check_rss(self) -> dict:
        out = {}
        for name, p in self.procs.items():
            rows = []
            for inst in p.instances:
                s = inst["rss"]
                if not s:
                    continue
                life = s[-1][0] - inst["t0"]
                row = {"start_t": round(inst["t0"] - self.t0, 1), "life_s": round(life, 1),
                       "peak_mb": round(max(b for _, b in s) / 2**20, 1),
                       "curve_mb": [[round(t - self.t0, 1), round(b / 2**20, 1)]
                                    for t, b in s[:: max(1, len(s) // 40)]]}
                if name == "s3":
                    row["ceiling_mb"] = S3_RSS_CEILING_MB
                    if row["peak_mb"] > S3_RSS_CEILING_MB:
                        self.violate(f"s3: RSS {row['peak_mb']:.0f} MB over its ceiling of {S3_RSS_CEILING_MB:.0f} MB")
                elif "ready" in inst and s[-1][0] - inst["ready"] >= RSS_MIN_LIFE_S:
                    w0 = inst["ready"] + RSS_WARMUP_S
                    row["ready_s"] = round(inst["ready"] - inst["t0"], 1)
                    warm = [b for t, b in s if w0 <= t <= w0 + 30]
                    tail = [b for _, b in s[-max(3, len(s) // 10):]]
                    if warm:
                        g = statistics.median(tail) / statistics.median(warm) - 1.0
                        row["growth_after_warmup"] = round(g, 4)
                        cache = RELAY_CACHE_MB * 2**20 / statistics.median(warm) if name.startswith("relay") else 0.0
                        if g > RSS_GROWTH + cache:
                            self.violate(f"{name}: RSS grew {100 * g:.1f}% after warm-up "
                                         f"({statistics.median(warm) / 2**20:.0f} -> "
                                         f"{statistics.median(tail) / 2**20:.0f} MB)")
                rows.append(row)
            out[name] = rows
        return out

    def _check_disk(self) -> dict:
        if not self.disk:
            return {}
        c = self.cfg
        kf = max((by.get("keyframe", 0) for _, _, _, by in self.disk), default=0)
        per_version = 0
        committed = max(1, self.committed_count())
        for _, _, _, by in self.disk:
            n = max(1, len(self.decisions))
            per_version = max(per_version, (by.get("versions", 0) + by.get("verify", 0)) // n)
        exp_bytes = kf  # one keyframe's worth: the dense export of a version
        gc_versions = int(c.gc_every_s / max(c.min_step_s, 0.1))
        bound = 2 * kf + (c.keyframe_every + 2 * gc_versions + 20) * (exp_bytes + per_version)
        warm = [row for row in self.disk if row[0] >= self.t0 + 60]
        peak = max((b for _, b, _, _ in warm), default=0)
        if warm and peak > bound:
            self.violate(f"store holds {peak:,} bytes, above the bound {bound:,}")
        return {"bound_bytes": bound, "peak_bytes_after_warmup": peak, "keyframe_bytes": kf,
                "committed": committed,
                "curve": [[round(t - self.t0, 1), b, ph] for t, b, ph, _ in self.disk[:: max(1, len(self.disk) // 60)]]}

    def _recoveries(self, fired: list[dict]) -> list[dict]:
        """Per fault: from its end until the receivers it reached (a receiver: itself; a relay:
        those below it; S3: all) hold at least the version that was newest then; a trainer
        kill: until the next commit. Resolution: the log poll (0.5 s). Overlapping faults add
        to each other's times."""
        out = []
        for f in fired:
            end = f["end_at"] if f["end_at"] is not None else f["fired_at"]
            t_end = self.t0 + end
            if f["target"] == "trainer":
                after = [t for v, t in list(self.decided_at.items()) if t > t_end and self.decisions[v] == "commit"]
                rec = min(after) - t_end if after else None
            else:
                newest = max([v for v, t in list(self.decided_at.items())
                              if t <= t_end and self.decisions[v] == "commit"], default=0)
                ts = []
                reached = (f["target"],) if f["target"] in self.receivers else BEHIND.get(f["target"], self.receivers)
                for r in [r for r in reached if r in self.receivers]:
                    at = [t for v, t in self.applied[r] if v >= newest and t >= t_end - 0.5]
                    ts.append(t_end if self._held_at(r, t_end) >= newest else min(at) if at else None)
                rec = None if any(t is None for t in ts) else max(ts) - t_end
            out.append({"fault": f"{f['kind']} {f['target']}", "at": f["fired_at"],
                        "recover_s": None if rec is None else round(max(rec, 0.0), 2)})
        return out

    def _held_at(self, r: str, t: float) -> int:
        before = [v for v, ta in self.applied[r] if ta <= t]
        return before[-1] if before else -1


def table(rep: dict) -> str:
    lines = ["", f"soak seed {rep['seed']}: {rep['wall_s']:.0f} s, {rep['versions']['committed']} versions committed "
             f"({rep['versions']['aborted']} aborted), {rep['faults']['fired']} faults, "
             f"{rep['trainer_starts']} trainer starts, {rep['verified_applies']} applies checked against the dense "
             f"export, {sum(1 for s in rep['dense_samples'] if s.get('bit_exact'))} directory samples bit-exact",
             "", "| fault | count | recovered | median recovery | worst |", "| --- | --- | --- | --- | --- |"]
    by: dict[str, list] = {}
    for r in rep["faults"]["recoveries"]:
        by.setdefault(r["fault"], []).append(r["recover_s"])
    for k in sorted(by):
        xs = [x for x in by[k] if x is not None]
        med = f"{statistics.median(xs):.1f} s" if xs else "-"
        worst = f"{max(xs):.1f} s" if xs else "-"
        lines.append(f"| {k} | {len(by[k])} | {len(xs)} | {med} | {worst} |")
    lines += ["", "| receiver | applied | starts | holds |", "| --- | --- | --- | --- |"]
    for r, s in rep["served"].items():
        lines.append(f"| {r} | {s['applied']} | {s['starts']} | {s['held']} |")
    lines.append("")
    lines.append(f"convergence: {rep['convergence']}; disk: peak {rep['disk'].get('peak_bytes_after_warmup', 0):,} "
                 f"bytes (bound {rep['disk'].get('bound_bytes', 0):,})")
    causes: dict[str, int] = {}
    for e in rep["exits"]:
        causes[e["cause"] or "unexplained"] = causes.get(e["cause"] or "unexplained", 0) + 1
    lines.append("exits: " + (", ".join(f"{n} {c}" for c, n in sorted(causes.items())) or "none")
                 + " (fault: a kill or stop of that process; soak: its own stop; start: the harness's start)")
    lines.append(f"violations: {len(rep['violations'])}")
    return "\n".join(lines)
