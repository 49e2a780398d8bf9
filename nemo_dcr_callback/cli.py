"""The `nemo-dcr` command.

  nemo-dcr diff OLD NEW -o DELTA      delta between two safetensors checkpoints
  nemo-dcr patch BASE DELTA -o OUT    rebuild NEW from BASE (all or nothing)
  nemo-dcr stats DELTA [--json]       size, change rate, information bound
  nemo-dcr bench codec [...]          codec benchmark (table + JSON)
  nemo-dcr demo                       diff/patch round trip on a synthetic policy
  nemo-dcr bench cuda [...]           CUDA kernels vs the CPU reference, timed vs a copy (GPU)
  nemo-dcr build-kernels [--cuda]     compile the CPU kernels (and the CUDA ones with nvcc)
  nemo-dcr relay --parent URL         a relay node of the fan-out tree
  nemo-dcr plan --params 1e12 ...     predict a refit's time (--validate, --scenarios)
  nemo-dcr receive --store URL ...    a receiver following a store or relay
"""

from __future__ import annotations

import argparse
import json
import sys

from nemo_dcr_callback import __version__


def _rates(s: str) -> list[float]:
    try:
        rates = [float(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of rates: {s!r}") from None
    if not rates or any(not 0 < r < 1 for r in rates):
        raise argparse.ArgumentTypeError("rates must be in (0, 1)")
    return rates


def _positive(s: str) -> int:
    v = int(float(s))
    if v <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return v


def _torchrun_parser(sub, name: str, help: str, pp: int, extra: str) -> argparse.ArgumentParser:
    """A benchmark that launches torchrun: --tp, --pp, --json and pass-through options."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--tp", type=_positive, default=2)
    p.add_argument("--pp", type=_positive, default=pp)
    p.add_argument("--json", default=None)
    p.add_argument("extra", nargs=argparse.REMAINDER, help=extra)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-dcr", description="Delta-compressed refit for RL policies.")
    p.add_argument("--version", action="version", version=f"nemo-dcr {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("diff", help="write the delta between two checkpoints")
    d.add_argument("old", help="a .safetensors file or a Hugging Face checkpoint directory")
    d.add_argument("new", help="the same kind of checkpoint, after training")
    d.add_argument("-o", "--output", required=True, help="delta file to write")
    d.add_argument("--chunk-span", type=_positive, default=None, help="positions per chunk (default 2^24)")
    d.add_argument("--level", type=int, default=1, help="zstd level for zstd-coded streams (default 1)")
    d.add_argument("-q", "--quiet", action="store_true")

    pa = sub.add_parser("patch", help="apply a delta to BASE, writing OUT (BASE is never modified)")
    pa.add_argument("base")
    pa.add_argument("delta")
    pa.add_argument("-o", "--output", required=True)
    pa.add_argument("--force", action="store_true", help="replace OUT if it exists")
    pa.add_argument("-q", "--quiet", action="store_true")

    s = sub.add_parser("stats", help="describe a delta file")
    s.add_argument("delta")
    s.add_argument("--json", action="store_true", help="print JSON")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bc = bsub.add_parser("codec", help="codec ratio and speed vs simple schemes and the bound")
    bc.add_argument("--params", type=_positive, default=1 << 26, help="synthetic parameters (default 64M)")
    bc.add_argument("--change-rates", type=_rates, default=[0.01, 0.03, 0.05])
    bc.add_argument("--reps", type=_positive, default=5, help="timed repetitions (median)")
    bc.add_argument("--seed", type=int, default=0)
    bc.add_argument("--json", default=None, help="write results to this JSON file")

    bp = _torchrun_parser(bsub, "placement", "map building and projection speed (launches torchrun)", pp=1,
                          extra="model options passed through (--layers, --hidden, ...)")
    bp.add_argument("--rate", type=float, default=0.03)

    rc = sub.add_parser("receive", help="apply published versions to a Hugging Face model")
    rc.add_argument("--store", default=None,
                    help="store URL (file:///path, s3://bucket/prefix[?endpoint=URL], relay://host:port; "
                         "comma-separated: a failover chain, nearest first)")
    rc.add_argument("--topology", default=None, help="relay tree config (YAML, docs/RELAY.md); with --attach")
    rc.add_argument("--attach", default=None,
                    help="the relay (name in --topology) this receiver attaches to; 'auto': the fastest to answer")
    rc.add_argument("--id", default=None, help="receiver id: register, ack versions, take part in the joint commit")
    rc.add_argument("--hf-model", default=None, help="model directory to load (default: the store's keyframe)")
    rc.add_argument("--model-dir", default=None, help="instead: a checkpoint directory to patch in place")
    rc.add_argument("--follow", action="store_true", help="keep applying versions as they are sealed")
    rc.add_argument("--until", type=int, default=None, help="stop after this version")
    rc.add_argument("--verify", action="store_true", help="compare each version with its dense export")
    rc.add_argument("--timeout", type=float, default=600.0)
    rc.add_argument("--fetch-lanes", type=_positive, default=2,
                    help="parts of a version downloading at once (more for a store far away: a link with "
                         "a large bandwidth-delay product)")
    rc.add_argument("--idle-poll-ms", type=float, default=100.0,
                    help="on a store that cannot long-poll (S3, file://): after a second with nothing new, the "
                         "longest pause between polls (each poll of S3 is a LIST request; relays are long-polled)")
    rc.add_argument("--apply", choices=["loader", "direct"], default="loader",
                    help="place changes through the model's own loader (default) or write tensors directly")
    rc.add_argument("--json", action="store_true",
                    help="progress as one JSON object per line (ready, then one per version applied)")

    bo = _torchrun_parser(bsub, "overhead", "training-step time with and without the callback (torchrun)", pp=2,
                          extra="Hydra overrides for both runs")
    bo.add_argument("--steps", type=_positive, default=30)
    bo.add_argument("--pairs", type=_positive, default=2)
    bo.add_argument("--alternate", type=int, default=0, metavar="K",
                    help="instead of runs with and without the callback: runs that publish in every other "
                         "block of K steps, compared block by block (default 0: separate runs)")

    br = bsub.add_parser("refit", help="end-to-end refit over a tbf-shaped link: dense vs DCR via S3 (root)")
    br.add_argument("--params", type=_positive, default=1 << 29, help="synthetic BF16 parameters (default 0.5G: 1 GB)")
    br.add_argument("--mbit", type=float, default=100.0, help="link rate each way, Mbit/s")
    br.add_argument("--rates", default="0.01,0.03,0.05", help="change rates, comma-separated")
    br.add_argument("--part-bytes", type=_positive, default=1 << 20)
    br.add_argument("--repeats", type=_positive, default=3,
                    help="versions per change rate; the table shows each rate's median version")
    br.add_argument("--apply", choices=["early", "sealed", "late"], default="sealed",
                    help="the receiver applies the parts it holds once the version is sealed (sealed, the "
                         "default), parts as they arrive (early), or everything after the commit (late)")
    br.add_argument("--json", default=None, help="write the results here (benchmarks/results/refit.json)")

    bv = bsub.add_parser("receive", help="a receiver's apply per version: state dict, the model's loader, "
                                         "a checkpoint dir")
    bv.add_argument("--params", type=_positive, default=1 << 25, help="synthetic BF16 parameters (default 32M)")
    bv.add_argument("--rate", type=float, default=0.03, help="change rate")
    bv.add_argument("--versions", type=_positive, default=5)
    bv.add_argument("--rounds", type=_positive, default=3, help="each kind of receiver applies the chain this often")
    bv.add_argument("--kinds", default="state-dict,loader,loader-dense,checkpoint-dir",
                    help="receivers to compare, comma-separated")
    bv.add_argument("--json", default=None, help="write the results here (benchmarks/results/receive.json)")

    bl = bsub.add_parser("relay", help="fan-out to 2 regions x 4 receivers: dense/DCR via S3 vs relay tree (root)")
    bl.add_argument("--params", type=_positive, default=1 << 27, help="synthetic BF16 parameters (default 128M)")
    bl.add_argument("--mbit", type=float, default=100.0, help="inter-region link rate each way, Mbit/s")
    bl.add_argument("--rate", type=float, default=0.03, help="change rate")
    bl.add_argument("--receivers", type=_positive, default=4, help="receivers per region")
    bl.add_argument("--scenarios", default="dense-s3,dcr-s3,dcr-relay,dcr-relay-1,loopback",
                    help="which to run, comma-separated (the 1.3x ratio needs dcr-relay and dcr-relay-1; "
                         "loopback: one relay's serving rate)")
    bl.add_argument("--versions", type=_positive, default=5, help="versions per DCR scenario (the first, on cold "
                    "connections, is the slowest; the table gives medians)")
    bl.add_argument("--apply", choices=["early", "sealed", "late"], default="sealed",
                    help="receivers apply the parts held once the version is sealed, before acking (sealed, the "
                         "default, as in bench refit), after the commit (late), or as parts arrive (early)")
    bl.add_argument("--rounds", type=_positive, default=1,
                    help="run the DCR scenarios this many times, in turn (medians over every round's versions; "
                         "the host drifts between scenarios)")
    bl.add_argument("--json", default=None, help="write the results here (benchmarks/results/relay.json)")
    bl.add_argument("--access-logs", default=None, metavar="DIR",
                    help="every relay writes its access log here (SCENARIO-RELAY.jsonl), to trace a failed run")

    pl = sub.add_parser("plan", help="predict a refit's time from measured parts (docs/PLANNER.md)")
    pl.add_argument("--params", type=float, default=None, help="parameters (e.g. 1e12)")
    pl.add_argument("--rate", type=float, default=0.03, help="BF16 change rate")
    pl.add_argument("--dtype-bytes", type=int, default=2)
    pl.add_argument("--tp", type=_positive, default=8)
    pl.add_argument("--pp", type=_positive, default=1)
    pl.add_argument("--dp", type=_positive, default=1, help="data-parallel copies (they do not send)")
    pl.add_argument("--sender-device", choices=["gpu", "cpu"], default="gpu")
    pl.add_argument("--encode-cores", type=_positive, default=8, help="CPU cores encoding per sender")
    pl.add_argument("--upload-mbps", type=float, default=0.0, help="senders -> store, MB/s all together (0: no limit)")
    pl.add_argument("--link-mbps", type=float, default=381.0, help="inter-region link, MB/s")
    pl.add_argument("--latency", type=float, default=0.05, help="inter-region one-way latency, s")
    pl.add_argument("--regions", type=_positive, default=1)
    pl.add_argument("--receivers", type=_positive, default=1, help="per region")
    pl.add_argument("--transport", choices=["relay", "s3"], default="relay")
    pl.add_argument("--fanout", type=_positive, default=8)
    pl.add_argument("--relay-cores", type=_positive, default=8)
    pl.add_argument("--intra-mbps", type=float, default=12500.0, help="inside a region, MB/s")
    pl.add_argument("--receiver-device", choices=["gpu", "cpu"], default="gpu")
    pl.add_argument("--receiver-cores", type=_positive, default=8, help="GPUs or cores per receiver")
    pl.add_argument("--part-mb", type=float, default=4.0)
    pl.add_argument("--validate", action="store_true", help="predict every benchmarked configuration vs measured")
    pl.add_argument("--scenarios", action="store_true", help="the paper's scenarios (30B/235B/1T)")
    pl.add_argument("--json", default=None, help="write the result as JSON here")

    ry = sub.add_parser("relay", help="run a relay node of the fan-out tree (docs/RELAY.md)")
    ry.add_argument("--parent", default=None, help="upstream store URL (comma-separated: failover chain)")
    ry.add_argument("--topology", default=None, help="relay tree config (YAML); with --name")
    ry.add_argument("--name", default="relay", help="this relay's name (in --topology: its node)")
    ry.add_argument("--listen", default=None, help="HOST:PORT (default: from --topology, else 127.0.0.1:0)")
    ry.add_argument("--token-env", default="NEMO_DCR_RELAY_TOKEN", help="environment variable holding the token")
    ry.add_argument("--no-token", action="store_true", help="accept unauthenticated peers (loopback trials only)")
    ry.add_argument("--cache-mb", type=_positive, default=1024)
    ry.add_argument("--spill-dir", default=None, help="spill evicted objects here (default: drop them)")
    ry.add_argument("--spill-mb", type=_positive, default=8192)
    ry.add_argument("--poll-ms", type=float, default=5.0, help="how often to list the parent for new objects")
    ry.add_argument("--idle-poll-ms", type=float, default=40.0,
                    help="the longest pause between listings while nothing new turns up")
    ry.add_argument("--write-through-poll-ms", type=float, default=1000.0,
                    help="the same while senders write through this relay (listings then only catch writes that "
                         "went around it)")
    ry.add_argument("--dormant-after-s", type=float, default=60.0,
                    help="after this long with nothing new in the parent or written through, list the parent "
                         "only every --dormant-poll-ms (an idle relay over S3 listed it 25 times a second)")
    ry.add_argument("--dormant-poll-ms", type=float, default=1000.0,
                    help="the pause between listings of the parent once dormant")
    ry.add_argument("--passed-ttl-ms", type=float, default=60000.0,
                    help="serve an ack or registration written through this relay from here for this long (a write "
                         "of the same key that went around the relay shows after at most this)")
    ry.add_argument("--no-prefetch", action="store_true", help="fetch only on request")
    ry.add_argument("--access-log", default=None, metavar="FILE",
                    help="append one JSON line per request served and per call to the parent (off by default)")
    ry.add_argument("--tls-cert", default=None)
    ry.add_argument("--tls-key", default=None)

    st = sub.add_parser("status", help="what a store holds: newest versions, decisions, acks, receivers")
    st.add_argument("--store", required=True, help="file://, s3:// or relay:// URL (or a failover chain)")
    st.add_argument("--last", type=int, default=10, help="versions to show, newest first (default 10)")
    st.add_argument("--live-s", type=float, default=600.0,
                    help="a receiver seen within this many seconds is live (gc keeps what it needs)")
    st.add_argument("--json", action="store_true", help="print JSON instead of the table")

    gcp = sub.add_parser("gc", help="delete what no receiver needs (aborted versions, old keyframes, ...)")
    gcp.add_argument("--store", required=True, help="file://, s3:// or relay:// URL (or a failover chain)")
    gcp.add_argument("--live-s", type=float, default=600.0,
                     help="keep the versions receivers seen within this many seconds still need")
    gcp.add_argument("--dry-run", action="store_true", help="list what would go, delete nothing")

    s3p = sub.add_parser("s3-server", help="run a local S3 server (SeaweedFS) for tests and trials")
    s3p.add_argument("--dir", required=True, help="data directory")
    s3p.add_argument("--ip", default="127.0.0.1")
    s3p.add_argument("--port", type=int, default=None, help="base port (12 consecutive ports; default: free ones)")

    de = sub.add_parser("demo", help="the main job: 4-rank CPU training publishing to a following receiver")
    de.add_argument("--steps", type=_positive, default=10)
    de.add_argument("--tp", type=_positive, default=2)
    de.add_argument("--pp", type=_positive, default=2)
    de.add_argument("--workdir", default=None, help="run directory (default: runs/demo-<time>)")
    de.add_argument("--files", action="store_true", help="instead: diff/patch round trip on a synthetic policy")
    de.add_argument("--params", type=_positive, default=1 << 24, help="with --files")
    de.add_argument("--change-rate", type=float, default=0.03, help="with --files")

    bcu = bsub.add_parser("cuda", help="CUDA kernels: check vs the CPU reference, time vs a device copy (GPU)")
    bcu.add_argument("--sizes-mib", default="256,1024", help="timed input sizes in MiB, comma-separated")
    bcu.add_argument("--rates", default="0.01,0.03,0.05", help="change rates, comma-separated")
    bcu.add_argument("--reps", type=_positive, default=10, help="timed repetitions (median)")
    bcu.add_argument("--json", default=None, help="results file (default: $OUT/cuda.json or benchmarks/results/)")
    bcu.add_argument("--skip-check", action="store_true", help="timings only")

    bk = sub.add_parser("build-kernels", help="compile the CPU kernels (done by make setup)")
    bk.add_argument("--cuda", action="store_true", help="also build the CUDA kernels (nvcc; no GPU needed)")
    return p


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def print_stats(st: dict) -> None:
    print(f"tensors            {st['tensors']} ({st['full_tensors']} sent whole, {st['removed_tensors']} removed)")
    print(f"params             {st['params']:,}")
    print(f"changed            {st['changed']:,} ({st['change_rate']:.3%} of delta-coded params)")
    print(f"delta size         {_human(st['bytes'])} (payload {_human(st['payload_bytes'])})")
    print(f"dense size         {_human(st['dense_bytes'])}")
    print(f"bits per param     {st['bits_per_param']:.4f}")
    print(f"ratio vs dense     {st['ratio_vs_dense']:.1f}x")
    print(f"bound (xor)        {_human(st['xor_bound_bytes'])}  efficiency {st['efficiency_vs_xor_bound']:.3f}")
    print(f"bound (ulp)        {_human(st['ulp_bound_bytes'])}  efficiency {st['efficiency_vs_ulp_bound']:.3f}")


def _torchrun(nproc: int, module: str, args: list[str]) -> int:
    """Run a module under torchrun on this host (gloo on CPU)."""
    import subprocess

    from nemo_dcr_callback.testing.launch import torchrun_cmd

    return subprocess.run(torchrun_cmd(nproc, ["-m", module, *args])).returncode


def _receive_store(args) -> str:
    if args.topology:
        from nemo_dcr_callback.transport.topology import Topology
        if not args.attach:
            raise ValueError("--topology needs --attach RELAY (the relay this receiver attaches to)")
        topo = Topology.load(args.topology)
        name = topo.nearest() if args.attach == "auto" else args.attach
        if name not in topo.nodes:
            raise ValueError(f"no relay {name!r} in {args.topology} (has {', '.join(topo.nodes)})")
        print(f"receiver: attached to relay {name}", flush=True)
        return topo.attach(name)
    if not args.store:
        raise ValueError("give --store URL, or --topology FILE --attach RELAY")
    return args.store


def _plan(args) -> int:
    from nemo_dcr_callback.tools import planner
    if args.validate:
        rows = planner.run_validate(args.json)
        return 0 if all(abs(r["error"]) <= 0.2 for r in rows) else 1
    if args.scenarios:
        planner.run_scenarios(args.json)
        return 0
    if args.params is None:
        raise ValueError("give --params (or --validate / --scenarios)")
    inp = planner.PlanInput(args.params, args.rate, args.dtype_bytes, senders=args.tp * args.pp,
                            sender_device=args.sender_device, encode_cores=args.encode_cores,
                            upload_MBps=args.upload_mbps, link_MBps=args.link_mbps, link_latency_s=args.latency,
                            regions=args.regions, receivers=args.receivers, transport=args.transport,
                            fanout=args.fanout, relay_cores=args.relay_cores, intra_MBps=args.intra_mbps,
                            receiver_device=args.receiver_device, receiver_cores=args.receiver_cores,
                            part_MB=args.part_mb)
    p = planner.plan(inp, planner.Coefficients.load())
    if args.json:
        from nemo_dcr_callback.bench.results import write_json
        write_json(args.json, p, quiet=True)
    planner.print_plan(p)
    return 0


def _relay(args) -> int:
    import os

    from nemo_dcr_callback.transport.relay import RelayConfig, serve
    if args.topology:
        from nemo_dcr_callback.transport.topology import Topology
        topo = Topology.load(args.topology)
        if args.name not in topo.nodes:
            raise ValueError(f"no relay {args.name!r} in {args.topology} (has {', '.join(topo.nodes)})")
        parent, (host, port) = topo.upstream(args.name), topo.listen(args.name)
    elif args.parent:
        parent, host, port = args.parent, "127.0.0.1", 0
    else:
        raise ValueError("give --parent URL, or --topology FILE --name RELAY")
    if args.listen:
        host, _, p = args.listen.rpartition(":")
        port = int(p)
    token = None if args.no_token else os.environ.get(args.token_env)
    if token is None and not args.no_token:
        raise ValueError(f"no relay token: set {args.token_env} (or --no-token for loopback trials)")
    serve(parent, RelayConfig(host=host, port=port, token=token, name=args.name, cache_mb=args.cache_mb,
                              spill_dir=args.spill_dir, spill_mb=args.spill_mb, poll_s=args.poll_ms / 1e3,
                              idle_poll_s=args.idle_poll_ms / 1e3,
                              write_through_poll_s=args.write_through_poll_ms / 1e3,
                              dormant_after_s=args.dormant_after_s, dormant_poll_s=args.dormant_poll_ms / 1e3,
                              passed_ttl_s=args.passed_ttl_ms / 1e3, prefetch=not args.no_prefetch,
                              tls_cert=args.tls_cert, tls_key=args.tls_key, access_log=args.access_log))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from nemo_dcr_callback import codec
    from nemo_dcr_callback.tools.checkpoint import CheckpointError
    from nemo_dcr_callback.tools.deltafile import DeltaError

    try:
        if args.cmd == "diff":
            from nemo_dcr_callback.tools.deltafile import diff
            span = args.chunk_span or codec.DEFAULT_CHUNK_SPAN
            diff(args.old, args.new, args.output, span=span, level=args.level, quiet=args.quiet)
            if not args.quiet:
                from nemo_dcr_callback.tools.deltafile import stats
                print_stats(stats(args.output))
        elif args.cmd == "patch":
            from nemo_dcr_callback.tools.deltafile import patch
            patch(args.base, args.delta, args.output, force=args.force, quiet=args.quiet)
            if not args.quiet:
                print(f"wrote {args.output} (every tensor digest verified)")
        elif args.cmd == "stats":
            from nemo_dcr_callback.tools.deltafile import stats
            st = stats(args.delta)
            print(json.dumps(st, indent=2)) if args.json else print_stats(st)
        elif args.cmd == "bench" and args.bench == "overhead":
            from nemo_dcr_callback.bench import overhead as bench_overhead
            bench_overhead.run(args.tp, args.pp, args.steps, args.pairs, json_path=args.json, extra=list(args.extra),
                               alternate=args.alternate)
        elif args.cmd == "bench" and args.bench == "refit":
            from nemo_dcr_callback.bench import refit as bench_refit
            bench_refit.run(args.params, args.mbit, tuple(float(x) for x in args.rates.split(",")), args.part_bytes,
                            json_path=args.json, apply=args.apply, repeats=args.repeats)
        elif args.cmd == "bench" and args.bench == "receive":
            from nemo_dcr_callback.bench import receive as bench_receive
            bench_receive.run(args.params, args.rate, args.versions, args.rounds, tuple(args.kinds.split(",")),
                              json_path=args.json)
        elif args.cmd == "bench" and args.bench == "relay":
            from nemo_dcr_callback.bench import relay as bench_relay
            bench_relay.run(args.params, args.mbit, args.rate, args.receivers, args.versions, json_path=args.json,
                            scenarios=args.scenarios.split(","), apply=args.apply, rounds=args.rounds,
                            access_logs=args.access_logs)
        elif args.cmd == "relay":
            return _relay(args)
        elif args.cmd == "plan":
            return _plan(args)
        elif args.cmd == "s3-server":
            from nemo_dcr_callback.transport.seaweed import SeaweedS3
            s3 = SeaweedS3(args.dir, ip=args.ip, base_port=args.port).start()
            print(f"S3 (SeaweedFS) at {s3.endpoint}, bucket {s3.bucket}; store URL {s3.url()}\n"
                  "credentials for clients (never logged elsewhere):", flush=True)
            for k, v in s3.env().items():
                print(f"export {k}={v}", flush=True)
            try:
                s3.proc.wait()
            except KeyboardInterrupt:
                s3.stop()
        elif args.cmd == "bench" and args.bench == "cuda":
            from nemo_dcr_callback.bench import cuda as bench_cuda
            return bench_cuda.run([int(x) for x in args.sizes_mib.split(",") if x],
                                  [float(x) for x in args.rates.split(",") if x], args.reps, args.json,
                                  check=not args.skip_check)
        elif args.cmd == "bench" and args.bench == "placement":
            return _torchrun(args.tp * args.pp, "nemo_dcr_callback.bench.placement",
                             ["--tp", str(args.tp), "--pp", str(args.pp), "--rate", str(args.rate)]
                             + (["--json", args.json] if args.json else []) + list(args.extra))
        elif args.cmd == "bench":
            from nemo_dcr_callback.bench import codec as bench
            bench.run(args.params, tuple(args.change_rates), args.reps, args.seed, args.json)
        elif args.cmd == "receive":
            from nemo_dcr_callback.receiver.main import run_receive, run_receive_dir
            args.store = _receive_store(args)
            if args.model_dir:
                return run_receive_dir(args.store, args.model_dir, args.follow, args.until, args.timeout,
                                       receiver_id=args.id, fetch_lanes=args.fetch_lanes,
                                       idle_poll_s=args.idle_poll_ms / 1e3, json_lines=args.json)
            return run_receive(args.store, args.hf_model, args.follow, args.until, args.verify, args.timeout,
                               args.apply, receiver_id=args.id, fetch_lanes=args.fetch_lanes,
                               idle_poll_s=args.idle_poll_ms / 1e3, json_lines=args.json)
        elif args.cmd == "status":
            from nemo_dcr_callback.tools.status import collect, render
            from nemo_dcr_callback.transport.store import open_store
            st = collect(open_store(args.store), last=max(args.last, 0), live_s=args.live_s)
            print(json.dumps(st, indent=2) if args.json else render(st))
        elif args.cmd == "gc":
            from nemo_dcr_callback.protocol import commit
            from nemo_dcr_callback.tools.status import existing
            from nemo_dcr_callback.transport.store import open_store
            keys = commit.gc(existing(open_store(args.store)), live_s=args.live_s, dry_run=args.dry_run)
            for k in keys:
                print(("would delete " if args.dry_run else "deleted ") + k)
            print(f"nemo-dcr gc: {'would delete' if args.dry_run else 'deleted'} {len(keys)} objects")
        elif args.cmd == "demo" and args.files:
            from nemo_dcr_callback.recipes.demo import run_demo
            return run_demo(args.params, args.change_rate, min(args.steps, 3), args.workdir)
        elif args.cmd == "demo":
            from nemo_dcr_callback.recipes.demo import run_training_demo
            return run_training_demo(args.steps, args.tp, args.pp, args.workdir)
        elif args.cmd == "build-kernels":
            from nemo_dcr_callback.core import kernels
            print(kernels.build(verbose=True))
            if args.cuda:
                import subprocess

                from nemo_dcr_callback.core import cuda_kernels
                try:
                    print(cuda_kernels.build(verbose=True))
                except (RuntimeError, subprocess.CalledProcessError) as exc:
                    print(f"nemo-dcr build-kernels: error: {exc}", file=sys.stderr)
                    return 2
    except (DeltaError, codec.ChunkError, CheckpointError, FileExistsError, ValueError) as exc:
        print(f"nemo-dcr {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        print(f"nemo-dcr {args.cmd}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

