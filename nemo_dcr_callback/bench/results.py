"""Benchmark results (benchmarks/results/*.json): written the same way by every benchmark,
read back by the planner."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Benchmarks run from a source checkout and write into its benchmarks/results/.
RESULTS = Path("benchmarks") / "results"


def machine() -> dict:
    """Where a benchmark ran, recorded beside its figures (the host's speed drifts; compare
    runs only side by side): CPU model, its vector extensions, cores, GPU (or none), Python,
    torch, compiled kernels, and the date (UTC)."""
    import datetime
    import platform

    import torch

    from nemo_dcr_callback.core import kernels

    cpu, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    # the kernels' speed follows these more than the model name (two "AMD EPYC" VMs here differ)
    simd = [f for f in ("avx2", "avx512f", "avx512bw", "avx512vbmi2", "amx_tile") if f in flags]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "simd": simd, "cores": os.cpu_count(), "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "native_kernels": kernels.native() is not None,
            "free_page_reporting": free_page_reporting(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")}


def free_page_reporting() -> bool | None:
    """Whether this (virtual) machine hands its free memory back to the hypervisor (virtio-balloon
    free page reporting). Where it does, every page the guest touches for the first time after
    it was freed costs a fault on the host too: new file data in the page cache, fresh buffers.
    Writing 300 KB into a new file took 0.37-0.40 ms of CPU here against 0.06-0.08 overwriting
    resident pages (2026-12-02), so it weighs on every figure that writes or allocates."""
    try:
        return int(Path("/sys/module/page_reporting/parameters/reported_kib").read_text()) > 0
    except (OSError, ValueError):
        return None


def write_json(path: str | os.PathLike, obj, quiet: bool = False) -> None:
    """Write obj as indented JSON, creating the directory; say where unless quiet."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2) + "\n")
    if not quiet:
        print(f"wrote {p}")
