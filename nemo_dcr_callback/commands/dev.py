"""Developer commands: the demo, building the compiled kernels, and the doctor.

build-kernels, doctor and --version come from tools.doctor, imported only when used (and
tolerated missing when the parser is built, so every other command works without it).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from types import ModuleType

from nemo_dcr_callback import __version__
from nemo_dcr_callback.commands.base import Command, positive

_DOCTOR = "nemo_dcr_callback.tools.doctor"


def _doctor_module(required: bool = True) -> ModuleType | None:
    """tools.doctor; None (or, if required, a ValueError the CLI reports) where it is missing."""
    try:
        from nemo_dcr_callback.tools import doctor  # in a try: an install without it runs every other command
    except ModuleNotFoundError as exc:
        if exc.name != _DOCTOR:
            raise
        if required:
            raise ValueError(f"{_DOCTOR} is missing from this installation") from None
        return None
    return doctor


def version_text() -> str:
    """What `nemo-dcr --version` prints."""
    doctor = _doctor_module(required=False)
    if doctor is None:
        return f"nemo-dcr {__version__}"
    return doctor.version_text()


class VersionAction(argparse.Action):
    """`--version`: print version_text() and exit. argparse's own "version" action wants the
    text when the parser is built, which would import tools.doctor for every command."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="show program's version number and exit"):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


# ------------------------------------------------------------------------ demo
def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=positive, default=10)
    p.add_argument("--tp", type=positive, default=2)
    p.add_argument("--pp", type=positive, default=2)
    p.add_argument("--workdir", default=None, help="run directory (default: runs/demo-<time>)")
    p.add_argument("--files", action="store_true", help="instead: diff/patch round trip on a synthetic policy")
    p.add_argument("--params", type=positive, default=1 << 24, help="with --files")
    p.add_argument("--change-rate", type=float, default=0.03, help="with --files")
    p.add_argument("--rl", action="store_true",
                   help="instead: the asynchronous RL loop (GRPO trainer + a vLLM rollout engine; needs vLLM)")
    p.add_argument("--kill-at", type=int, default=0, help="with --rl: kill the rollout engine after this step "
                   "and start it again")
    p.add_argument("--max-staleness", type=int, default=1, help="with --rl: consume rollouts at most this many "
                   "versions old")
    p.add_argument("--task", default="search", help="with --rl: search (multi-turn, with feedback) | first | max | sum")
    p.add_argument("--arms", default="main,lr0,seed2", help="with --rl: the runs, one after the other: main, lr0 "
                   "(learning rate 0), seed2 (another seed), stale (max staleness 2, the worker further ahead)")
    p.add_argument("--control-steps", type=positive, default=12, help="with --rl: steps of the lr0 and stale arms")
    p.add_argument("--json", default=None, help="with --rl: write the measurements here")


def _demo(args: argparse.Namespace) -> int:
    # recipes/ is not product code: imported here, when the demo runs, never at module level
    if args.rl:  # (both sides run in child processes: this one need not import vLLM, seconds)
        if importlib.util.find_spec("vllm") is None:
            print("nemo-dcr demo --rl needs vLLM: run it with `make demo-rl` (which builds .venv-vllm)",
                  file=sys.stderr)
            return 2
        from nemo_dcr_callback.recipes import rl_demo  # start-up cost: only when the demo runs
        from nemo_dcr_callback.recipes.rl_task import TASKS

        arms = tuple(a for a in args.arms.split(",") if a)
        bad = [a for a in arms if a not in ("main", "lr0", "seed2", "stale")] + (
            [] if args.task in TASKS else [f"--task {args.task}"])
        if bad or not arms:
            print(f"nemo-dcr demo --rl: unknown {bad or 'arms: none given'}", file=sys.stderr)
            return 2
        out = rl_demo.run_arms(args.steps, args.control_steps, args.workdir, kill_at=args.kill_at, task=args.task,
                               max_staleness=args.max_staleness, arms=arms, json_path=args.json)
        return 0 if all(a["versions_checked"] for a in out["arms"].values()) else 1
    if args.files:
        from nemo_dcr_callback.recipes.demo import run_demo  # start-up cost: only when the demo runs
        return run_demo(args.params, args.change_rate, min(args.steps, 3), args.workdir)
    from nemo_dcr_callback.recipes.demo import run_training_demo  # start-up cost: only when the demo runs
    return run_training_demo(args.steps, args.tp, args.pp, args.workdir)


# ------------------------------------------------------- build-kernels, doctor
def _build_arguments(p: argparse.ArgumentParser) -> None:
    doctor = _doctor_module(required=False)
    if doctor is not None:
        doctor.add_build_arguments(p)


def _build(args: argparse.Namespace) -> int:
    return _doctor_module().run_build(args)


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    doctor = _doctor_module(required=False)
    if doctor is not None:
        doctor.add_doctor_arguments(p)


def _doctor(args: argparse.Namespace) -> int:
    return _doctor_module().run_doctor(args)


COMMANDS = (
    Command("demo", "the main job: 4-rank CPU training publishing to a following receiver", _demo, _demo_arguments),
    Command("build-kernels", "compile the CPU kernels (done by make setup)", _build, _build_arguments),
    Command("doctor", "which kernel paths are active: AVX-512, AVX2, portable, torch fallback, CUDA",
            _doctor, _doctor_arguments),
)
