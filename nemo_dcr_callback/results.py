"""Benchmark results (benchmarks/results/*.json): written the same way by every benchmark,
read back by the planner."""

from __future__ import annotations

import json
import os
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def write_json(path: str | os.PathLike, obj, quiet: bool = False) -> None:
    """Write obj as indented JSON, creating the directory; say where unless quiet."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2) + "\n")
    if not quiet:
        print(f"wrote {p}")
