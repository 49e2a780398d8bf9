"""`nemo-dcr plan`: how long a refit takes, from measured parts (docs/PLANNER.md).

The model follows the data path: the kernel and the encoder on every sender (in parallel
over the model-parallel shards), the upload, the inter-region link, the fan-out in the
receivers' region (every receiver pulling from object storage, or a relay tree), decoding
at the receivers while parts stream in, then the ack -> decision round trip and the apply.
The streamed stages overlap part by part: their time is the slowest stage plus the time of
one part through each of the others (a pipeline's fill). Coefficients come from this
project's benchmark results (benchmarks/results/*.json), each named with its source: the
package carries them as planner_calibration.json (an installed planner has no results
folder); `Coefficients.load(results_dir)` derives them from a folder of results instead, and
`nemo-dcr plan --calibrate` rewrites the packaged file from one.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The project's benchmark results, where validation reads its measured cases (a source checkout).
RESULTS = Path("benchmarks") / "results"
CALIBRATION = Path(__file__).with_name("planner_calibration.json")


def write_json(path: str | Path, obj) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2) + "\n")


def _interp(table: dict[float, float], rate: float) -> float:
    """Log-log interpolation over change rates (extrapolated from the nearest segment)."""
    xs = sorted(table)
    if len(xs) == 1:
        return table[xs[0]]
    i = max(1, min(len(xs) - 1, sum(1 for x in xs if x < rate)))
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = table[x0], table[x1]
    t = (math.log(rate) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


_BY_RATE = ("ratio", "kernel", "encode", "decode", "apply", "ctx_ratio", "ctx_encode", "ctx_decode")


@dataclass
class Coefficients:
    """Measured rates (GB/s of dense input per core unless said), with where each came from."""

    ratio: dict[float, float]  # codec ratio vs dense by change rate
    kernel: dict[float, float]
    encode: dict[float, float]
    decode: dict[float, float]
    apply: dict[float, float]
    link_efficiency: float  # goodput / nominal link rate (TCP/HTTP framing)
    request_s: float  # one store round trip + poll, as the ack -> decision step sees it
    receiver_overhead_cpu_s: float  # per receiver per version: protocol work beyond decode + apply
    relay_gbps_per_core: float  # what one relay serves per CPU-second
    store_put_MBps: float  # one client's PUTs into the local object store (client + server CPU included)
    gpu_kernel_gbps: float = 3360.0  # ASSUMED where cuda.json is missing: 70% of 4.8 TB/s (issue 8's target)
    gpu_apply_gbps: float = 2400.0  # ASSUMED likewise: 50% of 4.8 TB/s
    # one shared host (validation runs): CPU-s per version of each process of the 1-receiver
    # relay run (sender + committer, the object store, the root relay, a region relay serving
    # one receiver, one receiver) and that run's dense and payload bytes; None: not measured
    host_cpu: dict[str, float] | None = None
    # context coding (codec.json "context"): its ratio, its encode from the new bits and its
    # decode from the old ones (apply excluded), GB/s of dense input per core; None: not measured
    ctx_ratio: dict[float, float] | None = None
    ctx_encode: dict[float, float] | None = None
    ctx_decode: dict[float, float] | None = None
    sources: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, results: Path | None = None) -> Coefficients:
        """The packaged calibration, or the coefficients derived from a folder of results."""
        if results is None:
            return cls.from_json(json.loads(CALIBRATION.read_text()))
        return cls.derive(Path(results))

    def to_json(self) -> dict:
        d = asdict(self)
        for k in _BY_RATE:
            if d[k] is not None:
                d[k] = {repr(x): y for x, y in d[k].items()}  # JSON keys are strings; repr round-trips floats
        return d

    @classmethod
    def from_json(cls, d: dict) -> Coefficients:
        d = dict(d)
        for k in _BY_RATE:
            if d.get(k) is not None:
                d[k] = {float(x): y for x, y in d[k].items()}
        return cls(**d)

    @classmethod
    def derive(cls, results: Path) -> Coefficients:
        codec = json.loads((results / "codec.json").read_text())
        rows = {round(r["target_rate"], 4): r for r in codec["results"]}
        per = {k: {x: r["gbps_per_core"][k] for x, r in rows.items()} for k in ("kernel_input", "encode", "decode",
                                                                               "apply")}
        refit = json.loads((results / "refit.json").read_text())
        # the dense checkpoint's bytes over the link (older files: store and forward less the upload)
        dense_down = refit.get("dense_transport_s", refit["dense_s"] - refit["dense_upload_s"])
        eff = refit["dense_bytes"] / dense_down / refit["link_bytes_per_s"]
        req = sorted(r["commit_wait_s"] for r in refit["rows"])[len(refit["rows"]) // 2]
        relay = json.loads((results / "relay.json").read_text())
        one = next(s for s in relay["scenarios"] if s["scenario"] == "dcr-relay-1")
        dense_r = relay["dense_bytes"]
        r3 = relay["rate"]
        work = dense_r / 1e9 / _interp(per["decode"], r3) + dense_r / 1e9 / _interp(per["apply"], r3)
        over = max(0.0, one["receiver_cpu_s"] - work)
        host_cpu = None
        rows1 = [r for r in one.get("rows", []) if "cpu_s_by" in r]
        if rows1:  # bench relay's split of the host's CPU per process (dcr-relay-1: root, region a)
            med = lambda f: statistics.median(f(r) for r in rows1)  # noqa: E731
            host_cpu = {"sender": med(lambda r: r["cpu_s_by"]["sender"]), "store": med(lambda r: r["cpu_s_by"]["s3"]),
                        "root_relay": med(lambda r: r["cpu_s_by"]["relay-0"]),
                        "region_relay": med(lambda r: r["cpu_s_by"]["relay-1"]),
                        "receiver": med(lambda r: r["receiver_cpu_s"]), "dense_bytes": float(dense_r),
                        "payload_bytes": float(one["bytes_per_version"])}
        gpu: dict = {}
        gpu_source = "assumed (the H200 targets of issue 8): no benchmarks/results/cuda.json"
        if (results / "cuda.json").exists():  # scripts/device_check.sh on a GPU
            cuda = json.loads((results / "cuda.json").read_text())
            grows = [r for r in cuda["rows"] if r["baseline"] == "gpu"]
            gpu = {"gpu_kernel_gbps": statistics.median(r["delta_new_gbps"] for r in grows),
                   "gpu_apply_gbps": statistics.median(r["apply_gbps"] for r in grows)}
            gpu_source = (f"cuda.json ({cuda['device']}): medians over its rows of the delta pass with new values "
                          "and of the XOR apply, GB/s of shard input")
        ctx: dict = {}
        if all("context_encode" in r["gbps_per_core"] for r in rows.values()):
            g = {x: r["gbps_per_core"] for x, r in rows.items()}
            ctx = {"ctx_ratio": {x: r["context"]["ratio"] for x, r in rows.items()},
                   "ctx_encode": {x: g[x]["context_encode"] for x in g},
                   # decode + apply measured together; the apply is the plain one's (after the decision)
                   "ctx_decode": {x: 1 / (1 / g[x]["context_decode_apply"] - 1 / g[x]["apply"]) for x in g}}
        return cls(ratio={x: r["ratio"]["codec"] for x, r in rows.items()}, kernel=per["kernel_input"],
                   encode=per["encode"], decode=per["decode"], apply=per["apply"], link_efficiency=eff,
                   request_s=req, receiver_overhead_cpu_s=over,
                   relay_gbps_per_core=relay["relay_loopback"]["relay_MB_per_cpu_s"] / 1e3, **ctx,
                   store_put_MBps=refit["dense_bytes"] / refit["dense_upload_s"] / 1e6, host_cpu=host_cpu,
                   sources={
                       "ratio, kernel, encode, decode, apply": "codec.json (nemo-dcr bench codec: per core, medians)",
                       "ctx_ratio, ctx_encode, ctx_decode": "codec.json's context columns (ctx_decode: decode + "
                                                            "apply less the apply)" if ctx else "not in codec.json",
                       "link_efficiency": "refit.json: dense download bytes / time / nominal tbf rate",
                       "request_s": "refit.json: median ack -> decision time at the receiver",
                       "receiver_overhead_cpu_s": "relay.json dcr-relay-1: receiver CPU-s per version minus "
                                                  "decode + apply of that model (codec.json rates)",
                       "relay_gbps_per_core": "relay.json: loopback bytes served per relay CPU-second",
                       "store_put_MBps": "refit.json: the dense checkpoint's upload into SeaweedFS (same machine)",
                       "gpu_kernel_gbps, gpu_apply_gbps": gpu_source,
                       "host_cpu": "relay.json dcr-relay-1: CPU-s per version of each process (medians over "
                                   "versions; the bench reads /proc)" if host_cpu else "not in relay.json"}, **gpu)


@dataclass
class PlanInput:
    params: float
    rate: float = 0.03  # BF16 change rate
    dtype_bytes: int = 2
    senders: int = 1  # model-parallel ranks with distinct shards (TP x PP; data-parallel copies do not send)
    sender_device: str = "cpu"  # cpu | gpu: where the delta kernel runs
    encode_cores: int = 1  # CPU cores encoding per sender
    upload_MBps: float = 0.0  # senders -> store/root relay, all together (0: not a limit)
    link_MBps: float = 381.0  # each inter-region link, each way
    link_latency_s: float = 0.0
    regions: int = 1  # receiver regions, each behind its own link
    receivers: int = 1  # per region
    transport: str = "relay"  # relay | s3
    fanout: int = 8  # relay tree: children per relay
    relay_cores: int = 1  # CPU cores serving per relay
    intra_MBps: float = 1250.0  # inside a region (relay -> receivers)
    receiver_device: str = "cpu"  # cpu | gpu: where the apply runs
    receiver_cores: int = 1  # cores (or GPUs) one receiver decodes and applies with
    host_cores: int = 0  # >0: all receivers (every region) share this many cores (one test machine)
    part_MB: float = 4.0
    # context coding (config.CONTEXT_MODES): on, off, or auto with the receivers' link known
    # (dcr.link_mbit): the share of chunks context-coded that makes the refit shortest
    context: str = "auto"


CONTEXT_SHARES = tuple(i / 20 for i in range(21))  # the shares auto is evaluated at


def plan(inp: PlanInput, co: Coefficients) -> dict:
    """The breakdown, the streamed critical path, total and dense refit times (seconds), with
    the share of chunks context-coded (context_share): 1 for on, 0 for off or where context
    coding was not measured, for auto the share whose refit is shortest (what a sender that
    keeps just ahead of the link ends up coding)."""
    if inp.transport not in ("relay", "s3"):
        raise ValueError(f"transport must be relay or s3, not {inp.transport!r}")
    if not 0 < inp.rate < 1:
        raise ValueError("rate must be in (0, 1)")
    if inp.context not in ("auto", "on", "off"):
        raise ValueError(f"context must be auto, on or off, not {inp.context!r}")
    if co.ctx_ratio is None or inp.context == "off":
        shares: tuple[float, ...] = (0.0,)
    else:
        shares = (1.0,) if inp.context == "on" else CONTEXT_SHARES
    return min((_plan(inp, co, f) for f in shares), key=lambda p: p["total_s"])


def _mix(plain: float, ctx: dict[float, float] | None, f: float, rate: float) -> float:
    """Seconds (or bytes) per unit of dense input with a share f coded context (1/x mixed)."""
    return (1 - f) / plain + (f / _interp(ctx, rate) if f else 0.0)


def _plan(inp: PlanInput, co: Coefficients, f: float) -> dict:
    D = inp.params * inp.dtype_bytes  # dense bytes
    P = D * _mix(_interp(co.ratio, inp.rate), co.ctx_ratio, f, inp.rate)  # payload bytes per version
    shard = D / inp.senders
    gb = 1e9
    if inp.sender_device == "gpu":
        kernel = shard / (co.gpu_kernel_gbps * gb)
    else:
        kernel = shard / (_interp(co.kernel, inp.rate) * gb * inp.encode_cores)
    encode = shard * _mix(_interp(co.encode, inp.rate), co.ctx_encode, f, inp.rate) / (gb * inp.encode_cores)
    upload = P / (inp.upload_MBps * 1e6) if inp.upload_MBps else 0.0
    link = inp.link_MBps * 1e6 * co.link_efficiency
    R = inp.receivers
    if inp.transport == "s3":
        inter = R * P / link  # every receiver pulls the payload across the link
        fan = 0.0
        hops = 0
    else:
        inter = P / link  # once per link
        hops = max(1, math.ceil(math.log(max(R, 2), inp.fanout)))
        egress = min(inp.fanout, R) * P
        fan = max(egress / (inp.intra_MBps * 1e6), egress / (co.relay_gbps_per_core * gb * inp.relay_cores))
    # receivers: decode while parts stream in; apply after the decision
    dec_per_byte = _mix(_interp(co.decode, inp.rate), co.ctx_decode, f, inp.rate) / (gb * inp.receiver_cores)
    if inp.receiver_device == "gpu":
        app = D / (co.gpu_apply_gbps * gb * inp.receiver_cores)
    else:
        app = D / (_interp(co.apply, inp.rate) * gb * inp.receiver_cores)
    decode = D * dec_per_byte
    protocol = co.receiver_overhead_cpu_s  # manifests, record, ack, decision, digests: after the last part
    share = 1.0
    if inp.host_cores:  # receivers sharing one machine's cores
        share = max(1.0, R * inp.regions / inp.host_cores)
        decode, app, protocol = decode * share, app * share, protocol * share
    stages = {"kernel+encode": kernel + encode, "upload": upload, "inter-region": inter, "fan-out": fan,
              "decode": decode}
    frac = min(1.0, inp.part_MB * 1e6 / max(P, 1.0))
    slowest = max(stages, key=stages.get)
    streamed = stages[slowest] + sum(t * frac for k, t in stages.items() if k != slowest)
    if inp.host_cores:  # one machine runs everything: the CPU work is a floor too
        relays = inp.regions * fan if inp.transport == "relay" else 0.0
        cpu = inp.senders * (kernel + encode) + upload + R * inp.regions * (decode / share) + relays
        if cpu / inp.host_cores > streamed:
            streamed, slowest = cpu / inp.host_cores, "shared CPU"
    first = co.request_s + inp.link_latency_s * (1 + hops)  # the first part noticed downstream
    # ack up to the committer, decision down: a store round trip, and one more per relay level
    # (each relay passes the ack up and the decision down as requests of its own)
    commit = co.request_s * (1 + hops if inp.transport == "relay" else 1) + 2 * inp.link_latency_s * (1 + hops)
    total = first + streamed + protocol + commit + app
    floor = _host_cpu_floor(inp, co, D, P)
    if floor is not None and first + floor + commit > total:  # the shared cores, not the path, bound it
        total, slowest = first + floor + commit, "shared CPU (all processes)"
    dense_one = D / link + D / (_interp(co.apply, inp.rate) * gb)  # one dense copy across the link, loaded
    dense_s3 = R * D / link + D / (_interp(co.apply, inp.rate) * gb)  # every receiver pulls it
    return {"input": asdict(inp), "payload_bytes": P, "dense_bytes": D,
            "breakdown_s": {"kernel": kernel, "encode": encode, "upload": upload, "inter-region": inter,
                            "fan-out": fan, "decode": decode, "first part": first, "receiver protocol": protocol,
                            "commit": commit, "apply": app},
            "critical_path": slowest, "streamed_s": streamed, "total_s": total, "context_share": f,
            "dense_one_copy_s": dense_one, "dense_s3_s": dense_s3}


def _host_cpu_floor(inp: PlanInput, co: Coefficients, D: float, P: float) -> float | None:
    """A relay tree whose every process shares one host's cores (the validation runs): the CPU
    all of them spend per version, over the cores, bounds the refit from below. Per-process
    CPU comes from the 1-receiver relay run, scaled by model and payload size; the root relay
    with the region relays it serves, region relays and receivers with the receivers. None
    where not calibrated."""
    h = co.host_cpu
    if not inp.host_cores or h is None or inp.transport != "relay":
        return None
    kd, kp = D / h["dense_bytes"], P / h["payload_bytes"]
    n = inp.receivers * inp.regions
    # the root relay forwards the payload to every region's relay (the 1-receiver run has one)
    cpu = kd * h["sender"] + kp * (h["store"] + inp.regions * h["root_relay"]) \
        + n * (kp * h["region_relay"] + kd * h["receiver"])
    return cpu / inp.host_cores


# ------------------------------------------------------------------ validation against our runs
# Benchmark runs that derive() never reads, so their rows test the model rather than its fit:
# the other runs of `make bench-refit` (the same configuration, another run of the host), and a
# configuration the calibration did not see (another model size, link rate and change rate).
HELD_OUT = ("refit_run2.json", "refit_run3.json", "refit_holdout.json")


def _run_context(run: dict) -> str:
    """The context mode a benchmark's sender ran with, as the planner models it: auto without
    the receivers' link rate codes plain there (its uploads go to a store on its own host and
    never queue)."""
    mode = run.get("context", "auto")
    if mode == "auto" and not run.get("link_hint_mbit"):
        return "off"
    return mode


def _refit_cases(refit: dict, put: float, label: str, held_out: bool) -> list[tuple[str, PlanInput, float, bool]]:
    return [(f"bench refit {label}{100 * r['target_rate']:.0f}% (S3, 1 receiver)",
             PlanInput(refit["params"], r["target_rate"], senders=1, encode_cores=1, upload_MBps=put,
                       link_MBps=refit["link_bytes_per_s"] / 1e6, transport="s3", receivers=1, receiver_cores=1,
                       host_cores=2, part_MB=refit["part_bytes"] / 1e6, context=_run_context(refit)),
             r["e2e_s"], held_out)
            for r in refit["rows"]]


def validation_cases(results: Path = RESULTS, co: Coefficients | None = None
                     ) -> list[tuple[str, PlanInput, float, bool]]:
    """(name, input, measured seconds, held out) for every configuration the link and relay
    benchmarks ran: the runs the calibration reads (refit.json, relay.json), then the held-out
    ones (HELD_OUT) where they exist."""
    put = (co or Coefficients.load(results)).store_put_MBps
    refit = json.loads((results / "refit.json").read_text())
    out = _refit_cases(refit, put, "", False)
    relay = json.loads((results / "relay.json").read_text())
    for s in relay["scenarios"]:
        if s["scenario"] == "dense-s3":
            continue
        n = s["receivers"] // (2 if s["receivers"] > 1 else 1)
        out.append((f"bench relay {s['scenario']} ({s['receivers']} receivers)",
                    PlanInput(relay["params"], relay["rate"], senders=1, encode_cores=1, upload_MBps=put,
                              link_MBps=relay["link_mbit"] / 8,
                              transport="s3" if s["scenario"] == "dcr-s3" else "relay",
                              receivers=n, regions=2 if s["receivers"] > 1 else 1, receiver_cores=1,
                              host_cores=2, part_MB=1.0, context=_run_context(relay)), s["time_s"], False))
    for name in HELD_OUT:
        if (results / name).exists():
            held = json.loads((results / name).read_text())
            label = (f"{held['params'] / 1e6:.0f}M {held['link_mbit']:.0f} Mbit/s " if name == "refit_holdout.json"
                     else f"{name.removesuffix('.json').replace('refit_', '')} ")
            out += _refit_cases(held, put, label, True)
    return out


def validate(results: Path = RESULTS) -> list[dict]:
    co = Coefficients.load(results)
    rows = []
    for name, inp, measured, held_out in validation_cases(results, co):
        p = plan(inp, co)
        rows.append({"case": name, "predicted_s": p["total_s"], "measured_s": measured, "held_out": held_out,
                     "error": p["total_s"] / measured - 1, "critical_path": p["critical_path"]})
    return rows


# ------------------------------------------------------------------ the paper's scenarios
def scenarios(co: Coefficients) -> list[dict]:
    """30B / 235B / 1T at 1/3/5% over 381 MB/s between two regions, 1 and 64 receivers,
    object storage vs relay tree. Trainer: model-parallel senders (8 / 64 / 256: senders = model-
    parallel ranks), 8 CPU cores encoding per sender; receivers apply on GPUs (8 per receiver);
    relays serve with 8 cores over 100 Gbit/s inside the region; 50 ms between regions."""
    out = []
    for name, params, senders in (("30B", 30e9, 8), ("235B", 235e9, 64), ("1T", 1e12, 256)):
        for rate in (0.01, 0.03, 0.05):
            for receivers in (1, 64):
                for transport in ("s3", "relay"):
                    inp = PlanInput(params, rate, senders=senders, sender_device="gpu", encode_cores=8,
                                    link_MBps=381.0, link_latency_s=0.05, receivers=receivers, transport=transport,
                                    fanout=8, relay_cores=8, intra_MBps=12500.0, receiver_device="gpu",
                                    receiver_cores=8)
                    p = plan(inp, co)
                    out.append({"model": name, "rate": rate, "receivers": receivers, "transport": transport,
                                "payload_GB": p["payload_bytes"] / 1e9, "total_s": p["total_s"],
                                "critical_path": p["critical_path"], "dense_one_copy_s": p["dense_one_copy_s"],
                                "dense_s3_s": p["dense_s3_s"]})
    return out


def print_plan(p: dict) -> None:
    print(f"payload {p['payload_bytes'] / 1e9:.3f} GB of {p['dense_bytes'] / 1e9:.2f} GB dense")
    for k, v in p["breakdown_s"].items():
        mark = "  <- critical path" if k == p["critical_path"] or (k == "kernel" and p["critical_path"] ==
                                                                   "kernel+encode") else ""
        print(f"  {k:<17} {v:9.3f} s{mark}")
    print(f"context-coded share of the chunks: {p['context_share']:.0%}")
    print(f"streamed stages overlapped: {p['streamed_s']:.2f} s; total refit {p['total_s']:.2f} s")
    print(f"dense refit on the same link: {p['dense_one_copy_s']:.1f} s (one copy), "
          f"{p['dense_s3_s']:.1f} s (every receiver from object storage)")


def run_calibrate(results: Path = RESULTS, out: Path = CALIBRATION) -> Coefficients:
    """Derive the coefficients from a folder of results and write them where load() finds them."""
    co = Coefficients.derive(Path(results))
    write_json(out, co.to_json())
    print(f"wrote {out} (from {results})")
    return co


def run_validate(json_path: str | None = None, results: Path = RESULTS) -> list[dict]:
    """Prediction vs measurement for every benchmarked configuration (table; JSON)."""
    rows = validate(results)
    print(f"{'configuration':<52} {'predicted':>9} {'measured':>9} {'error':>7} {'held out':>8}  critical path")
    for r in rows:
        print(f"{r['case']:<52} {r['predicted_s']:8.2f}s {r['measured_s']:8.2f}s {100 * r['error']:+6.0f}% "
              f"{'yes' if r['held_out'] else 'no':>8}  {r['critical_path']}")
    for held in (False, True):
        part = [r for r in rows if r["held_out"] == held]
        ok = sum(abs(r["error"]) <= 0.2 for r in part)
        print(f"{'held out' if held else 'calibration runs'}: {ok}/{len(part)} within 20% (target: all)")
    if json_path:
        write_json(json_path, {"validation": rows, "coefficients": asdict(Coefficients.load(results))})
    return rows


def run_scenarios(json_path: str | None = None) -> list[dict]:
    rows = scenarios(Coefficients.load())
    print(f"{'model':<5} {'change':>6} {'recv/region':>11} {'transport':<9} {'payload':>9} {'refit':>9} "
          f"{'dense (1 copy)':>14}  critical path")
    for r in rows:
        print(f"{r['model']:<5} {100 * r['rate']:5.0f}% {r['receivers']:>11} {r['transport']:<9} "
              f"{r['payload_GB']:7.1f}GB {r['total_s']:8.1f}s {r['dense_one_copy_s'] / 60:12.1f}min  "
              f"{r['critical_path']}")
    if json_path:
        write_json(json_path, {"scenarios": rows})
    return rows
