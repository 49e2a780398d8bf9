"""The `nemo-dcr` command as users run it: a real process of this environment's entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXE = str(Path(sys.executable).parent / "nemo-dcr")  # this environment's entry point
CLI = [EXE]


def run(*args, ok=True):
    """Run `nemo-dcr ARGS`; with ok, its failure raises with its stderr."""
    p = subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True)
    if ok and p.returncode != 0:
        raise AssertionError(p.stderr)
    return p
