"""Kernel dispatch: the compiled CPU library (cuda_ext/cpu) loaded through ctypes.

A plain C ABI over raw pointers keeps the library independent of the torch C++ ABI, so one
build serves any torch >= 2.4. `make setup` builds it; if it is missing, `native()` tries
to build it once (g++ on PATH) and otherwise returns None, and every caller falls back to
the pure-torch reference in delta.py / codec.py (correct, slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
SOURCE = _REPO / "cuda_ext" / "cpu" / "dcr_cpu.cpp"
ABI_VERSION = 1

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

c_i64, c_int, c_void_p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p

_SIGNATURES = {
    "dcr_abi_version": (c_int, []),
    "dcr_delta": (
        c_i64,
        [c_void_p, c_void_p, c_i64, c_int, c_void_p, c_int, c_void_p, c_void_p, c_int],
    ),
    "dcr_scatter": (c_i64, [c_void_p, c_i64, c_int, c_void_p, c_int, c_void_p, c_i64, c_int]),
    "dcr_ulp_encode": (c_i64, [c_void_p, c_void_p, c_i64, c_int, c_void_p]),
    "dcr_tokens": (c_i64, [c_void_p, c_void_p, c_i64, c_int, c_int, c_void_p, c_void_p, c_void_p]),
    "dcr_ans_bound": (c_i64, [c_i64]),
    "dcr_ans_encode": (c_i64, [c_void_p, c_i64, c_void_p, c_i64]),
    "dcr_ans_decode": (c_i64, [c_void_p, c_i64, c_void_p, c_i64]),
    "dcr_ans_decode_values": (c_i64, [c_void_p, c_i64, c_i64, c_void_p, c_i64, c_int, c_void_p]),
    "dcr_gaps_encode": (c_i64, [c_void_p, c_int, c_i64, c_i64, c_i64, c_int, c_void_p, c_i64]),
    "dcr_gaps_decode": (c_i64, [c_void_p, c_i64, c_int, c_i64, c_i64, c_i64, c_void_p, c_int]),
    "dcr_sum64": (ctypes.c_uint64, [c_void_p, c_int, c_void_p, c_i64, c_i64, c_int]),
    "dcr_sum64_at": (ctypes.c_uint64, [c_void_p, c_int, c_void_p, c_int, c_i64, c_int]),
    "dcr_scatter_digest": (c_i64, [c_void_p, c_i64, c_int, c_void_p, c_int, c_void_p, c_i64, c_int, c_void_p]),
    "dcr_encode_xor": (c_i64, [c_void_p, c_int, c_void_p, c_void_p, c_i64, c_int, c_i64, c_i64, c_int, c_void_p,
                               c_i64, c_void_p, c_i64, c_void_p, c_void_p, c_void_p]),
    "dcr_affine": (c_i64, [c_void_p, c_int, c_i64, c_i64, c_i64, c_i64, c_i64, c_i64, c_void_p]),
    "dcr_encode_slice": (c_i64, [c_void_p, c_int, c_i64, c_i64, c_void_p, c_void_p, c_int, c_i64, c_void_p, c_i64,
                                 c_void_p, c_i64, c_void_p, c_void_p, c_void_p, c_i64, c_void_p, c_i64, c_void_p,
                                 c_i64, c_void_p, c_i64, c_void_p, c_i64]),
}


def _source_tag() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def build_dir() -> Path:
    """Where built libraries live: cuda_ext/build, or $NEMO_DCR_BUILD_DIR."""
    override = os.environ.get("NEMO_DCR_BUILD_DIR")
    return Path(override) if override else _REPO / "cuda_ext" / "build"


def library_path() -> Path:
    """The CPU library's path, tagged by the source's hash."""
    return build_dir() / f"libdcr_cpu-{_source_tag()}.so"


def compile_to(out: Path, command, verbose: bool = False) -> Path:
    """Run command(tmp) to build into a temporary name next to `out`, then rename: a reader
    never loads a half-written library."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    cmd = command(tmp)
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    os.replace(tmp, out)
    return out


def load_library(path: Path, signatures: dict, abi_fn: str, abi: int) -> ctypes.CDLL:
    """Load a library through ctypes, declare its signatures and check its ABI version."""
    lib = ctypes.CDLL(str(path))
    for name, (res, args) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    got = getattr(lib, abi_fn)()
    if got != abi:
        raise RuntimeError(f"{path}: ABI {got} != {abi}")
    return lib


def build(verbose: bool = False) -> Path:
    """Compile the CPU library with g++ (C++17, -O3, pthreads). Returns its path."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    flags = os.environ.get("NEMO_DCR_CXXFLAGS", "-O3 -march=native").split()
    return compile_to(library_path(), lambda tmp: [cxx, *flags, "-std=c++17", "-fPIC", "-shared", "-pthread",
                                                   str(SOURCE), "-o", str(tmp)], verbose)


def _load(path: Path) -> ctypes.CDLL:
    return load_library(path, _SIGNATURES, "dcr_abi_version", ABI_VERSION)


def native() -> ctypes.CDLL | None:
    """The compiled library, building it on first use if needed; None if unavailable.

    NEMO_DCR_NATIVE=0 forces the pure-torch reference path (used by tests to compare); it is
    read until the library is loaded, so set it before the first kernel call.
    """
    global _lib, _tried
    if _lib is not None:  # the hot path: the codec asks once per stream
        return _lib
    if os.environ.get("NEMO_DCR_NATIVE", "1") == "0":
        return None
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if not SOURCE.exists():
            return None
        path = library_path()
        try:
            if not path.exists():
                build()
            _lib = _load(path)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            print(f"nemo-dcr: compiled CPU kernels unavailable ({exc}); using the torch reference",
                  file=sys.stderr)
            _lib = None
    return _lib


def num_threads() -> int:
    """Threads for the compiled kernels: NEMO_DCR_THREADS, else torch's intra-op count."""
    env = os.environ.get("NEMO_DCR_THREADS")
    if env:
        return max(1, int(env))
    import torch

    return max(1, torch.get_num_threads())


def ptr(t) -> int:
    """Raw data pointer of a torch tensor (or 0 for None)."""
    return 0 if t is None else t.data_ptr()


if __name__ == "__main__":  # `python -m nemo_dcr_callback.core.kernels` builds the library
    print(build(verbose=True))
