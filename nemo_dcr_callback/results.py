"""Benchmark results (benchmarks/results/*.json): written the same way by every benchmark,
read back by the planner."""

from __future__ import annotations

import json
import os
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def machine() -> dict:
    """Where a benchmark ran, recorded beside its figures (the host's speed drifts; compare
    runs only side by side): CPU model, cores, GPU (or none), Python, torch, compiled kernels."""
    import platform

    import torch

    from nemo_dcr_callback import kernels

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "native_kernels": kernels.native() is not None}


def write_json(path: str | os.PathLike, obj, quiet: bool = False) -> None:
    """Write obj as indented JSON, creating the directory; say where unless quiet."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2) + "\n")
    if not quiet:
        print(f"wrote {p}")
