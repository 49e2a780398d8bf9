"""Store commands: receive versions, run a relay or a local S3 server, inspect and clean a
store, and plan a refit."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
from pathlib import Path

from nemo_dcr_callback.commands.base import Command, positive
from nemo_dcr_callback.transport.relay.config import RelayConfig

_STORE_URL = "file://, s3:// or relay:// URL (or a failover chain)"


# --------------------------------------------------------------------- receive
def _receive_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None,
                   help="store URL (file:///path, s3://bucket/prefix[?endpoint=URL], relay://host:port; "
                        "comma-separated: a failover chain, nearest first)")
    p.add_argument("--topology", default=None, help="relay tree config (YAML, docs/RELAY.md); with --attach")
    p.add_argument("--attach", default=None,
                   help="the relay (name in --topology) this receiver attaches to; 'auto': the fastest to answer")
    p.add_argument("--id", default=None,
                   help="receiver id: register, ack versions, take part in the joint commit; {rank} and "
                        "{local_rank} take the launcher's (srun, mpirun, torchrun): a fleet in one command")
    p.add_argument("--hf-model", default=None, help="model directory to load (default: the store's keyframe)")
    p.add_argument("--model-dir", default=None, help="instead: a checkpoint directory to patch in place")
    p.add_argument("--fp8-dir", default=None,
                   help="instead: a block-FP8 checkpoint directory (nemo-dcr fp8-init) kept equal to the dense "
                        "FP8 cast of each version, requantizing only the blocks that changed")
    p.add_argument("--vllm", default=None, metavar="MODEL_DIR",
                   help="instead: serve MODEL_DIR with vLLM's OpenAI server (vllm serve) and keep it on the newest "
                        "committed version (needs vLLM installed: the [vllm] extra; follows until --until or stopped)")
    p.add_argument("--version", type=int, default=0, help="with --vllm: the version MODEL_DIR holds")
    p.add_argument("--host", default="127.0.0.1", help="with --vllm: the server's address")
    p.add_argument("--port", type=int, default=8000, help="with --vllm: the server's port")
    p.add_argument("--vllm-args", default="",
                   help="with --vllm: more arguments for vllm serve, one string (e.g. \"--tensor-parallel-size 2\")")
    p.add_argument("--follow", action="store_true", help="keep applying versions as they are sealed")
    p.add_argument("--until", type=int, default=None, help="stop after this version")
    p.add_argument("--verify", action="store_true", help="compare each version with its dense export")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--fetch-lanes", type=positive, default=2,
                   help="parts of a version downloading at once (more for a store far away: a link with "
                        "a large bandwidth-delay product)")
    p.add_argument("--idle-poll-ms", type=float, default=100.0,
                   help="on a store that cannot long-poll (S3, file://): after a second with nothing new, the "
                        "longest pause between polls (each poll of S3 is a LIST request; relays are long-polled)")
    p.add_argument("--apply", choices=["loader", "direct"], default="loader",
                   help="place changes through the model's own loader (default) or write tensors directly")
    p.add_argument("--device", default="cpu",
                   help="with a Hugging Face model: where it lives, e.g. cuda or cuda:1 (changes are then "
                        "applied there by the CUDA kernels)")
    p.add_argument("--json", action="store_true",
                   help="progress as one JSON object per line (ready, then one per version applied)")


def _receive_store(args: argparse.Namespace) -> str:
    """The store URL to follow: --store, or the relay --attach names in --topology."""
    if args.topology:
        from nemo_dcr_callback.transport.topology import Topology  # start-up cost: only when this command runs
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


def _receive(args: argparse.Namespace) -> int:
    from nemo_dcr_callback.receiver.main import run_receive, run_receive_dir  # start-up cost: torch (~1 s)

    args.store = _receive_store(args)
    if args.id:
        from nemo_dcr_callback.launcher import receiver_id  # start-up cost: only when this command runs

        args.id = receiver_id(args.id)
    if sum(bool(x) for x in (args.model_dir, args.fp8_dir, args.vllm, args.hf_model)) > 1:
        raise ValueError("give one of --hf-model, --model-dir, --fp8-dir and --vllm")
    if args.device != "cpu" and (args.vllm or args.model_dir or args.fp8_dir):
        raise ValueError("--device places a Hugging Face model; --model-dir and --fp8-dir patch files, and "
                         "--vllm takes vLLM's own device options in --vllm-args")
    if args.vllm:
        from nemo_dcr_callback.integrations import vllm_serve  # start-up cost: only when this command runs

        return vllm_serve.run(args.store, args.vllm, receiver_id=args.id, version=args.version, host=args.host,
                              port=args.port, vllm_args=shlex.split(args.vllm_args), until=args.until,
                              poll_s=args.idle_poll_ms / 1e3, json_lines=args.json)
    if args.model_dir or args.fp8_dir:
        return run_receive_dir(args.store, args.model_dir or args.fp8_dir, args.follow, args.until, args.timeout,
                               fp8=bool(args.fp8_dir),
                               receiver_id=args.id, fetch_lanes=args.fetch_lanes,
                               idle_poll_s=args.idle_poll_ms / 1e3, json_lines=args.json)
    return run_receive(args.store, args.hf_model, args.follow, args.until, args.verify, args.timeout,
                       args.apply, receiver_id=args.id, fetch_lanes=args.fetch_lanes,
                       idle_poll_s=args.idle_poll_ms / 1e3, json_lines=args.json, device=args.device)


# ------------------------------------------------------------------------ plan
def _plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=float, default=None, help="parameters (e.g. 1e12)")
    p.add_argument("--rate", type=float, default=0.03, help="BF16 change rate")
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--tp", type=positive, default=8)
    p.add_argument("--pp", type=positive, default=1)
    p.add_argument("--dp", type=positive, default=1, help="data-parallel copies (they do not send)")
    p.add_argument("--sender-device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--encode-cores", type=positive, default=8, help="CPU cores encoding per sender")
    p.add_argument("--upload-mbps", type=float, default=0.0, help="senders -> store, MB/s all together (0: no limit)")
    p.add_argument("--link-mbps", type=float, default=381.0, help="inter-region link, MB/s")
    p.add_argument("--latency", type=float, default=0.05, help="inter-region one-way latency, s")
    p.add_argument("--regions", type=positive, default=1)
    p.add_argument("--receivers", type=positive, default=1, help="per region")
    p.add_argument("--transport", choices=["relay", "s3"], default="relay")
    p.add_argument("--fanout", type=positive, default=8)
    p.add_argument("--relay-cores", type=positive, default=8)
    p.add_argument("--intra-mbps", type=float, default=12500.0, help="inside a region, MB/s")
    p.add_argument("--receiver-device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--receiver-cores", type=positive, default=8, help="GPUs or cores per receiver")
    p.add_argument("--part-mb", type=float, default=4.0)
    p.add_argument("--context", choices=["auto", "on", "off"], default="auto",
                   help="context coding: auto (the share with the shortest refit, as dcr.context=auto with "
                        "dcr.link_mbit set), on, off")
    p.add_argument("--validate", action="store_true", help="predict every benchmarked configuration vs measured")
    p.add_argument("--scenarios", action="store_true", help="the paper's scenarios (30B/235B/1T)")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.add_argument("--results", default=None,
                   help="a folder of benchmark results to calibrate from (default: the packaged calibration; "
                        "--validate reads benchmarks/results)")
    p.add_argument("--calibrate", action="store_true",
                   help="rewrite the packaged calibration from --results (default benchmarks/results)")


def _plan(args: argparse.Namespace) -> int:
    from nemo_dcr_callback.tools import planner  # start-up cost: only when this command runs
    results = Path(args.results) if args.results else None
    if args.calibrate:
        planner.run_calibrate(results or planner.RESULTS)
        return 0
    if args.validate:
        rows = planner.run_validate(args.json, results or planner.RESULTS)
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
                            part_MB=args.part_mb, context=args.context)
    p = planner.plan(inp, planner.Coefficients.load(results))
    if args.json:
        planner.write_json(args.json, p)
    planner.print_plan(p)
    return 0


# ----------------------------------------------------------------------- relay
def _relay_arguments(p: argparse.ArgumentParser) -> None:
    c = RelayConfig  # the defaults are RelayConfig's, written once there
    p.add_argument("--parent", default=None, help="upstream store URL (comma-separated: failover chain)")
    p.add_argument("--topology", default=None, help="relay tree config (YAML); with --name")
    p.add_argument("--name", default="relay", help="this relay's name (in --topology: its node)")
    p.add_argument("--listen", default=None, help="HOST:PORT (default: from --topology, else 127.0.0.1:0)")
    p.add_argument("--token-env", default="NEMO_DCR_RELAY_TOKEN", help="environment variable holding the token")
    p.add_argument("--receiver-token-env", default="NEMO_DCR_RELAY_RECEIVER_TOKEN",
                   help="environment variable holding the receivers' token (may write only registrations and acks)")
    p.add_argument("--no-token", action="store_true", help="accept unauthenticated peers (loopback trials only)")
    p.add_argument("--header-timeout-s", type=float, default=c.header_timeout_s,
                   help="close a connection that has not sent a complete request within this")
    p.add_argument("--body-timeout-s", type=float, default=c.body_timeout_s,
                   help="refuse a request body not complete within this")
    p.add_argument("--max-connections-per-peer", type=positive, default=c.max_connections_per_peer,
                   help="per client address")
    p.add_argument("--max-object-mb", type=positive, default=c.max_object_mb,
                   help="largest part or model file taken in a PUT")
    p.add_argument("--upload-mb", type=positive, default=c.upload_mb, help="request bodies held at once while read")
    p.add_argument("--cache-mb", type=positive, default=c.cache_mb)
    p.add_argument("--spill-dir", default=None, help="spill evicted objects here (default: drop them)")
    p.add_argument("--spill-mb", type=positive, default=c.spill_mb)
    p.add_argument("--poll-ms", type=float, default=1e3 * c.poll_s, help="how often to list the parent for new objects")
    p.add_argument("--idle-poll-ms", type=float, default=1e3 * c.idle_poll_s,
                   help="the longest pause between listings while nothing new turns up")
    p.add_argument("--write-through-poll-ms", type=float, default=1e3 * c.write_through_poll_s,
                   help="the same while senders write through this relay (listings then only catch writes that "
                        "went around it)")
    p.add_argument("--dormant-after-s", type=float, default=c.dormant_after_s,
                   help="after this long with nothing new in the parent or written through, list the parent "
                        "only every --dormant-poll-ms (an idle relay over S3 listed it 25 times a second)")
    p.add_argument("--dormant-poll-ms", type=float, default=1e3 * c.dormant_poll_s,
                   help="the pause between listings of the parent once dormant")
    p.add_argument("--passed-ttl-ms", type=float, default=1e3 * c.passed_ttl_s,
                   help="serve an ack or registration written through this relay from here for this long (a write "
                        "of the same key that went around the relay shows after at most this)")
    p.add_argument("--no-prefetch", action="store_true", help="fetch only on request")
    p.add_argument("--access-log", default=None, metavar="FILE",
                   help="append one JSON line per request served and per call to the parent (off by default)")
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)


def _relay_endpoints(args: argparse.Namespace) -> tuple[str, str, int]:
    """(parent URL, listen host, listen port) from --topology/--name or --parent, then --listen."""
    if args.topology:
        from nemo_dcr_callback.transport.topology import Topology  # start-up cost: only when this command runs
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
    return parent, host, port


def _relay(args: argparse.Namespace) -> int:
    from nemo_dcr_callback.launcher import is_loopback  # start-up cost: only when this command runs
    from nemo_dcr_callback.transport.relay import serve  # start-up cost: aiohttp, only for a relay

    parent, host, port = _relay_endpoints(args)
    token = None if args.no_token else os.environ.get(args.token_env)
    if args.no_token and not is_loopback(host):
        raise ValueError(f"--no-token is for loopback trials only, not for listening on {host}")
    if not args.no_token and not token:
        if token == "":
            raise ValueError(f"no relay token: {args.token_env} is empty (or --no-token for loopback trials)")
        raise ValueError(f"no relay token: set {args.token_env} (or --no-token for loopback trials)")
    receiver_token = os.environ.get(args.receiver_token_env) if not args.no_token else None
    if receiver_token == "" or (receiver_token and receiver_token == token):
        raise ValueError(f"{args.receiver_token_env} must be a token of its own (empty, or the publisher's)")
    serve(parent, RelayConfig(host=host, port=port, token=token, receiver_token=receiver_token, name=args.name,
                              cache_mb=args.cache_mb,
                              header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                              max_connections_per_peer=args.max_connections_per_peer,
                              max_object_mb=args.max_object_mb, upload_mb=args.upload_mb,
                              spill_dir=args.spill_dir, spill_mb=args.spill_mb, poll_s=args.poll_ms / 1e3,
                              idle_poll_s=args.idle_poll_ms / 1e3,
                              write_through_poll_s=args.write_through_poll_ms / 1e3,
                              dormant_after_s=args.dormant_after_s, dormant_poll_s=args.dormant_poll_ms / 1e3,
                              passed_ttl_s=args.passed_ttl_ms / 1e3, prefetch=not args.no_prefetch,
                              tls_cert=args.tls_cert, tls_key=args.tls_key, access_log=args.access_log))
    return 0


# ------------------------------------------------------------------ status, gc
def _status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, help=_STORE_URL)
    p.add_argument("--last", type=int, default=10, help="versions to show, newest first (default 10)")
    p.add_argument("--live-s", type=float, default=600.0,
                   help="a receiver seen within this many seconds is live (gc keeps what it needs)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _status(args: argparse.Namespace) -> int:
    # start-up cost: loads torch (~1 s), only when this command runs
    from nemo_dcr_callback.tools.status import collect, render
    from nemo_dcr_callback.transport.store import open_store

    st = collect(open_store(args.store), last=max(args.last, 0), live_s=args.live_s)
    print(json.dumps(st, indent=2) if args.json else render(st))
    return 0


def _gc_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, help=_STORE_URL)
    p.add_argument("--live-s", type=float, default=600.0,
                   help="keep the versions receivers seen within this many seconds still need")
    p.add_argument("--dry-run", action="store_true", help="list what would go, delete nothing")


def _gc(args: argparse.Namespace) -> int:
    # start-up cost: loads torch (~1 s), only when this command runs
    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.tools.status import existing
    from nemo_dcr_callback.transport.store import open_store

    keys = commit.gc(existing(open_store(args.store)), live_s=args.live_s, dry_run=args.dry_run)
    for k in keys:
        print(("would delete " if args.dry_run else "deleted ") + k)
    print(f"nemo-dcr gc: {'would delete' if args.dry_run else 'deleted'} {len(keys)} objects")
    return 0


# ------------------------------------------------------------------- s3-server
def _s3_server_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, help="data directory")
    p.add_argument("--ip", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="base port (12 consecutive ports; default: free ones)")


def _s3_server(args: argparse.Namespace) -> int:
    from nemo_dcr_callback.transport.seaweed import SeaweedS3, StartCancelled  # only when this command runs

    s3 = SeaweedS3(args.dir, ip=args.ip, base_port=args.port)

    # systemd, docker and timeout stop a service with SIGTERM (a closed terminal: SIGHUP); weed
    # runs in its own session, so without this it would outlive us and keep its ports and data.
    # Installed before weed starts: a stop during its start-up (the first seconds) orphaned it.
    # During start-up the handler only records the signal: raised inside Popen, the exception
    # lost weed's pid before start() could stop it. start() polls the record instead. Same while
    # stopping: a second signal must not cut stop() short.
    pending: list[int] = []
    record_only = True

    def stopped(signum, frame):
        pending.append(signum)
        if not record_only:
            raise _Stopped(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stopped)
    try:
        s3.start(cancelled=lambda: pending)
        record_only = False
        if pending:
            raise _Stopped(pending[0])
        print(f"S3 (SeaweedFS) at {s3.endpoint}, bucket {s3.bucket}; store URL {s3.url()}\n"
              "credentials for clients (never logged elsewhere):", flush=True)
        for k, v in s3.env().items():
            print(f"export {k}={v}", flush=True)
        s3.proc.wait()
    except (_Stopped, StartCancelled):
        print(f"nemo-dcr s3-server: {signal.Signals(pending[0]).name}: stopping SeaweedFS", flush=True)
    finally:
        record_only = True
        s3.stop()
    return 0


class _Stopped(Exception):
    """A stop signal, raised out of the wait so the finally clause stops SeaweedFS."""


COMMANDS = (
    Command("receive", "apply published versions to a Hugging Face model", _receive, _receive_arguments),
    Command("plan", "predict a refit's time from measured parts (docs/PLANNER.md)", _plan, _plan_arguments),
    Command("relay", "run a relay node of the fan-out tree (docs/RELAY.md)", _relay, _relay_arguments),
    Command("status", "what a store holds: newest versions, decisions, acks, receivers", _status, _status_arguments),
    Command("gc", "delete what no receiver needs (aborted versions, old keyframes, ...)", _gc, _gc_arguments),
    Command("s3-server", "run a local S3 server (SeaweedFS) for tests and trials", _s3_server, _s3_server_arguments),
)
