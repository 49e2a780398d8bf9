"""Kernel dispatch: the compiled CPU library (cuda_ext/cpu/dcr_cpu.cpp) loaded through ctypes.

A plain C ABI over raw pointers keeps the library independent of the torch C++ ABI, so one
build serves any torch >= 2.4. The library is compiled when the package is built (setup.py,
docs/BUILD.md) and ships inside it, in nemo_dcr_callback/_lib/; nothing is compiled at run
time. If it is missing or does not load, `native()` says so once on stderr and returns None,
and every caller falls back to the pure-torch reference in delta.py / codec.py (correct, much
slower).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
from pathlib import Path

LIB_DIR = Path(__file__).resolve().parents[1] / "_lib"
LIB_NAME = "libdcr_cpu.so"
ABI_VERSION = 4
SIMD_PATHS = {2: "AVX-512", 1: "AVX2", 0: "portable"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None
_warned = False

c_i64, c_int, c_void_p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p

_SIGNATURES = {
    "dcr_abi_version": (c_int, []),
    "dcr_delta": (
        c_i64,
        [c_void_p, c_void_p, c_i64, c_int, c_void_p, c_int, c_void_p, c_void_p, c_int],
    ),
    "dcr_scatter": (c_i64, [c_void_p, c_i64, c_int, c_void_p, c_int, c_void_p, c_i64, c_int]),
    "dcr_scatter_many": (c_i64, [c_i64, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_int, c_int]),
    "dcr_member_table": (c_i64, [c_void_p, c_i64, c_i64, c_i64, c_void_p]),
    "dcr_ctx_decode": (c_i64, [c_void_p, c_void_p, c_i64, c_int, c_int, c_int, c_void_p, c_int, c_void_p, c_void_p,
                               c_i64, c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_i64, c_int]),
    "dcr_ctx_encode": (c_i64, [c_void_p, c_i64, c_int, c_int, c_int, c_int, c_void_p, c_int, c_i64, c_i64, c_void_p,
                               c_void_p, c_void_p, ctypes.c_double, c_i64, c_i64, c_void_p, c_void_p, c_void_p,
                               c_i64, c_void_p]),
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


def library_path() -> Path:
    """The CPU library that will be loaded: $NEMO_DCR_CPU_LIB, else the package's _lib/libdcr_cpu.so."""
    env = os.environ.get("NEMO_DCR_CPU_LIB")
    return Path(env) if env else LIB_DIR / LIB_NAME


def build_info(path: Path | None = None) -> dict:
    """BUILD.json beside a library (how it was compiled); {} if there is none."""
    try:
        return json.loads(((path or library_path()).parent / "BUILD.json").read_text())
    except (OSError, ValueError):
        return {}


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


def _load(path: Path) -> ctypes.CDLL:
    return load_library(path, _SIGNATURES, "dcr_abi_version", ABI_VERSION)


def unavailable_message(what: str, error: str, consequence: str, fix: str) -> str:
    """The message a missing native library prints once: what, why, why it matters, how to fix it."""
    return (f"nemo-dcr: the {what} are unavailable ({error}).\n  {consequence}\n"
            f"  Fix: {fix}. `nemo-dcr doctor` shows what is loaded.")


def _try_load() -> None:
    global _lib, _tried, _error
    with _lock:
        if _tried:
            return
        path = library_path()
        try:
            if not path.exists():
                raise FileNotFoundError(f"{path} does not exist")
            _lib = _load(path)
        except (OSError, RuntimeError, AttributeError) as exc:
            _error = str(exc)
            _lib = None
        _tried = True


def _warn_once() -> None:
    global _warned
    if _warned or _error is None:
        return
    _warned = True
    source = " (from $NEMO_DCR_CPU_LIB)" if os.environ.get("NEMO_DCR_CPU_LIB") else ""
    print(unavailable_message(
        "compiled CPU kernels", _error + source,
        "Every delta, encode and apply runs on the pure-torch reference instead: correct, but much slower.",
        "reinstall the package with g++ on PATH (pip reinstalls compile them), or run `nemo-dcr build-kernels` "
        "in a source checkout"), file=sys.stderr, flush=True)


def native() -> ctypes.CDLL | None:
    """The compiled library, loaded on first use; None if unavailable (said once on stderr).

    NEMO_DCR_NATIVE=0 forces the pure-torch reference path (used by tests to compare); it is
    read until the library is loaded, so set it before the first kernel call.
    """
    if _lib is not None:  # the hot path: the codec asks once per stream
        return _lib
    if os.environ.get("NEMO_DCR_NATIVE", "1") == "0":
        return None
    if not _tried:
        _try_load()
    _warn_once()
    return _lib


def load_state() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, why not) without the stderr message; ignores NEMO_DCR_NATIVE (for doctor)."""
    if not _tried:
        _try_load()
    return _lib, _error


def simd_path(lib: ctypes.CDLL | None = None) -> str | None:
    """The SIMD path the loaded library's dispatch takes ("AVX-512", "AVX2", "portable"), or
    None without a library (or one too old to say)."""
    lib = lib or load_state()[0]
    if lib is None or not hasattr(lib, "dcr_simd_path"):
        return None
    fn = lib.dcr_simd_path
    fn.restype, fn.argtypes = c_int, []
    return SIMD_PATHS.get(fn(), "portable")


def num_threads() -> int:
    """Threads for the compiled kernels: NEMO_DCR_THREADS, else torch's intra-op count."""
    env = os.environ.get("NEMO_DCR_THREADS")
    if env:
        return max(1, int(env))
    import torch  # start-up cost: this module is on the CLI's path (tools.doctor), torch is not

    return max(1, torch.get_num_threads())


def ptr(t) -> int:
    """Raw data pointer of a torch tensor (or 0 for None)."""
    return 0 if t is None else t.data_ptr()
