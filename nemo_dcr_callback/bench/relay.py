"""`nemo-dcr bench relay`: fan-out to two regions of receivers, side by side in one run.

The sender's region is the root network namespace: the sender, SeaweedFS (S3) and the root
relay. Each receiver region is a namespace joined to it by a veth pair shaped with tc tbf
(default 100 Mbit/s each way): the inter-region links. Scenarios, each from the same
weights, timed from the end of the optimizer step to the last receiver's verified apply:

  dense-s3   every receiver downloads the full safetensors checkpoint from S3
  dcr-s3     every receiver follows S3 directly (each pulls the delta across its link)
  dcr-relay  a relay per region (parent: the root relay, then S3); receivers attach to it;
             the sender writes through the root relay (relay://root, then S3)
  dcr-relay-1  the same tree with a single receiver (the 1.3x reference)

Bytes on each inter-region link are read from the veth counters (what really crossed); per
version, the sender's timeline and the CPU each process spent (from /proc) are recorded.
Then one relay's serving rate on loopback (cached parts to concurrent clients). Every
receiver's weights are compared with the sender's dense BF16 weights (the oracle: xxh3-128
of every tensor's bits, so the check itself sends nothing over the shaped links).

Needs root (ip netns, tc). Writes benchmarks/results/relay.json with --json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_dcr_callback.bench.links import JsonProc, ShapedLink, in_ns
from nemo_dcr_callback.bench.procstat import cpu_s, host_busy_s
from nemo_dcr_callback.bench.results import machine, write_json

TOKEN_ENV = "NEMO_DCR_RELAY_TOKEN"


# ------------------------------------------------------------------ receiver (in a region)
def receiver_main(args: list[str]) -> int:
    import argparse

    from safetensors.torch import load, load_file

    from nemo_dcr_callback import codec
    from nemo_dcr_callback.receiver import Follower
    from nemo_dcr_callback.receiver.follow import APPLY_MODES
    from nemo_dcr_callback.transport.store import freeze_long_lived, open_store

    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--dense-url", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--versions", type=int, default=0)
    ap.add_argument("--id", required=True)
    ap.add_argument("--apply", choices=list(APPLY_MODES), default="sealed")
    a = ap.parse_args(args)
    torch.set_num_threads(1)
    tensors = {k: v.clone() for k, v in load_file(a.init).items()}

    def out(d: dict) -> None:
        print(json.dumps(d), flush=True)

    if a.versions:  # DCR: follow the store (or relay chain), then report the bits held
        store = open_store(a.url)
        f = Follower(store, tensors, version=0, receiver_id=a.id, poll_s=0.005, idle_poll_s=0.005,  # no idle back-off
                     early=APPLY_MODES[a.apply])
        freeze_long_lived()  # as `nemo-dcr receive` does
        out({"ready": True, "cpu_s": time.process_time()})
        f.follow(until=a.versions, timeout=600, on_apply=lambda x: out(
            {"version": x.version, "t_applied": time.time(), "fetch_s": x.fetch_s, "apply_s": x.apply_s,
             "wait_s": x.wait_s, "cpu_s": time.process_time()}))
    else:  # dense: download the full checkpoint from S3 and load it
        out({"ready": True})
        dense_store = open_store(a.dense_url)
        while not dense_store.exists("dense/READY.json"):
            time.sleep(0.05)  # gently: 8 receivers polling S3 every 5 ms would load the sender's upload
        for k, t in load(dense_store.get("dense/model.safetensors")).items():
            tensors[k].copy_(t)
        out({"dense_t_loaded": time.time()})
    out({"digests": {k: codec.tensor_digest(t) for k, t in tensors.items()}})
    return 0


def _start_relay(ns: str | None, host: str, parent: str, name: str, env: dict, work: Path,
                 access_log: Path | None = None) -> tuple[JsonProc, str]:
    """A `nemo-dcr relay` process in namespace ns listening on host, and its URL once it listens."""
    p = JsonProc(in_ns(ns, [sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent", parent, "--name", name,
                            "--listen", f"{host}:0", "--poll-ms", "5",
                            *(["--access-log", str(access_log)] if access_log else [])]),
                 env, work / f"relay-{name}.log")
    return p, p.next(60)["listening"]


# ------------------------------------------------------------------ relay serving rate (loopback)
def _client_main(args: list[str]) -> int:
    """A lean HTTP/1.1 client on a raw socket (keep-alive, bodies received straight into one
    reused buffer), so the figure is the relay's rate, not a client library's."""
    import socket
    from urllib.parse import urlparse

    url, keys, reps = args[0], json.loads(args[1]), int(args[2])
    start_at = float(args[3]) if len(args) > 3 else 0.0
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port))
    while time.time() < start_at:  # every client starts together, after its interpreter is up
        time.sleep(0.001)
    auth = f"Authorization: Bearer {os.environ[TOKEN_ENV]}\r\n"
    buf = memoryview(bytearray(64 << 20))
    n = 0
    t0 = time.perf_counter()
    for _ in range(reps):
        for k in keys:
            sock.sendall(f"GET /o/{k} HTTP/1.1\r\nHost: {u.hostname}\r\n{auth}\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(65536)
                if not chunk:
                    raise RuntimeError(f"GET {k}: connection closed")
                head += chunk
            head, body = head.split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            if " 200 " not in lines[0] + " ":
                raise RuntimeError(f"GET {k}: {lines[0]}")
            want = next(int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length"))
            got = len(body)
            while got < want:
                m = sock.recv_into(buf[got:want])
                if not m:
                    raise RuntimeError(f"GET {k}: short body")
                got += m
            n += got
    print(json.dumps({"bytes": n, "s": time.perf_counter() - t0, "end": time.time()}), flush=True)
    return 0


def relay_throughput(work: Path, env: dict, parts: int = 64, part_mb: int = 4, clients: int = 3,
                     reps: int = 3, trials_n: int = 3, start_delay_s: float = 5.0) -> dict:
    """One relay serving cached objects to concurrent clients over loopback: MB/s out. The
    serving path is the same for every object (cache lookup, at-rest checksum, response);
    chunk verification happens once, on the way in, so verification copies of a model (a key
    kind of the protocol whose bytes are not parsed) stand in for parts: a relay serves only
    the protocol's keys, and random bytes under a part's key are refused as corrupt."""
    from nemo_dcr_callback.protocol.keys import verify_key
    from nemo_dcr_callback.transport.store import FileStore

    origin = FileStore(work / "loopback-origin")
    keys = [verify_key(i) for i in range(parts)]
    for k in keys:
        origin.put(k, os.urandom(part_mb << 20), durable=False)
    proc, url = _start_relay(None, "127.0.0.1", origin.url, "loopback", env, work)
    try:
        base = "http://" + url.split("//")[1]
        warm = subprocess.run([sys.executable, "-m", "nemo_dcr_callback.bench.relay", "client", base,
                               json.dumps(keys), "1"], env=env, capture_output=True, text=True, check=True)
        json.loads(warm.stdout)
        trials = []
        for _ in range(trials_n):
            start = time.time() + start_delay_s  # after the clients' start-up (not part of the figure)
            cs = [subprocess.Popen([sys.executable, "-m", "nemo_dcr_callback.bench.relay", "client", base,
                                    json.dumps(keys), str(reps), str(start)], env=env, stdout=subprocess.PIPE,
                                   text=True) for _ in range(clients)]
            while time.time() < start:
                time.sleep(0.001)
            cpu0 = cpu_s(proc.p.pid)
            outs = [json.loads(c.communicate()[0]) for c in cs]
            total = sum(o["bytes"] for o in outs)
            wall = max(o["end"] for o in outs) - start
            cpu = cpu_s(proc.p.pid) - cpu0
            trials.append({"bytes": total, "wall_s": wall, "MB_per_s": total / wall / 1e6, "relay_cpu_s": cpu,
                           "relay_MB_per_cpu_s": total / max(cpu, 1e-9) / 1e6})
    finally:
        proc.kill()
    med = statistics.median(t["MB_per_s"] for t in trials)
    return {"clients": clients, "part_bytes": part_mb << 20, "trials": trials, "MB_per_s": med,
            "relay_MB_per_cpu_s": statistics.median(t["relay_MB_per_cpu_s"] for t in trials)}


# ------------------------------------------------------------------ the run
def _layouts(per_region: int) -> dict[str, dict[str, int]]:
    """Receivers per region of each scenario."""
    return {"dense-s3": {"a": per_region, "b": per_region}, "dcr-s3": {"a": per_region, "b": per_region},
            "dcr-relay": {"a": per_region, "b": per_region}, "dcr-relay-1": {"a": 1, "b": 0}}


@dataclass
class _Run:
    """What the scenarios of one run share. The weights move on version by version through
    every scenario (cur: the newest BF16 weights), each starting where the last one ended."""

    policy: Any
    lr: float
    cur: dict[str, torch.Tensor]
    dense_bytes: int
    versions: int
    apply: str
    work: Path
    token: str
    s3: Any  # SeaweedS3
    links: dict[str, ShapedLink]
    env: dict
    logs: Path | None  # each relay's access log, per scenario and round

    def log_for(self, tag: str, name: str) -> Path | None:
        return self.logs / f"{tag}-{name}.jsonl" if self.logs else None


class _Meters:
    """A scenario's per-version counters: CPU-s of each process but the receivers, and the
    requests each relay served and made of its parent."""

    def __init__(self, run: _Run, relays: list[JsonProc], relay_urls: list[str]):
        self.run, self.relays, self.relay_urls = run, relays, relay_urls

    def cpu(self) -> dict[str, float]:
        return {**{f"relay-{i}": cpu_s(p.p.pid) for i, p in enumerate(self.relays)},
                "s3": cpu_s(self.run.s3.proc.pid), "sender": time.process_time()}

    def requests(self) -> dict[str, dict[str, int]]:
        """Requests each relay has served, by kind, and made of its parent ("up_" + call)."""
        from nemo_dcr_callback.transport.relay_store import RelayStore

        out = {}
        for i, u in enumerate(self.relay_urls):
            st = RelayStore(u, token=self.run.token).stats()
            out[f"relay-{i}"] = {**st["requests"], **{f"up_{k}": n for k, n in st["upstream"].items()}}
        return out


def _start_tree(run: _Run, name: str, regions: dict[str, int], tag: str, init: Path, store,
                relays: list[JsonProc], relay_urls: list[str], rx: list[JsonProc]):
    """Start a scenario's relays (dcr-relay*: a root relay, one per region) and receivers,
    appending each process as it starts (the caller kills them); the store the sender writes to."""
    s3_url = run.s3.url(f"{run.s3.bucket}/{tag}")
    root_url = None
    if name.startswith("dcr-relay"):
        from nemo_dcr_callback.transport.relay_store import FailoverStore, RelayStore

        p, root_url = _start_relay(None, run.links["a"].ip_a, s3_url, "root", run.env, run.work,
                                   run.log_for(tag, "root"))
        relays.append(p)
        relay_urls.append(root_url)
        # the sender (and committer) writes through the root relay, which passes every
        # object on to S3 and down the tree at once; S3 stays the failover
        store = FailoverStore([RelayStore(root_url, token=run.token), store])
    for region, n in regions.items():
        link = run.links[region]
        if not n:
            continue
        url = s3_url
        if root_url:
            p, rurl = _start_relay(link.ns, link.ip_b, f"{root_url},{s3_url}", f"region-{region}", run.env,
                                   run.work, run.log_for(tag, f"region-{region}"))
            relays.append(p)
            relay_urls.append(rurl)
            url = f"{rurl},{root_url},{s3_url}"
        for i in range(n):
            rx.append(JsonProc(in_ns(link.ns, [
                sys.executable, "-m", "nemo_dcr_callback.bench.relay", "receiver", "--url", url,
                "--dense-url", s3_url, "--init", str(init), "--id", f"{region}-{i}",
                "--versions", "0" if name == "dense-s3" else str(run.versions), "--apply", run.apply]),
                run.env, run.work / f"rx-{tag}-{region}-{i}.log"))
    return store


def _idle_busy(name: str) -> None:
    """Everyone up and idle: print what the waiting itself costs the host."""
    b0, w0 = host_busy_s(), time.time()
    time.sleep(2.0)
    idle = (host_busy_s() - b0) / (time.time() - w0)
    print(f"  {name}: idle, the host is busy {idle:.2f} CPU-s per second", flush=True)


def _version(run: _Run, name: str, v: int, sender, store, rx: list[JsonProc], rx_cpu0: list[float],
             meters: _Meters) -> tuple[dict, list[float]]:
    """One version: an optimizer step, streamed, sealed and committed, timed to every
    receiver's apply. Its row, and the receivers' CPU-s so far."""
    from nemo_dcr_callback.protocol import commit

    run.policy.step(run.lr)
    run.cur = run.policy.bf16()
    t0 = time.time()
    q0 = meters.requests()
    busy0, c0 = host_busy_s(), meters.cpu()
    sender.tensors = run.cur
    _, m = sender.stream(store, v, v - 1, part_bytes=1 << 20)
    t_streamed = time.time() - t0
    rec = commit.seal_version(store, v, v - 1, 1)
    t_sealed = time.time() - t0
    d = commit.run_commit(store, rec, commit.CommitPolicy("wait", timeout=600, poll=0.005))
    t_decided = time.time() - t0
    if d["decision"] != "commit":
        raise RuntimeError(f"{name}: version {v} not committed: {d['reason']}")
    sender.settle()
    got = [r.next() for r in rx]
    host_busy, c1 = host_busy_s() - busy0, meters.cpu()
    cpu_by = {k: c1[k] - c0[k] for k in c0}
    q1 = meters.requests()
    req_by = {r: {k: n - q0[r].get(k, 0) - (k == "stats") for k, n in q1[r].items()} for r in q0}
    ends = sorted(g["t_applied"] - t0 for g in got)
    rx_cpu = sum(g["cpu_s"] - c for g, c in zip(got, rx_cpu0, strict=True))
    acks = sorted(json.loads(store.get(commit.ack_key(v, r)))["time"] - t0 for r in d["acked"])
    row = {"version": v, "delta_bytes": m["bytes"], "first_s": ends[0], "last_s": ends[-1],
           "sender_s": {"streamed": t_streamed, "sealed": t_sealed, "decided": t_decided},
           "acks_s": acks, "host_busy_cpu_s": host_busy, "cpu_s_by": cpu_by,
           "requests_by": req_by,
           "acked": len(d["acked"]), "receiver_cpu_s": rx_cpu,
           "fetch_s": [g["fetch_s"] for g in got], "apply_s": [g["apply_s"] for g in got],
           "commit_wait_s": [g["wait_s"] for g in got]}
    _print_version(name, row, len(rx))
    return row, [g["cpu_s"] for g in got]


def _print_version(name: str, row: dict, receivers: int) -> None:
    s, acks, req_by = row["sender_s"], row["acks_s"], row["requests_by"]
    print(f"  {name}: version {row['version']}: {row['delta_bytes'] / 1e6:.2f} MB, first receiver "
          f"{row['first_s']:.2f} s, last of {receivers} {row['last_s']:.2f} s; receivers used "
          f"{row['receiver_cpu_s']:.2f} CPU-s (sender: streamed {s['streamed']:.2f} s, sealed {s['sealed']:.2f} s, "
          f"acks {acks[0]:.2f}-{acks[-1]:.2f} s, decided {s['decided']:.2f} s; the host busy "
          f"{row['host_busy_cpu_s']:.2f} CPU-s: " + ", ".join(f"{k} {x:.2f}" for k, x in row["cpu_s_by"].items()) + ")"
          + ("; requests served (made upstream): " + ", ".join(
              f"{r} {sum(n for k, n in q.items() if not k.startswith('up_'))} "
              f"({sum(n for k, n in q.items() if k.startswith('up_'))})" for r, q in req_by.items())
             if req_by else ""), flush=True)


def _dense_refit(run: _Run, store, rx: list[JsonProc]) -> float:
    """Upload the full checkpoint; seconds until the last receiver has loaded it."""
    from safetensors.torch import save

    t0 = time.time()
    store.put("dense/model.safetensors", save(run.cur))
    store.put("dense/READY.json", b"{}")
    return max(r.next()["dense_t_loaded"] for r in rx) - t0


def _check_bits(run: _Run, name: str, rx: list[JsonProc]) -> None:
    """The oracle: every receiver's bits against the sender's dense BF16 weights."""
    from nemo_dcr_callback import codec

    want = {k: codec.tensor_digest(t) for k, t in run.cur.items()}
    bad = [i for i, r in enumerate(rx) if r.next()["digests"] != want]
    if bad:
        raise RuntimeError(f"{name}: receivers {bad} differ from the dense weights")


def _scenario(run: _Run, name: str, regions: dict[str, int], tag: str | None = None) -> dict:
    """One scenario, from the current weights: its result (a DCR scenario's versions summed up)."""
    from safetensors.torch import save_file

    from nemo_dcr_callback.testing.tensor_sender import TensorSender
    from nemo_dcr_callback.transport.store import freeze_long_lived

    tag = tag or name  # a round after the first gets a store prefix of its own
    store = run.s3.store(tag)
    init = run.work / f"init-{tag}.safetensors"
    save_file(run.cur, str(init))
    relays: list[JsonProc] = []
    relay_urls: list[str] = []  # in the order of relays: root, then one per region
    rx: list[JsonProc] = []
    try:
        store = _start_tree(run, name, regions, tag, init, store, relays, relay_urls, rx)
        rx_cpu = [r.next(120).get("cpu_s", 0.0) for r in rx]
        before = {k: link.tx_rx() for k, link in run.links.items()}
        _idle_busy(name)
        sender = TensorSender(run.cur)
        freeze_long_lived()  # the sender's process, as the publisher's worker does
        meters = _Meters(run, relays, relay_urls)
        rows = []
        for v in range(1, (0 if name == "dense-s3" else run.versions) + 1):
            row, rx_cpu = _version(run, name, v, sender, store, rx, rx_cpu, meters)
            rows.append(row)
        dense_last = _dense_refit(run, store, rx) if name == "dense-s3" else None
        _check_bits(run, name, rx)
        after = {k: link.tx_rx() for k, link in run.links.items()}
    finally:
        for p in [*relays, *rx]:
            p.kill()
    if name == "dense-s3":
        link_bytes = {k: after[k][0] - before[k][0] for k in run.links}
        print(f"  {name}: last of {len(rx)} receivers loaded {dense_last:.1f} s after the step", flush=True)
        return {"scenario": name, "receivers": len(rx), "time_s": dense_last, "bytes_per_version": run.dense_bytes,
                "link_bytes_per_version": link_bytes, "bit_exact": True}  # (_check_bits raised otherwise)
    nv = max(1, len(rows))
    return {"scenario": name, "receivers": len(rx), "bit_exact": True,
            **_dcr_summary(rows, {k: (after[k][0] - before[k][0]) / nv for k in run.links})}


def _scenarios(run: _Run, scenarios: list[str], layouts: dict[str, dict[str, int]], rounds: int) -> list[dict]:
    """Every scenario asked for (but loopback), then the DCR ones again for each further round,
    in turn (the host drifts between them); one merged result per scenario."""
    results = [_scenario(run, name, layouts[name]) for name in scenarios if name != "loopback"]
    for r in range(1, rounds):
        for name in [n for n in scenarios if n not in ("loopback", "dense-s3")]:
            results.append(_scenario(run, name, layouts[name], f"{name}-round{r + 1}"))
    return _merge_rounds(results)


def _print_results(res: dict, rounds: int) -> None:
    """The table of scenarios, then the relay tree's ratio and the loopback rate."""
    scen_rows, tput = res["scenarios"], res["relay_loopback"]
    by = {r["scenario"]: r for r in scen_rows}
    both = res["all_vs_one"] is not None
    print(f"\n{'scenario':<12} {'recv':>4} {'time s':>8} {'MB/version':>11} {'link A MB':>10} {'link B MB':>10} "
          f"{'A x payload':>12} {'recv CPU-s':>11}")
    for r in scen_rows:
        lb = r["link_bytes_per_version"]
        xp = r.get("link_x_payload", {}).get("a")
        cpu = r.get("receiver_cpu_s")
        print(f"{r['scenario']:<12} {r['receivers']:>4} {r['time_s']:8.2f} {r['bytes_per_version'] / 1e6:11.2f} "
              f"{lb['a'] / 1e6:10.2f} {lb['b'] / 1e6:10.2f} {'' if xp is None else f'{xp:11.2f}x':>12} "
              f"{'' if cpu is None else f'{cpu:11.2f}'}")
    if both and rounds > 1:
        print("per round: " + ", ".join(f"{a:.2f} vs {b:.2f} s = {a / b:.2f}x" for a, b in zip(
            by["dcr-relay"]["round_time_s"], by["dcr-relay-1"]["round_time_s"], strict=True)))
    if both:
        print(f"relay tree: all {2 * res['receivers_per_region']} receivers in {by['dcr-relay']['time_s']:.2f} s vs "
              f"one in {by['dcr-relay-1']['time_s']:.2f} s = {res['all_vs_one']:.2f}x (target <= 1.3x); "
              f"inter-region bytes per version {by['dcr-relay']['link_x_payload']['a']:.2f}x / "
              f"{by['dcr-relay']['link_x_payload']['b']:.2f}x the payload (target 1x)")
    if tput:
        print(f"one relay on loopback {tput['MB_per_s']:.0f} MB/s (median of {len(tput['trials'])}, {tput['clients']} "
              f"clients on the same 2 cores; target >= 800), {tput['relay_MB_per_cpu_s']:.0f} MB per relay CPU-second")


def run(params: int = 1 << 27, mbit: float = 100.0, rate: float = 0.03, per_region: int = 4, versions: int = 5,
        json_path: str | None = None, seed: int = 0, scenarios: list[str] | None = None, apply: str = "sealed",
        rounds: int = 1, access_logs: str | None = None) -> dict:
    """The whole benchmark (module docstring); its result, written to json_path if given."""
    from nemo_dcr_callback.recipes import synthetic
    from nemo_dcr_callback.transport.seaweed import SeaweedS3

    layouts = _layouts(per_region)
    scenarios = scenarios or [*layouts, "loopback"]
    bad = [n for n in scenarios if n not in layouts and n != "loopback"]
    if bad:
        raise ValueError(f"no scenario {bad[0]!r} (one of {', '.join(layouts)}, loopback)")
    t_start = time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up namespaces and servers
    print(f"nemo-dcr bench relay: building a {params / 1e6:.0f}M-param synthetic policy ...", flush=True)
    policy = synthetic.make_policy(params, seed=seed)
    lr = policy.lr_for_rate(rate)
    cur = policy.bf16()
    dense_bytes = sum(t.numel() * t.element_size() for t in cur.values())
    work = Path(tempfile.mkdtemp(prefix="nemo-dcr-relay."))
    token = os.urandom(16).hex()
    logs = Path(access_logs) if access_logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    with ShapedLink(mbit, "10.78.1", "a") as la, ShapedLink(mbit, "10.78.2", "b") as lb, \
            SeaweedS3(work / "s3", ip=la.ip_a) as s3:
        env = {**os.environ, **s3.env(), "PYTHONUNBUFFERED": "1", TOKEN_ENV: token}
        env.pop("NEMO_DCR_RELAY_FAULT", None)
        print(f"2 regions x {per_region} receivers, inter-region links {mbit:.0f} Mbit/s each (tbf), model "
              f"{dense_bytes / 1e9:.2f} GB BF16, change {100 * rate:.0f}%, S3 = SeaweedFS at {s3.endpoint}", flush=True)
        state = _Run(policy, lr, cur, dense_bytes, versions, apply, work, token, s3, {"a": la, "b": lb}, env, logs)
        scen_rows = _scenarios(state, scenarios, layouts, rounds)
    tput = None
    if "loopback" in scenarios:
        print("  relay serving rate on loopback ...", flush=True)
        tput = relay_throughput(work, {**os.environ, TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"})
    by = {r["scenario"]: r for r in scen_rows}
    both = "dcr-relay" in by and "dcr-relay-1" in by
    res = {"benchmark": "relay", "apply": apply, "params": policy.numel, "dense_bytes": dense_bytes, "link_mbit": mbit,
           "rate": rate, "receivers_per_region": per_region, "versions": versions, "scenarios": scen_rows,
           "relay_loopback": tput,
           "all_vs_one": by["dcr-relay"]["time_s"] / by["dcr-relay-1"]["time_s"] if both else None,
           "machine": machine(), "wall_s": time.time() - t_start}
    _print_results(res, rounds)
    shutil.rmtree(work, ignore_errors=True)  # a GB or more of checkpoints and store data per run
    if json_path:
        write_json(json_path, res)
    return res


def _dcr_summary(rows: list[dict], link_bytes: dict[str, float]) -> dict:
    """A DCR scenario's figures: medians over its versions, bytes on each link per version."""
    payload = statistics.median(r["delta_bytes"] for r in rows)
    return {"rows": rows, "time_s": statistics.median(r["last_s"] for r in rows),
            "first_s": statistics.median(r["first_s"] for r in rows),
            "receiver_cpu_s": statistics.median(r["receiver_cpu_s"] for r in rows),
            "bytes_per_version": payload, "link_bytes_per_version": link_bytes,
            "link_x_payload": {k: b / payload for k, b in link_bytes.items()}}


def _merge_rounds(results: list[dict]) -> list[dict]:
    """One result per scenario: the versions of every round together (medians over all of
    them), with each round's median time kept as round_time_s."""
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["scenario"], []).append(r)
    out = []
    for rs in by.values():
        if len(rs) == 1 or "rows" not in rs[0]:
            out.append({**rs[0], "round_time_s": [r["time_s"] for r in rs]})
            continue
        rows = [{**row, "round": i} for i, r in enumerate(rs) for row in r["rows"]]
        link = {k: statistics.median(r["link_bytes_per_version"][k] for r in rs)
                for k in rs[0]["link_bytes_per_version"]}
        out.append({**rs[0], "bit_exact": all(r["bit_exact"] for r in rs), **_dcr_summary(rows, link),
                    "round_time_s": [r["time_s"] for r in rs]})
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "receiver":
        sys.exit(receiver_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        sys.exit(_client_main(sys.argv[2:]))
    run()
