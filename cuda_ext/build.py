"""Compile the native kernels: the CPU library (cpu/dcr_cpu.cpp) and the CUDA library (cuda/dcr_cuda.cu).

Standard library only: setup.py imports this file by path at package build time, and it runs
on its own in a source checkout (the CUDA tuning script builds its variants this way):

    python cuda_ext/build.py [--cuda | --cuda-if-found] [--no-cpu] [--defines "-DDCR_BLOCK=128"] [--out DIR]

Both libraries have a plain C ABI and are loaded through ctypes, so they need neither Python
nor torch headers. Each lands under its fixed name (libdcr_cpu.so, libdcr_cuda.so) through a
temporary file and a rename: a process loading it never sees half a library. BUILD.json beside
them records the compilers, flags and source hashes (`nemo-dcr doctor` shows them).

Environment:
  CXX                    the C++ compiler (else g++, else c++ on PATH)
  NVCC, CUDA_HOME        where nvcc is (else PATH, else /usr/local/cuda/bin)
  NEMO_DCR_CXXFLAGS      the CPU library's optimisation flags, replacing the defaults below
  NEMO_DCR_PORTABLE=1    -O3 without -march=native: for a wheel that other machines install
  NEMO_DCR_CUDA_DEFINES  default for --defines: the CUDA kernels' -DDCR_<KNOB>=<value> tuning knobs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
CPU_SOURCE = HERE / "cpu" / "dcr_cpu.cpp"
CPU_PARTS = HERE / "cpu" / "parts"  # the stages CPU_SOURCE includes (one translation unit)
CUDA_SOURCE = HERE / "cuda" / "dcr_cuda.cu"
CUDA_EMU_HEADER = HERE / "cuda" / "cuda_emu.h"
CPU_LIB = "libdcr_cpu.so"
CUDA_LIB = "libdcr_cuda.so"
BUILD_INFO = "BUILD.json"
# The installed package's library folder, when this file sits in a source checkout.
PACKAGE_LIB_DIR = HERE.parent / "nemo_dcr_callback" / "_lib"
# -march=native is what the kernels were measured with; the AVX2 and AVX-512 hot paths are
# also chosen at run time (target attributes), so a portable -O3 build keeps most of the speed.
NATIVE_FLAGS = ("-O3", "-march=native")
PORTABLE_FLAGS = ("-O3",)
CPU_FIXED_FLAGS = ("-std=c++17", "-fPIC", "-shared", "-pthread")
# SASS for A100 (sm_80) and H100/H200 (sm_90), PTX for newer chips (the driver JITs it).
GENCODE = ("arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90", "arch=compute_90,code=compute_90")


class BuildError(RuntimeError):
    """A compiler is missing or a compile failed; the message says which and why."""


# ------------------------------------------------------------------ finding compilers and flags
def find_cxx() -> str | None:
    """The C++ compiler: $CXX, else g++ or c++ on PATH; None if there is none."""
    env = os.environ.get("CXX")
    if env:
        return shutil.which(env) or (env if os.path.isfile(env) and os.access(env, os.X_OK) else None)
    return shutil.which("g++") or shutil.which("c++")


def find_nvcc() -> str | None:
    """nvcc from $NVCC, PATH, $CUDA_HOME/bin or /usr/local/cuda/bin; None if there is none."""
    cands = [os.environ.get("NVCC"), shutil.which("nvcc")]
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    cands.append("/usr/local/cuda/bin/nvcc")
    for cand in cands:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def cpu_flags(env: dict | None = None) -> tuple[list[str], str]:
    """The CPU library's optimisation flags and where they came from: NEMO_DCR_CXXFLAGS,
    "portable" (NEMO_DCR_PORTABLE=1) or "native"."""
    env = os.environ if env is None else env
    if env.get("NEMO_DCR_CXXFLAGS"):
        return env["NEMO_DCR_CXXFLAGS"].split(), "NEMO_DCR_CXXFLAGS"
    if env.get("NEMO_DCR_PORTABLE", "0") not in ("", "0"):
        return list(PORTABLE_FLAGS), "portable"
    return list(NATIVE_FLAGS), "native"


def check_defines(defines: str | Sequence[str] | None) -> list[str]:
    """Tuning knobs as a list; only -DDCR_<KNOB>[=<value>] flags (or DCR_<KNOB>[=<value>]) are
    taken, so they cannot change the build in any other way."""
    flags = defines.split() if isinstance(defines, str) else list(defines or [])
    flags = [f"-D{f}" if f.startswith("DCR_") else f for f in flags]  # "DCR_BLOCK=128" reads as -DDCR_BLOCK=128
    bad = [f for f in flags if not f.startswith("-DDCR_")]
    if bad:
        raise BuildError(f"tuning defines take -DDCR_<KNOB>=<value> flags only, not {bad}")
    return flags


def env_defines() -> list[str]:
    """The tuning knobs from $NEMO_DCR_CUDA_DEFINES (empty: the defaults in the .cu)."""
    return check_defines(os.environ.get("NEMO_DCR_CUDA_DEFINES", ""))


# ------------------------------------------------------------------ command lines
def cpu_command(cxx: str, flags: Sequence[str], out: Path, source: Path = CPU_SOURCE) -> list[str]:
    """The CPU library's compile line."""
    return [cxx, *flags, *CPU_FIXED_FLAGS, str(source), "-o", str(out)]


