"""File commands: diff two checkpoints, patch a checkpoint with a delta, describe a delta."""

from __future__ import annotations

import argparse
import json

from nemo_dcr_callback.commands.base import Command, positive


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def print_stats(st: dict) -> None:
    """A delta file's stats (tools.deltafile.stats) as a table."""
    print(f"tensors            {st['tensors']} ({st['full_tensors']} sent whole, {st['removed_tensors']} removed)")
    print(f"params             {st['params']:,}")
    print(f"changed            {st['changed']:,} ({st['change_rate']:.3%} of delta-coded params)")
    print(f"delta size         {_human(st['bytes'])} (payload {_human(st['payload_bytes'])})")
    print(f"dense size         {_human(st['dense_bytes'])}")
    print(f"bits per param     {st['bits_per_param']:.4f}")
    print(f"ratio vs dense     {st['ratio_vs_dense']:.1f}x")
    print(f"bound (xor)        {_human(st['xor_bound_bytes'])}  efficiency {st['efficiency_vs_xor_bound']:.3f} "
          f"(payload), {st['efficiency_whole_vs_xor_bound']:.3f} (whole file)")
    print(f"bound (ulp)        {_human(st['ulp_bound_bytes'])}  efficiency {st['efficiency_vs_ulp_bound']:.3f} "
          f"(payload), {st['efficiency_whole_vs_ulp_bound']:.3f} (whole file)")
    print(f"beyond the payload {_human(st['non_payload_bytes'])} (manifest, file header and footer)")


# ------------------------------------------------------------------------ diff
def _diff_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("old", help="a .safetensors file or a Hugging Face checkpoint directory")
    p.add_argument("new", help="the same kind of checkpoint, after training")
    p.add_argument("-o", "--output", required=True, help="delta file to write")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists (never one of the inputs)")
    p.add_argument("--chunk-span", type=positive, default=None, help="positions per chunk (default 2^24)")
    p.add_argument("--level", type=int, default=1, help="zstd level for zstd-coded streams (default 1)")
    p.add_argument("--sign-key-env", default=None, metavar="VAR",
                   help="sign the delta (HMAC-SHA256) with the key in this environment variable")
    p.add_argument("--no-context", action="store_true",
                   help="plain coding only: never the context-modelled one (its decoder reads BASE's bits)")
    p.add_argument("-q", "--quiet", action="store_true")


def _diff(args: argparse.Namespace) -> int:
    # start-up cost: loads torch (~1 s), only when this command runs
    from nemo_dcr_callback.codec import DEFAULT_CHUNK_SPAN
    from nemo_dcr_callback.tools.deltafile import diff, signing_key, stats

    key = signing_key(args.sign_key_env) if args.sign_key_env else None
    diff(args.old, args.new, args.output, span=args.chunk_span or DEFAULT_CHUNK_SPAN, level=args.level,
         force=args.force, quiet=args.quiet, key=key, context=not args.no_context)
    if not args.quiet:
        print_stats(stats(args.output))
    return 0


# ----------------------------------------------------------------------- patch
def _patch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base")
    p.add_argument("delta")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--verify-key-env", default=None, metavar="VAR",
                   help="take only a delta signed with the key in this environment variable")
    p.add_argument("-q", "--quiet", action="store_true")


def _patch(args: argparse.Namespace) -> int:
    # start-up cost: loads torch (~1 s), only when this command runs
    from nemo_dcr_callback.tools.delta_patch import patch
    from nemo_dcr_callback.tools.deltafile import signing_key

    key = signing_key(args.verify_key_env) if args.verify_key_env else None
    patch(args.base, args.delta, args.output, force=args.force, quiet=args.quiet, key=key)
    if not args.quiet:
        print(f"wrote {args.output} (every tensor digest verified{', signature verified' if key else ''})")
    return 0


# -------------------------------------------------------------------- fp8-init
def _fp8_init_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bf16", help="the BF16 checkpoint the receiver starts from (a file or a directory)")
    p.add_argument("-o", "--output", required=True, help="the FP8 checkpoint directory to write (new or empty)")
    p.add_argument("--recipe", default="vllm", help="the serving engine's per-block cast: vllm (default), ue8m0, "
                                                    "deepgemm-v1 (core/fp8.py)")
    p.add_argument("--version", type=int, default=0, help="the version the BF16 checkpoint is")


def _fp8_init(args: argparse.Namespace) -> int:
    # start-up cost: loads torch (~1 s), only when this command runs
    from nemo_dcr_callback.receiver.targets.fp8_dir import convert

    info = convert(args.bf16, args.output, recipe=args.recipe, version=args.version)
    print(f"wrote {args.output}: {info['quantized']} weights in block FP8 ({info['params']:,} parameters, "
          f"recipe {args.recipe}), BF16 shadow in .nemo-dcr/, version {args.version}")
    return 0


# ----------------------------------------------------------------------- stats
def _stats_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("delta")
    p.add_argument("--json", action="store_true", help="print JSON")


def _stats(args: argparse.Namespace) -> int:
    # start-up cost: loads torch (~1 s), only when this command runs
    from nemo_dcr_callback.tools.deltafile import stats

    st = stats(args.delta)
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print_stats(st)
    return 0


COMMANDS = (
    Command("diff", "write the delta between two checkpoints", _diff, _diff_arguments),
    Command("patch", "apply a delta to BASE, writing OUT (BASE is never modified)", _patch, _patch_arguments),
    Command("stats", "describe a delta file", _stats, _stats_arguments),
    Command("fp8-init", "make a block-FP8 checkpoint directory (with its BF16 shadow) that receive --fp8-dir follows",
            _fp8_init, _fp8_init_arguments),
)
