"""`nemo-dcr bench ...`: the benchmarks. Each imports its implementation (bench/) inside run,
never at module level: product code does not depend on the benchmarks."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from nemo_dcr_callback.commands.base import Command, positive, rates


def _torchrun_arguments(p: argparse.ArgumentParser, pp: int, extra: str) -> None:
    """A benchmark that launches torchrun: --tp, --pp, --json and pass-through options."""
    p.add_argument("--tp", type=positive, default=2)
    p.add_argument("--pp", type=positive, default=pp)
    p.add_argument("--json", default=None)
    p.add_argument("extra", nargs=argparse.REMAINDER, help=extra)


def _torchrun(nproc: int, module: str, args: list[str]) -> int:
    """Run a module under torchrun on this host (gloo on CPU)."""
    # start-up cost: subprocess and launcher are not loaded for every CLI call, only a torchrun benchmark
    import subprocess

    from nemo_dcr_callback.launcher import torchrun_cmd

    return subprocess.run(torchrun_cmd(nproc, ["-m", module, *args])).returncode


# ----------------------------------------------------------------------- codec
def _codec_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=positive, default=1 << 26, help="synthetic parameters (default 64M)")
    p.add_argument("--change-rates", type=rates, default=None,
                   help="target change rates (default 0.01,0.03,0.05; with --real 0.01,0.04)")
    p.add_argument("--reps", type=positive, default=5, help="timed repetitions (median; with --real at most 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument("--real", action="store_true",
                   help="the real-gradient corpus instead (whole delta files vs the XOR bound and the "
                        "conditional-entropy figure, and the refit path's overhead at 100M parameters)")
    p.add_argument("--no-refit", action="store_true", help="with --real: skip the 100M refit row")


def _codec(args: argparse.Namespace) -> int:
    if args.real:
        from nemo_dcr_callback.bench import codec_real  # start-up cost: only when this benchmark runs

        codec_real.run(min(args.reps, 3), rates=tuple(args.change_rates or (0.01, 0.04)), refit=not args.no_refit,
                       json_path=args.json)
        return 0
    from nemo_dcr_callback.bench import codec  # start-up cost: only when this benchmark runs

    codec.run(args.params, tuple(args.change_rates or (0.01, 0.03, 0.05)), args.reps, args.seed, args.json)
    return 0


# ------------------------------------------------------------------- placement
def _placement_arguments(p: argparse.ArgumentParser) -> None:
    _torchrun_arguments(p, pp=1, extra="model options passed through (--layers, --hidden, --experts, --family, "
                                        "--moe-ffn, --encode, ...)")
    p.add_argument("--rate", type=float, default=0.03)
    p.add_argument("--ep", type=positive, default=1, help="expert parallelism (ranks: TP x PP x EP)")


def _placement(args: argparse.Namespace) -> int:
    return _torchrun(args.tp * args.pp * args.ep, "nemo_dcr_callback.bench.placement",
                     ["--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep), "--rate", str(args.rate)]
                     + (["--json", args.json] if args.json else []) + _passed(args.extra))


def _passed(extra: list[str]) -> list[str]:
    """Pass-through options, without the `--` that separates them."""
    return extra[1:] if extra[:1] == ["--"] else list(extra)


# -------------------------------------------------------------------- overhead
def _overhead_arguments(p: argparse.ArgumentParser) -> None:
    _torchrun_arguments(p, pp=2, extra="Hydra overrides for both runs")
    p.add_argument("--steps", type=positive, default=30)
    p.add_argument("--pairs", type=positive, default=2)
    p.add_argument("--alternate", type=int, default=0, metavar="K",
                   help="instead of runs with and without the callback: runs that publish in every other "
                        "block of K steps, compared block by block (default 0: separate runs)")
    p.add_argument("--store", choices=["file", "s3"], default="file",
                   help="where the callback publishes: the run folder's file store (default), or an S3 server "
                        "(SeaweedFS) the benchmark starts on this host, as in production")


def _overhead(args: argparse.Namespace) -> int:
    from nemo_dcr_callback.bench import overhead  # start-up cost: only when this benchmark runs

    overhead.run(args.tp, args.pp, args.steps, args.pairs, json_path=args.json, extra=list(args.extra),
                 alternate=args.alternate, store=args.store)
    return 0


# ----------------------------------------------------------------------- refit
def _refit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=positive, default=1 << 29, help="synthetic BF16 parameters (default 0.5G: 1 GB)")
    p.add_argument("--mbit", type=float, default=100.0, help="link rate each way, Mbit/s")
    p.add_argument("--rates", default="0.01,0.03,0.05", help="change rates, comma-separated")
    p.add_argument("--part-bytes", type=positive, default=1 << 20)
    p.add_argument("--repeats", type=positive, default=3,
                   help="versions per change rate; the table shows each rate's median version")
    p.add_argument("--apply", choices=["early", "sealed", "late"], default="sealed",
                   help="the receiver applies the parts it holds once the version is sealed (sealed, the "
                        "default), parts as they arrive (early), or everything after the commit (late)")
    p.add_argument("--deltas", default="adamw,uniform",
                   help="kinds of versions, in order: adamw (fp32 masters, AdamW-like steps), uniform")
    p.add_argument("--context", choices=["auto", "on", "off"], default="auto",
                   help="when the sender context-codes (dcr.context): auto (default), on, off")
    p.add_argument("--no-link-hint", action="store_true",
                   help="do not tell the sender the link's rate (dcr.link_mbit): auto then judges by its own "
                        "upload, which here goes to a store on its side of the link")
    p.add_argument("--encode-threads", type=positive, default=None,
                   help="tensors the sender encodes at once (default: the kernels' thread count, at most 4)")
    p.add_argument("--no-context-share", action="store_true",
                   help="skip encoding each version again off the path, plain and context-coded (the share "
                        "columns)")
    p.add_argument("--bound", action="store_true",
                   help="no link and no root: the compression ratio each target needs with no time at either "
                        "end, beside the codecs' and the context model's information bound (refit_bound.json)")
    p.add_argument("--json", default=None, help="write the results here (benchmarks/results/refit.json)")


def _refit(args: argparse.Namespace) -> int:
    if args.bound:
        from nemo_dcr_callback.bench import refit_bound  # start-up cost: only when this benchmark runs

        refit_bound.run(args.params, tuple(float(x) for x in args.rates.split(",")), json_path=args.json)
        return 0
    from nemo_dcr_callback.bench import refit  # start-up cost: only when this benchmark runs

    deltas = tuple(args.deltas.split(","))
    if not deltas or any(k not in refit.DELTAS for k in deltas):
        raise ValueError(f"--deltas: kinds are {', '.join(refit.DELTAS)}")
    refit.run(args.params, args.mbit, tuple(float(x) for x in args.rates.split(",")), args.part_bytes,
              json_path=args.json, apply=args.apply, repeats=args.repeats, deltas=deltas,
              context_share=not args.no_context_share, context=args.context, link_hint=not args.no_link_hint,
              encode_threads=args.encode_threads)
    return 0


# ------------------------------------------------------------------------ vllm
def _vllm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default="0.01,0.03,0.05", help="change rates of the versions, in order")
    p.add_argument("--hidden", type=positive, default=1024)
    p.add_argument("--layers", type=positive, default=8)
    p.add_argument("--vocab", type=positive, default=32000)
    p.add_argument("--backend", action="store_true",
                   help="through vLLM's weight-transfer API with backend dcr: bytes sent and the engine's pause "
                        "against a dense load_weights (benchmarks/results/vllm_backend.json)")
    p.add_argument("--deltas", choices=["ulp", "adamw"], default="ulp",
                   help="with --backend: versions of uniform one-ulp changes, or Adam-like steps of fp32 masters")
    p.add_argument("--context", choices=["auto", "on", "off"], default="auto", help="with --backend: dcr.context")
    p.add_argument("--inflight", type=positive, default=None, metavar="N",
                   help="a `vllm serve` updated while N requests stream from it: pause vs apply, tokens/s around "
                        "each update, versions per request (benchmarks/results/vllm_inflight.json)")
    p.add_argument("--versions", type=positive, default=4, help="with --inflight: updates")
    p.add_argument("--max-tokens", type=positive, default=128, help="with --inflight: tokens per request")
    p.add_argument("--pause-mode", choices=["keep", "wait", "abort"], default="keep", help="with --inflight")
    p.add_argument("--keep-kv", action="store_true",
                   help="with --inflight: running requests keep their KV of the old weights (recompute_kv=False)")
    p.add_argument("--json", default=None, help="write the results here (benchmarks/results/vllm.json)")


def _vllm(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("vLLM is not installed here: run it in .venv-vllm (make test-vllm builds it)")
    from nemo_dcr_callback.bench import vllm  # start-up cost: only when this benchmark runs

    rates = tuple(float(x) for x in args.rates.split(","))
    if args.inflight:
        from nemo_dcr_callback.bench import inflight  # start-up cost: only when this benchmark runs

        inflight.run(args.inflight, args.versions, rates[1 if len(rates) > 1 else 0], args.hidden, args.layers,
                     args.vocab, args.max_tokens, args.pause_mode, json_path=args.json, recompute_kv=not args.keep_kv)
    elif args.backend:
        vllm.run_backend(rates, args.hidden, args.layers, args.vocab, args.json, deltas=args.deltas,
                         context=args.context)
    else:
        vllm.run(rates, args.hidden, args.layers, args.vocab, args.json)
    return 0


# -------------------------------------------------------------- trainer-memory
def _trainer_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=positive, default=1024)
    p.add_argument("--layers", type=positive, default=12)
    p.add_argument("--vocab", type=positive, default=32000)
    p.add_argument("--versions", type=positive, default=2)
    p.add_argument("--json", default=None, help="write the results here (benchmarks/results/trainer_memory.json)")


def _trainer_memory(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("vLLM is not installed here: run it in .venv-vllm (make test-vllm builds it)")
    from nemo_dcr_callback.bench import trainer_memory  # start-up cost: only when this benchmark runs

    trainer_memory.run(args.hidden, args.layers, args.vocab, args.versions, json_path=args.json)
    return 0


# ------------------------------------------------------------------------- fp8
def _fp8_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default="0.01,0.03,0.05", help="BF16 change rates, comma-separated")
    p.add_argument("--repeats", type=positive, default=3, help="applies timed per pair (median)")
    p.add_argument("--synthetic-only", action="store_true", help="skip the real-gradient pairs (a transformers Llama)")
    p.add_argument("--json", default=None, help="write the results here (benchmarks/results/fp8.json)")


def _fp8(args: argparse.Namespace) -> int:
    from nemo_dcr_callback.bench import fp8  # start-up cost: only when this benchmark runs

    fp8.run(tuple(float(x) for x in args.rates.split(",")), args.repeats, real=not args.synthetic_only,
            json_path=args.json)
    return 0


# --------------------------------------------------------------------- receive
def _receive_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=positive, default=1 << 25, help="synthetic BF16 parameters (default 32M)")
    p.add_argument("--rate", type=float, default=0.03, help="change rate")
    p.add_argument("--versions", type=positive, default=5)
    p.add_argument("--rounds", type=positive, default=3, help="each kind of receiver applies the chain this often")
    p.add_argument("--kinds", default="state-dict,loader,loader-dense,checkpoint-dir",
                   help="receivers to compare, comma-separated")
    p.add_argument("--json", default=None, help="write the results here (benchmarks/results/receive.json)")


def _receive(args: argparse.Namespace) -> int:
    from nemo_dcr_callback.bench import receive  # start-up cost: only when this benchmark runs

    receive.run(args.params, args.rate, args.versions, args.rounds, tuple(args.kinds.split(",")),
                json_path=args.json)
    return 0


# ----------------------------------------------------------------------- relay
def _relay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=positive, default=1 << 27, help="synthetic BF16 parameters (default 128M)")
    p.add_argument("--mbit", type=float, default=100.0, help="inter-region link rate each way, Mbit/s")
    p.add_argument("--rate", type=float, default=0.03, help="change rate")
    p.add_argument("--receivers", type=positive, default=4, help="receivers per region")
    p.add_argument("--scenarios", default="dense-s3,dcr-s3,dcr-relay,dcr-relay-1,loopback",
                   help="which to run, comma-separated (the 1.3x ratio needs dcr-relay and dcr-relay-1; "
                        "loopback: one relay's serving rate)")
    p.add_argument("--versions", type=positive, default=5, help="versions per DCR scenario (the first, on cold "
                   "connections, is the slowest; the table gives medians)")
    p.add_argument("--apply", choices=["early", "sealed", "late"], default="sealed",
                   help="receivers apply the parts held once the version is sealed, before acking (sealed, the "
                        "default, as in bench refit), after the commit (late), or as parts arrive (early)")
    p.add_argument("--rounds", type=positive, default=1,
                   help="run the DCR scenarios this many times, in turn (medians over every round's versions; "
                        "the host drifts between scenarios)")
    p.add_argument("--json", default=None, help="write the results here (benchmarks/results/relay.json)")
    p.add_argument("--access-logs", default=None, metavar="DIR",
                   help="every relay writes its access log here (SCENARIO-RELAY.jsonl), to trace a failed run")


def _relay(args: argparse.Namespace) -> int:
    from nemo_dcr_callback.bench import relay  # start-up cost: only when this benchmark runs

    relay.run(args.params, args.mbit, args.rate, args.receivers, args.versions, json_path=args.json,
              scenarios=args.scenarios.split(","), apply=args.apply, rounds=args.rounds,
              access_logs=args.access_logs)
    return 0


# ------------------------------------------------------------------------ cuda
def _cuda_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mib", default="256,1024", help="timed input sizes in MiB, comma-separated")
    p.add_argument("--rates", default="0.01,0.03,0.05", help="change rates, comma-separated")
    p.add_argument("--reps", type=positive, default=10, help="timed repetitions (median)")
    p.add_argument("--json", default=None, help="results file (default: $OUT/cuda.json or benchmarks/results/)")
    p.add_argument("--skip-check", action="store_true", help="timings only")


def _cuda(args: argparse.Namespace) -> int:
    from nemo_dcr_callback.bench import cuda  # start-up cost: only when this benchmark runs

    return cuda.run([int(x) for x in args.sizes_mib.split(",") if x], [float(x) for x in args.rates.split(",") if x],
                    args.reps, args.json, check=not args.skip_check)


# ------------------------------------------------------------------------- e2e
def _e2e_arguments(p: argparse.ArgumentParser) -> None:
    from nemo_dcr_callback.bench.e2e import MODELS  # (a table of dicts: no torch)

    p.add_argument("--model", choices=sorted(MODELS), default="1b", help="1b on a GPU; tiny: the CPU dry run")
    p.add_argument("--steps", type=positive, default=10, help="training steps per run (three runs)")
    p.add_argument("--workdir", default=None, help="stores and logs (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each run may take")
    p.add_argument("--json", default=None, help="results file")


def _e2e(args: argparse.Namespace) -> int:
    from nemo_dcr_callback.bench import e2e  # start-up cost: only when this benchmark runs

    res = e2e.run(args.model, args.steps, args.json, args.workdir, args.timeout)
    return 0 if res["met"]["bit_exact"] else 1


# -------------------------------------------------------------------- headline
def _headline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", default="benchmarks/results", help="the folder of result files")
    p.add_argument("--markdown", action="store_true", help="the table docs/PERFORMANCE.md carries")
    p.add_argument("--json", default=None, help="write the results here (benchmarks/results/headline.json)")


def _headline(args: argparse.Namespace) -> int:
    from nemo_dcr_callback.bench import headline  # start-up cost: only when this command runs

    headline.run(Path(args.results), json_path=args.json, md=args.markdown)
    return 0


COMMAND = Command("bench", "benchmarks", dest="bench", subcommands=(
    Command("codec", "codec ratio and speed vs simple schemes and the bound", _codec, _codec_arguments),
    Command("placement", "map building and projection speed (launches torchrun)", _placement,
            _placement_arguments),
    Command("overhead", "training-step time with and without the callback (torchrun)", _overhead,
            _overhead_arguments),
    Command("refit", "end-to-end refit over a tbf-shaped link: dense vs DCR via S3 (root)", _refit,
            _refit_arguments),
    Command("receive", "a receiver's apply per version: state dict, the model's loader, a checkpoint dir", _receive,
            _receive_arguments),
    Command("vllm", "a vLLM engine refitted: DCR vs dense load_weights vs vLLM's own patches (in .venv-vllm)",
            _vllm, _vllm_arguments),
    Command("trainer-memory", "each trainer rank's peak memory with the dcr trainer engine (FSDP2, torchrun; "
            "in .venv-vllm)", _trainer_memory, _trainer_memory_arguments),
    Command("fp8", "block-FP8 receivers: blocks and bytes changed, shipped vs dense FP8, apply vs dense requantize",
            _fp8, _fp8_arguments),
    Command("relay", "fan-out to 2 regions x 4 receivers: dense/DCR via S3 vs relay tree (root)", _relay,
            _relay_arguments),
    Command("cuda", "CUDA kernels: check vs the CPU reference, time vs a device copy (GPU)", _cuda, _cuda_arguments),
    Command("headline", "the quoted figures: each the median of its runs, with spread, files, date, machine",
            _headline, _headline_arguments),
    Command("e2e", "a training step publishing and a receiver applying on one device (GPU; CPU: dry run)", _e2e,
            _e2e_arguments),
))