def nvcc_command(nvcc: str, source: Path, out: Path, defines: Sequence[str] = ()) -> list[str]:
    """The CUDA library's compile line: a shared library with the CUDA runtime linked statically
    (no libcudart needed beside it, so a build carried to another machine of the same driver runs)."""
    cmd = [nvcc, "-O3", "-std=c++17", "--threads", "0", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
           *check_defines(defines)]
    for g in GENCODE:
        cmd += ["-gencode", g]
    return cmd + [str(source), "-o", str(out)]


def emulation_command(cxx: str, out: Path, defines: Sequence[str] = ()) -> list[str]:
    """dcr_cuda.cu compiled by the C++ compiler against cuda_emu.h: the CUDA kernels' code run
    on CPU fibers, so tests check its logic on machines without a GPU."""
    return [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-DDCR_EMULATE", *check_defines(defines),
            "-include", str(CUDA_EMU_HEADER), "-x", "c++", str(CUDA_SOURCE), "-o", str(out)]


# ------------------------------------------------------------------ building
def compile_to(out: Path, command: Callable[[Path], list[str]], verbose: bool = False) -> Path:
    """Run command(tmp) to build into a temporary name next to `out`, then rename it to `out`.

    Raises BuildError with the compiler's output when the compile fails."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    cmd = command(tmp)
    if verbose:
        print(" ".join(cmd), file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=not verbose, text=True)
        if proc.returncode != 0:
            tail = "\n".join(((proc.stderr or "") + (proc.stdout or "")).strip().splitlines()[-20:])
            raise BuildError(f"{Path(cmd[0]).name} failed (exit {proc.returncode}) on {cmd[-3]}"
                             + (f":\n{tail}" if tail else ""))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cpu_source_sha256() -> str:
    """The CPU library's source: dcr_cpu.cpp and the parts it includes, in name order."""
    h = hashlib.sha256(CPU_SOURCE.read_bytes())
    for p in sorted(CPU_PARTS.glob("*.h")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _version(tool: str) -> str:
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    release = [ln for ln in lines if "release" in ln]  # nvcc: "Cuda compilation tools, release 13.0, V13.0.88"
    return (release or lines or [""])[0]


def build_cpu(out_dir: Path, *, flags: Sequence[str] | None = None, verbose: bool = False) -> dict:
    """Compile libdcr_cpu.so into out_dir. Returns its BUILD.json entry; raises BuildError."""
    cxx = find_cxx()
    if cxx is None:
        env = os.environ.get("CXX")
        raise BuildError(f"CXX={env} is not an executable" if env
                         else "no C++ compiler found (install g++, or set CXX)")
    origin = "argument"
    if flags is None:
        flags, origin = cpu_flags()
    out = compile_to(Path(out_dir) / CPU_LIB,
                     lambda tmp: cpu_command(cxx, flags, tmp), verbose)
    return {"library": out.name, "compiler": cxx, "compiler_version": _version(cxx), "flags": list(flags),
            "flags_from": origin, "source": "cuda_ext/cpu/dcr_cpu.cpp",
            "source_sha256": cpu_source_sha256()}


def build_cuda(out_dir: Path, *, defines: Sequence[str] = (), verbose: bool = False) -> dict:
    """Compile libdcr_cuda.so into out_dir with nvcc (no GPU needed). Returns its BUILD.json
    entry; raises BuildError."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set NVCC or CUDA_HOME, or put nvcc on PATH)")
    defines = check_defines(defines)
    out = compile_to(Path(out_dir) / CUDA_LIB, lambda tmp: nvcc_command(nvcc, CUDA_SOURCE, tmp, defines), verbose)
    return {"library": out.name, "compiler": nvcc, "compiler_version": _version(nvcc), "gencode": list(GENCODE),
            "defines": defines, "source": "cuda_ext/cuda/dcr_cuda.cu", "source_sha256": sha256(CUDA_SOURCE)}


def write_build_info(out_dir: Path, **entries: dict | None) -> Path:
    """Merge entries (cpu=..., cuda=...) into out_dir/BUILD.json; None removes an entry (its
    library was not built). Written through a temporary file and a rename."""
    path = Path(out_dir) / BUILD_INFO
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        info = {}
    for key, value in entries.items():
        if value is None:
            info.pop(key, None)
        else:
            info[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python cuda_ext/build.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuda", action="store_true", help="also build the CUDA library (nvcc, no GPU needed)")
    ap.add_argument("--cuda-if-found", action="store_true", help="build the CUDA library if nvcc is found")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU library (with --cuda: CUDA variants)")
    ap.add_argument("--defines", default=None,
                    help='the CUDA kernels\' -DDCR_<KNOB>=<value> tuning flags, for example "-DDCR_BLOCK=128" '
                         '(default $NEMO_DCR_CUDA_DEFINES)')
    ap.add_argument("--out", type=Path, default=PACKAGE_LIB_DIR, help=f"output folder (default {PACKAGE_LIB_DIR})")
    ap.add_argument("-q", "--quiet", action="store_true", help="do not print the compile lines")
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(argv[:-1]):  # argparse would read `--defines -DDCR_X=1` as two options
        if a == "--defines":
            argv[i:i + 2] = [f"--defines={argv[i + 1]}"]
            break
    args = ap.parse_args(argv)
    if args.cuda_if_found and not args.cuda:
        args.cuda = find_nvcc() is not None
        if not args.cuda:
            print("cuda_ext/build.py: nvcc not found: the CUDA library is not built", file=sys.stderr)
    if args.no_cpu and not args.cuda:
        print("cuda_ext/build.py: nothing to build (--no-cpu without --cuda)", file=sys.stderr)
        return 2
    try:
        defines = check_defines(args.defines) if args.defines is not None else env_defines()
        if not args.no_cpu:
            entry = build_cpu(args.out, verbose=not args.quiet)
            write_build_info(args.out, cpu=entry)
            print(args.out / entry["library"])
        if args.cuda:
            entry = build_cuda(args.out, defines=defines, verbose=not args.quiet)
            write_build_info(args.out, cuda=entry)
            print(args.out / entry["library"])
    except BuildError as exc:
        print(f"cuda_ext/build.py: error: {exc}", file=sys.stderr)
        return 2
    return 0

if __name__ == "__main__":
    sys.exit(main())
