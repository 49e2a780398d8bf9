"""The `nemo-dcr` command: builds its parser from the command registry (commands/) and
dispatches to the command chosen.

  nemo-dcr diff OLD NEW -o DELTA      delta between two safetensors checkpoints
  nemo-dcr patch BASE DELTA -o OUT    rebuild NEW from BASE (all or nothing)
  nemo-dcr stats DELTA [--json]       size, change rate, information bound
  nemo-dcr bench codec [...]          codec benchmark (table + JSON)
  nemo-dcr demo                       the main job: CPU training publishing to a following receiver
  nemo-dcr demo --rl                  the asynchronous RL loop: GRPO trainer + a vLLM rollout engine
  nemo-dcr bench cuda [...]           CUDA kernels vs the CPU reference, timed vs a copy (GPU)
  nemo-dcr build-kernels [--cuda]     compile the CPU kernels (and the CUDA ones with nvcc)
  nemo-dcr doctor                     which kernel paths are active, and why
  nemo-dcr relay --parent URL         a relay node of the fan-out tree
  nemo-dcr plan --params 1e12 ...     predict a refit's time (--validate, --scenarios)
  nemo-dcr receive --store URL ...    a receiver following a store or relay
"""

from __future__ import annotations

import argparse
import sys

from nemo_dcr_callback.commands import COMMANDS, add_commands
from nemo_dcr_callback.commands.dev import VersionAction
from nemo_dcr_callback.protocol.store import redact


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every registered command and its options."""
    p = argparse.ArgumentParser(prog="nemo-dcr", description="Delta-compressed refit for RL policies.")
    p.add_argument("--version", action=VersionAction)
    add_commands(p.add_subparsers(dest="cmd", required=True), COMMANDS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status (2 on an error it reports)."""
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    # (the package's own errors, DeltaError, ChunkError, CheckpointError, RecordError, are
    # ValueErrors: caught here without importing their modules, which load torch for every
    # command, plan and relay included)
    except (FileExistsError, ValueError) as exc:
        print(f"nemo-dcr {args.cmd}: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        print(f"nemo-dcr {args.cmd}: error: {redact(str(exc.strerror or exc))}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
