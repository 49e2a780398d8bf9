"""The chaos soak (`make soak`, docs/FAULTS.md): the whole fleet under seeded, overlapping faults.

    python -m tests.soak.run --seed 7 --versions 500 --faults 100 --json benchmarks/results/soak.json

A torchrun trainer (megatron-core GPT, TP 2, the DCR callback, a weights checkpoint every few
steps) publishes a version every step to SeaweedFS through a fault proxy; a relay tree of two
levels (root on S3, region on root through a link that can be cut); four receivers: two
transformers models (through the tree, and on S3 directly) checking every version against its
dense export, a checkpoint directory on a small tmpfs, a block-FP8 directory; `nemo-dcr gc` on
a schedule. The schedule (schedule.py) is drawn from the seed; invariants.py checks what must
hold. A failure prints the seed and the schedule up to it; `--seed` replays the schedule."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.soak import invariants, schedule
from tests.soak.fleet import Link, Proc, Supervisor, Tmpfs, can_mount_tmpfs, free_port, kill_one_rank

TOKEN = "soak-relay-token"
PREFIX = "soak"
VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
VLLM_ARGS = "--skip-tokenizer-init --dtype bfloat16 --enforce-eager --max-model-len 64 --gpu-memory-utilization 0.1"


@dataclass
class SoakConfig:
    seed: int = 1
    versions: int = 60  # committed versions to reach (the trainer runs until then, and the schedule is done)
    faults: int = 15
    mean_gap_s: float = 6.0  # between fault arrivals
    ack_timeout: float = 6.0
    keyframe_every: int = 20
    checkpoint_every: int = 5
    min_step_s: float = 0.6
    gc_every_s: float = 15.0
    live_s: float = 90.0
    sample_every_s: float = 12.0  # a dense oracle check of a directory receiver
    converge_s: float = 90.0  # every receiver at the newest version this long after the faults stop
    progress_s: float = 0.0  # a commit at least this often outside trainer/S3 faults (0: not checked)
    time_limit_s: float = 1800.0
    vllm: str = "auto"  # a vLLM engine as a fifth receiver: on, off, auto (where .venv-vllm is built)
    workdir: str | None = None


TRAIN_OVERRIDES = [
    "parallel.tensor_model_parallel_size=2", "model.num_layers=2", "model.hidden_size=64",
    "model.ffn_hidden_size=176", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.vocab_size=256", "model.seq_length=16", "optimizer.lr=1e-3", "trainer.max_steps=1000000",
    "dcr.commit_policy=quorum", "dcr.quorum=0.5", "dcr.seal_timeout=30", "dcr.part_bytes=16384",
    "dcr.export_every=1",
    # back-pressure: the trainer (a step every 0.6 s) outpaces five receivers on 2 cores; with
    # the default 1 GiB of undo log in flight, the decisions fell ~300 versions behind, the
    # trainer's RSS grew 29% with the queue, and one no-quorum abort aborted all of them
    "dcr.max_pending_bytes=8388608",
]
# the store's memory, bounded (invariants.S3_RSS_CEILING_MB): its read cache and Go heap
S3_ARGS = ["-s3.cacheCapacityMB=64"]
S3_ENV = {"GOMEMLIMIT": "384MiB"}


class Soak:
    def __init__(self, cfg: SoakConfig, log=print):
        self.cfg, self.log = cfg, log
        self.dir = Path(cfg.workdir or tempfile.mkdtemp(prefix="nemo-dcr-soak."))
        if cfg.workdir and self.dir.exists() and any(self.dir.iterdir()):
            raise SystemExit(f"soak: {self.dir} is not empty (another soak's, or a finished one's: remove it)")
        self.dir.mkdir(parents=True, exist_ok=True)
        if cfg.vllm not in ("on", "off", "auto"):
            raise SystemExit(f"soak: --vllm is on, off or auto, not {cfg.vllm!r}")
        if cfg.vllm == "on" and not VLLM_PYTHON.exists():
            raise SystemExit(f"soak: --vllm on needs {VLLM_PYTHON} (make .venv-vllm/.setup-done)")
        self.use_vllm = cfg.vllm == "on" or (cfg.vllm == "auto" and VLLM_PYTHON.exists())
        self.receivers = (*invariants.RECEIVERS, *(["rx-vllm"] if self.use_vllm else []))
        self.vllm_base: str | None = None
        self.faults = schedule.draw(cfg.seed, cfg.faults, cfg.mean_gap_s, cfg.ack_timeout, receivers=self.receivers)
        self.fired: list[dict] = []
        self.tmpfs: Tmpfs | None = None
        self._undo: list[tuple[float, object, dict]] = []  # (when, undo(), fired row)

    # ------------------------------------------------------------------ the fleet
    def _env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_DCR_") or k == "NEMO_DCR_KERNELS"}
        env.update(self.s3.env())
        env.update({"AWS_ENDPOINT_URL_S3": self.proxy.endpoint, "NEMO_DCR_RELAY_TOKEN": TOKEN,
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        return env

    def _cli(self, *args: str):
        return lambda: ([sys.executable, "-m", "nemo_dcr_callback.cli", *args], self._env())

    def start(self) -> None:
        from nemo_dcr_callback.launcher import torchrun_cmd
        from nemo_dcr_callback.transport.seaweed import SeaweedS3
        from tests.faults.faultproxy import FaultProxy

        c = self.cfg
        self.s3 = SeaweedS3(self.dir / "s3", extra_args=S3_ARGS, env=S3_ENV).start()
        self.proxy = FaultProxy(self.s3.endpoint).start()
        self.url = f"s3://{self.s3.bucket}/{PREFIX}?endpoint={self.proxy.endpoint}"
        p_root, p_region = free_port(), free_port()
        self.link = Link(p_root)
        root = f"relay://127.0.0.1:{p_root}"
        chain_region = f"relay://127.0.0.1:{p_region},{root},{self.url}"
        logs = self.dir / "logs"
        logs.mkdir(exist_ok=True)

        def spawn_s3():
            self.s3.proc = None
            self.s3.start()
            return self.s3.proc

        overrides = [*TRAIN_OVERRIDES, f"trainer.checkpoint_dir={self.dir / 'ckpt'}",
                     f"trainer.checkpoint_every={c.checkpoint_every}", f"trainer.min_step_s={c.min_step_s}",
                     f"dcr.store='{self.url}'", f"dcr.ack_timeout={c.ack_timeout}",
                     f"dcr.keyframe_every={c.keyframe_every}", f"hydra.run.dir={self.dir / 'train-run'}"]
        trainer = Proc("trainer", lambda: (torchrun_cmd(2, ["-m", "nemo_dcr_callback.recipes.train", *overrides]),
                                           {**self._env(), "NEMO_DCR_STEP_CLOCK": "1"}),
                       logs / "trainer.log", restart_s=2.0)
        s3 = Proc("s3", None, logs / "s3.log", spawn=spawn_s3)
        s3.popen = self.s3.proc
        s3.starts, s3.instances = 1, [{"t0": time.monotonic(), "pid": self.s3.proc.pid, "rss": []}]
        cache = ["--cache-mb", str(invariants.RELAY_CACHE_MB)]  # (their RSS rule allows it)
        relays = [Proc("relay-root", self._cli("relay", "--parent", self.url, "--name", "root",
                                               "--listen", f"127.0.0.1:{p_root}", *cache), logs / "relay-root.log"),
                  Proc("relay-region", self._cli("relay", "--parent", f"relay://127.0.0.1:{self.link.port},{self.url}",
                                                 "--name", "region", "--listen", f"127.0.0.1:{p_region}", *cache),
                       logs / "relay-region.log")]
        follow = ["--follow", "--json", "--timeout", "100000", "--idle-poll-ms", "50"]
        self.model_dir = self.dir / "rx-dir-disk" / "model"
        self.fp8_dir = self.dir / "rx-fp8"
        rx = [Proc("rx-hf", self._cli("receive", "--store", chain_region, "--id", "rx-hf", "--verify", *follow),
                   logs / "rx-hf.log"),
              Proc("rx-s3", self._cli("receive", "--store", self.url, "--id", "rx-s3", "--verify", *follow),
                   logs / "rx-s3.log"),
              Proc("rx-dir", self._cli("receive", "--store", chain_region, "--model-dir", str(self.model_dir),
                                       "--id", "rx-dir", *follow), logs / "rx-dir.log"),
              Proc("rx-fp8", self._cli("receive", "--store", f"{root},{self.url}", "--fp8-dir", str(self.fp8_dir),
                                       "--id", "rx-fp8", *follow), logs / "rx-fp8.log")]
        self.procs = {p.name: p for p in [trainer, s3, *relays, *rx]}
        self.sup = Supervisor([trainer, *relays, rx[0], rx[1]])
        self.sup.start()
        with self.sup.lock:
            self.sup.procs["s3"] = s3  # (up already)
        from nemo_dcr_callback.transport.s3 import S3Store

        # the soak's own view of the store: straight to SeaweedFS (not through the fault proxy),
        # with short timeouts (S3 stopped by a fault must not hold the checks for minutes)
        watch_store = S3Store(self.s3.url(f"{self.s3.bucket}/{PREFIX}"), access_key=self.s3.access_key,
                              secret_key=self.s3.secret_key, read_timeout=5.0, connect_timeout=2.0, max_attempts=2)
        self.watch = invariants.Watch(watch_store, self.procs, c, self.receivers)
        self.watch.start()
        self._init_dirs()
        if self.use_vllm:
            port = free_port()
            self.vllm_base = f"http://127.0.0.1:{port}"
            rx.append(Proc("rx-vllm", lambda: self._vllm_start(f"{root},{self.url}", port), logs / "rx-vllm.log",
                           restart_s=2.0))
            self.procs["rx-vllm"] = rx[-1]
        with self.sup.lock:
            for p in rx[2:]:
                self.sup.procs[p.name] = p
                p.start()

    def _init_dirs(self) -> None:
        """The directory receivers start from keyframe 0 (downloaded once the trainer wrote it)."""
        from nemo_dcr_callback.protocol import keys
        from nemo_dcr_callback.receiver.targets.fp8_dir import convert

        store = self.s3.store(PREFIX)
        deadline = time.monotonic() + 300
        while not (store.exists(keys.keyframe_record(0)) and store.exists(keys.keyframe_config(0))):
            if time.monotonic() > deadline:
                raise RuntimeError("the trainer wrote no keyframe in 300 s: " + self.procs["trainer"].tail())
            time.sleep(0.5)
        if can_mount_tmpfs():
            self.tmpfs = Tmpfs(self.model_dir.parent, size_mb=4)
        self.model_dir.mkdir(parents=True, exist_ok=True)
        (self.model_dir / keys.MODEL_FILE).write_bytes(store.get(keys.keyframe_model(0)))
        (self.model_dir / keys.CONFIG_FILE).write_bytes(store.get(keys.keyframe_config(0)))
        convert(self.model_dir / keys.MODEL_FILE, self.fp8_dir)

    def _vllm_start(self, store_url: str, port: int):
        """`nemo-dcr receive --vllm` from .venv-vllm, serving the newest committed keyframe (as an
        operator's restart script would: a restarted engine loads a checkpoint, then follows)."""
        from nemo_dcr_callback.protocol import keys
        from nemo_dcr_callback.protocol.rebuild import latest_keyframe

        store = self.watch.store
        k = latest_keyframe(store) or 0
        d = self.dir / "rx-vllm" / f"keyframe-{k}"
        if not (d / keys.MODEL_FILE).exists():
            shutil.rmtree(self.dir / "rx-vllm", ignore_errors=True)
            d.mkdir(parents=True)
            (d / keys.CONFIG_FILE).write_bytes(store.get(keys.keyframe_config(k)))
            (d / keys.MODEL_FILE).write_bytes(store.get(keys.keyframe_model(k)))
        argv = [str(VLLM_PYTHON), "-m", "nemo_dcr_callback.cli", "receive", "--store", store_url, "--vllm", str(d),
                "--version", str(k), "--port", str(port), "--id", "rx-vllm", "--json", "--idle-poll-ms", "200",
                "--vllm-args", VLLM_ARGS]
        return argv, {**self._env(), "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}

    # ------------------------------------------------------------------ faults
    def fire(self, f: schedule.Fault) -> None:
        now = time.monotonic()
        row = {**asdict(f), "fired_at": now - self.t0, "end_at": None}
        self.fired.append(row)
        self.log(f"soak: {f.describe()}")
        p = self.procs.get(f.target)
        with self.sup.lock:
            if f.kind == "kill" and f.target == "trainer":
                kill_one_rank(p)
                p.hit()
                p.down_until = now + f.hold_s
                self._undo.append((now + f.hold_s, lambda: None, row))
            elif f.kind == "kill":
                p.kill(f.hold_s)
                self._undo.append((now + f.hold_s, lambda: None, row))
            elif f.kind == "stop":
                p.hit()
                p.signal(signal.SIGSTOP)
                p.stopped = True
                self._undo.append((now + f.hold_s, lambda p=p: (p.signal(signal.SIGCONT),
                                                               setattr(p, "stopped", False)), row))
            elif f.kind == "diskfull":
                if self.tmpfs is None:
                    row["skipped"] = "no tmpfs (not root)"
                    return
                self.tmpfs.fill()
                self._undo.append((now + f.hold_s, self.tmpfs.free, row))
            elif f.kind == "cut":
                self.link.cut(f.detail)
                self._undo.append((now + f.hold_s, self.link.heal, row))
            elif f.kind == "truncate":
                self.proxy.add(method="GET", path=r"\.dcr", action="truncate", times=int(f.detail.split()[0]))
                row["end_at"] = row["fired_at"]
            elif f.kind == "delay":
                r = self.proxy.add(method="*", path=r"/soak/", action="delay", delay_s=float(f.detail[:-1]), times=-1)
                self._undo.append((now + f.hold_s, lambda r=r: self.proxy.rules.remove(r), row))
            elif f.kind == "throttle":
                r = self.proxy.add(method="*", path=r"/soak/", action="status", status=503, code="SlowDown", times=-1)
                self._undo.append((now + f.hold_s, lambda r=r: self.proxy.rules.remove(r), row))

    def _due_undos(self, final: bool = False) -> None:
        now = time.monotonic()
        for item in [u for u in self._undo if final or u[0] <= now]:
            self._undo.remove(item)
            item[1]()
            item[2]["end_at"] = now - self.t0

    def heal(self) -> None:
        """Every fault lifted: the system's own recovery is what is measured from here."""
        with self.sup.lock:
            self._due_undos(final=True)
            for p in self.procs.values():
                p.down_until = 0.0
                if p.stopped:
                    p.signal(signal.SIGCONT)
                    p.stopped = False
            self.proxy.clear()
            self.link.heal()
            if self.tmpfs is not None:
                self.tmpfs.free()

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        c = self.cfg
        t_start = time.monotonic()
        self.start()
        self.log(f"soak: seed {c.seed}: {len(self.faults)} faults drawn; fleet up in "
                 f"{time.monotonic() - t_start:.0f} s; waiting for the first committed version")
        self.watch.wait_committed(1, timeout=300)
        self.t0 = time.monotonic()
        self.watch.t0 = self.t0
        nxt, last_report = 0, self.t0
        chores = threading.Thread(target=self._chores, daemon=True, name="soak-chores")
        self._chores_stop = threading.Event()
        chores.start()
        try:
            while nxt < len(self.faults) or self.watch.committed_count() < c.versions:
                now = time.monotonic()
                if now - t_start > c.time_limit_s:
                    self.watch.violate(f"time limit: {self.watch.committed_count()} of {c.versions} versions "
                                       f"committed after {c.time_limit_s:.0f} s")
                    break
                while nxt < len(self.faults) and self.faults[nxt].at <= now - self.t0:
                    self.fire(self.faults[nxt])
                    nxt += 1
                self._due_undos()
                if now - last_report >= 30:
                    last_report = now
                    self.log(f"soak: t+{now - self.t0:.0f}s: {self.watch.progress()}; faults {nxt}/{len(self.faults)}")
                if self.watch.violations:
                    break
                time.sleep(0.1)
            self._chores_stop.set()
            chores.join(180)
            self.heal()
            t_heal = time.monotonic()
            self.log(f"soak: faults over at t+{t_heal - self.t0:.0f}s; healing")
            if not self.watch.violations:
                self.watch.converge(self.procs["trainer"], c.converge_s, t_heal)
                self.watch.gc(self._env(), self.url)
                self.watch.sample(self.model_dir, self.fp8_dir, self.vllm_base, final=True)
        finally:
            self.sup.stop()
            self.watch.stop()
            self.proxy.stop()
            self.s3.stop()
            if self.tmpfs is not None:
                self.tmpfs.umount()
        return self.report(time.monotonic() - t_start)

    def _chores(self) -> None:
        """gc and the dense samples, beside the fault loop: a gc or a sample that waits on S3
        under a fault must not hold the schedule back (it did: faults fired 90 s late)."""
        c = self.cfg
        last_gc = last_sample = time.monotonic()
        while not self._chores_stop.wait(0.2):
            now = time.monotonic()
            if now - last_gc >= c.gc_every_s:
                self.watch.gc(self._env(), self.url)
                last_gc = time.monotonic()
            if now - last_sample >= c.sample_every_s:
                self.watch.sample(self.model_dir, self.fp8_dir, self.vllm_base)
                last_sample = time.monotonic()

    def report(self, wall_s: float) -> dict:
        r = self.watch.report(self.fired, self.sup.exits)
        from nemo_dcr_callback.bench.results import machine

        r.update({"seed": self.cfg.seed, "config": asdict(self.cfg), "wall_s": round(wall_s, 1),
                  "schedule": schedule.as_json(self.faults), "workdir": str(self.dir), "machine": machine()})
        return r


def print_failure(report: dict, faults: list[schedule.Fault]) -> None:
    print(f"\nSOAK FAILED (seed {report['seed']}): {len(report['violations'])} invariant violations", flush=True)
    for v in report["violations"][:20]:
        print(f"  - {v}")
    t_fail = report.get("first_violation_t") or 1e18
    print(f"fault schedule up to the failure (replay: --seed {report['seed']}):")
    for f in faults:
        if f.at <= t_fail:
            print("  " + f.describe())
    print(f"logs: {report['workdir']}/logs", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, f in SoakConfig.__dataclass_fields__.items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(f.default) if f.default is not None else str,
                        default=f.default)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    cfg = SoakConfig(**{k: getattr(args, k) for k in SoakConfig.__dataclass_fields__})
    soak = Soak(cfg)
    rep = soak.run()
    print(invariants.table(rep), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    if rep["violations"]:
        print_failure(rep, soak.faults)
        return 1
    print(f"soak: passed (seed {cfg.seed}): {rep['versions']['committed']} versions committed, "
          f"{rep['faults']['fired']} faults, 0 invariant violations", flush=True)
    if cfg.workdir is None:
        shutil.rmtree(soak.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
