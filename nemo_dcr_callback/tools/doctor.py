"""`nemo-dcr doctor`, `nemo-dcr build-kernels` and `--version`: which native kernels this install runs.

The libraries are compiled when the package is built (setup.py, docs/BUILD.md) and ship in
nemo_dcr_callback/_lib/; doctor says whether they load, how they were compiled (BUILD.json)
and which SIMD path the CPU kernels take. build-kernels recompiles them in a source checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import nemo_dcr_callback
from nemo_dcr_callback import __version__
from nemo_dcr_callback.core import kernels

TORCH_FALLBACK = "torch fallback"


def build_script() -> Path | None:
    """cuda_ext/build.py of the source checkout this package is imported from; None for an
    installed wheel (its kernels were compiled when it was built)."""
    path = Path(nemo_dcr_callback.__file__).resolve().parent.parent / "cuda_ext" / "build.py"
    return path if path.is_file() else None


def _build_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("nemo_dcr_cuda_ext_build", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def active_path() -> str:
    """"AVX-512", "AVX2", "portable", or "torch fallback" (no library, or NEMO_DCR_NATIVE=0)."""
    if os.environ.get("NEMO_DCR_NATIVE", "1") == "0":
        return TORCH_FALLBACK
    lib, _ = kernels.load_state()
    return (kernels.simd_path(lib) or "portable") if lib is not None else TORCH_FALLBACK


def _cpu_report() -> dict:
    path = kernels.library_path()
    lib, error = kernels.load_state()
    return {"library": str(path), "from_env": bool(os.environ.get("NEMO_DCR_CPU_LIB")), "exists": path.exists(),
            "loaded": lib is not None, "error": error, "build": kernels.build_info(path).get("cpu", {})}


def _cuda_report(gpu: bool) -> dict:
    from nemo_dcr_callback.core import cuda_kernels  # start-up cost: loads torch; doctor is on the CLI's path

    path = cuda_kernels.library_path()
    out = {"library": str(path), "from_env": bool(os.environ.get("NEMO_DCR_CUDA_LIB")), "present": path.exists(),
           "loaded": False, "error": None, "build": cuda_kernels.build_info()}
    if not path.exists():
        out["error"] = f"{path} does not exist"
        return out
    try:  # loading makes no CUDA call, so this checks the library on a machine without a GPU too
        lib = cuda_kernels.library() if gpu else cuda_kernels.load(path)
        out["loaded"] = lib is not None
    except (OSError, RuntimeError, AttributeError) as exc:
        out["error"] = str(exc)
    return out


def report() -> dict:
    """What this install runs: versions, the CPU and CUDA libraries, the active CPU path, the GPU."""
    import torch  # start-up cost: this module is on every CLI call's path (the parser)

    gpu = torch.cuda.is_available()
    script = build_script()
    return {
        "version": __version__,
        "package": str(Path(nemo_dcr_callback.__file__).resolve().parent),
        "source_checkout": str(script.parent.parent) if script else None,
        "cpu": _cpu_report(),
        "active_path": active_path(),
        "native_disabled": os.environ.get("NEMO_DCR_NATIVE", "1") == "0",
        "cuda": _cuda_report(gpu),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": gpu,
        "gpu_name": torch.cuda.get_device_name(0) if gpu else None,
    }


def _build_line(b: dict) -> str:
    if not b:
        return "no BUILD.json beside it"
    what = " ".join(b.get("flags") or b.get("gencode") or [])
    extra = {"native": " (for the machine that built it)", "portable": " (portable: NEMO_DCR_PORTABLE=1)",
             "NEMO_DCR_CXXFLAGS": " (from NEMO_DCR_CXXFLAGS)"}.get(b.get("flags_from"), "")
    defines = f", defines {' '.join(b['defines'])}" if b.get("defines") else ""
    return f"{b.get('compiler_version') or b.get('compiler', '?')}: {what}{extra}{defines}; " \
           f"source sha256 {b.get('source_sha256', '?')[:16]}"


def render(rep: dict) -> str:
    """The report as text, one fact a line."""
    cpu, cuda = rep["cpu"], rep["cuda"]
    lines = [f"nemo-dcr {rep['version']} ({rep['package']})"]
    if rep["source_checkout"]:
        lines.append(f"  source checkout: {rep['source_checkout']} (nemo-dcr build-kernels recompiles)")
    state = "loaded" if cpu["loaded"] else f"NOT loaded: {cpu['error']}"
    lines += [f"CPU kernels:  {cpu['library']}{' ($NEMO_DCR_CPU_LIB)' if cpu['from_env'] else ''}",
              f"  {state}",
              f"  built with {_build_line(cpu['build'])}" if cpu["exists"] else "  not built",
              f"  active path: {rep['active_path']}"
              + (" (NEMO_DCR_NATIVE=0)" if rep["native_disabled"] else "")]
    if rep["active_path"] == TORCH_FALLBACK and not rep["native_disabled"]:
        lines.append("  the pure-torch reference runs instead: much slower. Fix: reinstall with g++ on PATH, "
                     "or `nemo-dcr build-kernels` in a source checkout")
    if cuda["loaded"]:
        state = "loaded" if rep["gpu"] else "loads (unused here: torch sees no GPU)"
    else:
        state = "absent" if not cuda["present"] else f"NOT loaded: {cuda['error']}"
    lines += [f"CUDA kernels: {cuda['library']}{' ($NEMO_DCR_CUDA_LIB)' if cuda['from_env'] else ''}",
              f"  {state}" + ("" if cuda["present"] else " (built only where nvcc is found; only CUDA shards need it)")]
    if cuda["present"]:
        lines.append(f"  built with {_build_line(cuda['build'])}")
    gpu = f"yes, {rep['gpu_name']}" if rep["gpu"] else "no"
    lines.append(f"torch {rep['torch']} (CUDA {rep['torch_cuda'] or 'none'}); GPU visible: {gpu}")
    return "\n".join(lines)


def version_text() -> str:
    """One line for --version: the package version and the active CPU path."""
    return f"nemo-dcr {__version__} (CPU kernels: {active_path()})"


# ------------------------------------------------------------------ CLI pieces (wired by cli.py)
def add_doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run_doctor(args: argparse.Namespace) -> int:
    rep = report()
    print(json.dumps(rep, indent=2) if args.json else render(rep))
    return 0


def add_build_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cuda", action="store_true", help="also build the CUDA kernels (nvcc; no GPU needed)")
    p.add_argument("--defines", default=None,
                   help='the CUDA kernels\' tuning knobs (with --cuda), for example "DCR_BLOCK=128 DCR_FENCE=2" '
                        'or --defines=-DDCR_BLOCK=128')
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default {kernels.LIB_DIR})")


def run_build(args: argparse.Namespace) -> int:
    """Recompile the kernels in a source checkout; from a wheel, say they came with it."""
    script = build_script()
    if script is None:
        print("nemo-dcr build-kernels: this package is an installed build: its kernels were compiled when it "
              "was built, and it carries no sources to rebuild them. To rebuild, reinstall it (pip install "
              "--force-reinstall --no-deps ...) with g++ (and nvcc for CUDA) on PATH, or install a source "
              "checkout with pip install -e.\n")
        print(render(report()))
        return 0 if kernels.load_state()[0] is not None else 2
    if args.defines and not args.cuda:
        print("nemo-dcr build-kernels: error: --defines tunes the CUDA kernels; add --cuda", file=sys.stderr)
        return 2
    argv = ["--out", str(args.out or kernels.LIB_DIR)]
    if args.cuda:
        argv.append("--cuda")
    if args.defines is not None:
        argv += ["--defines", args.defines]
    rc = _build_module(script).main(argv)
    if rc == 0 and args.out is None:
        print(version_text())
    return rc
