"""CUDA dispatch: cuda_ext/cuda/dcr_cuda.cu, built with nvcc when the package is built, loaded through ctypes.

The same plain C ABI as the CPU library (kernels.py), over device pointers: no torch headers
or torch C++ ABI, so one build serves any CUDA torch, and the .cu compiles on machines without
a GPU (CI checks that). setup.py builds it into nemo_dcr_callback/_lib/ where nvcc is found
(docs/BUILD.md); `library()` loads it where a CUDA torch sees a device and never compiles.
Workspace and outputs come from torch's caching allocator and kernels run on torch's current
stream. docs/CUDA.md has the design.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

import torch

from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.core.rawbits import SparseDelta, bits, index_dtype

LIB_NAME = "libdcr_cuda.so"
ABI_VERSION = 1
CAP_FRACTION = 0.125  # output buffers hold this fraction of a shard; a denser delta takes more rounds
BASELINE_PLACES = ("gpu", "pinned")

c_i64, c_int, c_void_p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "dcr_cuda_abi_version": (c_int, []),
    "dcr_cuda_delta_workspace": (c_i64, [c_i64]),
    "dcr_cuda_delta_min_cap": (c_i64, [c_int]),
    "dcr_cuda_scatter_workspace": (c_i64, []),
    "dcr_cuda_delta": (c_int, [c_void_p, c_void_p, c_i64, c_int, c_void_p, c_int, c_void_p, c_void_p, c_i64,
                               c_void_p, c_i64, c_void_p, c_int, c_void_p]),
    "dcr_cuda_scatter": (c_int, [c_void_p, c_i64, c_int, c_void_p, c_int, c_void_p, c_i64, c_int, c_void_p, c_i64,
                                 c_void_p, c_void_p]),
    "dcr_cuda_device_pointer": (c_int, [c_void_p, ctypes.POINTER(c_void_p)]),
    "dcr_cuda_strerror": (ctypes.c_char_p, [c_int]),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


# ------------------------------------------------------------------ load
def library_path() -> Path:
    """The CUDA library that will be loaded: $NEMO_DCR_CUDA_LIB, else the package's _lib/libdcr_cuda.so."""
    env = os.environ.get("NEMO_DCR_CUDA_LIB")
    return Path(env) if env else kernels.LIB_DIR / LIB_NAME


def build_info() -> dict:
    """The CUDA entry of BUILD.json beside the library (nvcc, targets, tuning defines); {} if none."""
    return kernels.build_info(library_path()).get("cuda", {})


def load(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its signatures (no CUDA call: works without a GPU)."""
    return kernels.load_library(path, _SIGNATURES, "dcr_cuda_abi_version", ABI_VERSION)


def library() -> ctypes.CDLL | None:
    """The CUDA library, loaded on first use if a CUDA torch sees a device; None otherwise
    (said once on stderr when a device is there but the library is not)."""
    global _lib, _tried
    if _lib is not None or _tried:
        return _lib
    if not torch.cuda.is_available():
        return None
    with _lock:
        if _tried:
            return _lib
        _tried = True
        path = library_path()
        try:
            if not path.exists():
                raise FileNotFoundError(f"{path} does not exist")
            _lib = load(path)
        except (OSError, RuntimeError, AttributeError) as exc:
            source = " (from $NEMO_DCR_CUDA_LIB)" if os.environ.get("NEMO_DCR_CUDA_LIB") else ""
            print(kernels.unavailable_message(
                "CUDA kernels", f"{exc}{source}", "CUDA shards cannot be diffed or patched on the GPU without them.",
                "reinstall the package with nvcc on PATH (or NVCC / CUDA_HOME set), or run "
                "`nemo-dcr build-kernels --cuda` in a source checkout"), file=sys.stderr, flush=True)
            _lib = None
    return _lib


def available() -> bool:
    return library() is not None


def _require() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the CUDA kernels are unavailable (no CUDA device, or the package was built "
                           "without nvcc: `nemo-dcr doctor` says which)")
    return lib


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc < 0:
        raise RuntimeError(f"{what} failed ({rc}: {lib.dcr_cuda_strerror(rc).decode()})")


def device_pointer(t: torch.Tensor, lib: ctypes.CDLL | None = None) -> int:
    """The address a kernel uses for t: its own for device memory, the mapped one for pinned
    host memory; pageable host memory is refused."""
    lib = lib or _require()
    out = c_void_p()
    rc = lib.dcr_cuda_device_pointer(t.data_ptr(), ctypes.byref(out))
    if rc < 0:
        raise ValueError(f"the CUDA kernels cannot reach this tensor ({lib.dcr_cuda_strerror(rc).decode()})")
    return out.value or 0


# The launches below run on the current stream of the tensors' GPU. Given host tensors (only
# the CPU emulation of the library does that: tests), there is no stream and nothing to wait for.
def _stream(dev: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.current_stream(dev) if dev.type == "cuda" else None


def _sync(stream: torch.cuda.Stream | None) -> None:
    """This thread waits for the stream's work so far (not the device's, not other streams')."""
    if stream is not None:
        ev = torch.cuda.Event()
        ev.record(stream)
        ev.synchronize()


def _host_buffer(shape, dtype: torch.dtype, stream: torch.cuda.Stream | None) -> torch.Tensor:
    """Host memory the device writes into: pinned (the kernel or a copy engine reaches it)."""
    return torch.zeros(shape, dtype=dtype, pin_memory=stream is not None)


# ------------------------------------------------------------------ delta
def _check_pair(current: torch.Tensor, baseline: torch.Tensor) -> None:
    if current.dtype != baseline.dtype or current.shape != baseline.shape:
        raise ValueError(f"shard and baseline differ: {current.dtype}{tuple(current.shape)} vs "
                         f"{baseline.dtype}{tuple(baseline.shape)}")
    if not current.is_cuda:
        raise ValueError("the CUDA delta kernel takes a CUDA shard")
    if baseline.is_cuda and baseline.device != current.device:
        raise ValueError(f"shard on {current.device}, baseline on {baseline.device}")
    if not baseline.is_cuda and baseline.numel() and not baseline.is_pinned():  # (an empty one is never pinned)
        raise ValueError("a host baseline must be in pinned memory (place_baseline(..., 'pinned'))")


def take_delta_cuda(current: torch.Tensor, baseline: torch.Tensor, keep_new: bool = False, out: str = "device", *,
                    cap: int | None = None, pos64: bool | None = None, scalar: bool = False,
                    wait: bool = True) -> SparseDelta:
    """delta.take_delta for a CUDA shard, on the current stream: same output as the CPU kernel.

    baseline is on the shard's GPU or in pinned host memory. out="device" returns device
    tensors; out="pinned" returns pinned host tensors filled by async copies (wait=False leaves
    the caller to synchronize the stream before reading them). The count is read back once per
    round (one round unless more than `cap` elements changed), so the caller's CPU thread waits
    for the kernel, never the other streams. pos64 and scalar force the int64 positions and the
    scalar path (for tests).
    """
    if out not in ("device", "pinned"):
        raise ValueError(f"out must be 'device' or 'pinned', not {out!r}")
    _check_pair(current, baseline)
    with torch.cuda.device(current.device):  # the library's launches go to the current device
        return take_with(_require(), current, baseline, keep_new, out, cap=cap, pos64=pos64, scalar=scalar,
                         wait=wait)


def take_with(lib: ctypes.CDLL, current: torch.Tensor, baseline: torch.Tensor, keep_new: bool, out: str, *,
              cap: int | None = None, pos64: bool | None = None, scalar: bool = False,
              wait: bool = True) -> SparseDelta:
    """take_delta_cuda's rounds with a given library (the tests pass the CPU emulation)."""
    c, b = bits(current), bits(baseline)
    n, w = c.numel(), c.element_size()
    idt = torch.int64 if pos64 else index_dtype(n)
    dev = current.device
    stream = _stream(dev)
    floor = min(n, lib.dcr_cuda_delta_min_cap(w))
    cap = max(floor, min(n, cap if cap is not None else int(n * CAP_FRACTION)))
    pos = torch.empty(max(cap, 1), dtype=idt, device=dev)
    val = torch.empty(max(cap, 1), dtype=c.dtype, device=dev)
    new = torch.empty(max(cap, 1), dtype=c.dtype, device=dev) if keep_new else None
    ws_bytes = lib.dcr_cuda_delta_workspace(n)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev)
    res = _host_buffer(2, torch.int64, stream)
    res_ptr = device_pointer(res, lib)
    c_ptr, b_ptr = c.data_ptr(), (b.data_ptr() if b.is_cuda or n == 0 else device_pointer(b, lib))
    parts: list[tuple[torch.Tensor, ...]] = []
    done = 0
    while True:
        rc = lib.dcr_cuda_delta(c_ptr + done * w, b_ptr + done * w, n - done, w, pos.data_ptr(),
                                int(idt == torch.int64), val.data_ptr(), 0 if new is None else new.data_ptr(), cap,
                                ws.data_ptr(), ws_bytes, res_ptr, int(scalar),
                                stream.cuda_stream if stream is not None else 0)
        _check(lib, rc, "dcr_cuda_delta")
        _sync(stream)
        count, step = int(res[0]), int(res[1])
        if done:
            pos[:count] += done
        bufs = (pos, val) if new is None else (pos, val, new)
        parts.append(tuple(_copy_out(x[:count], out, stream) for x in bufs))  # queued before the next round
        done += step
        if done >= n:
            break
        if step <= 0:
            raise RuntimeError("dcr_cuda_delta made no progress (capacity below one tile)")
    if out == "pinned" and wait:
        _sync(stream)
    cols = [p[0] if len(parts) == 1 else torch.cat(p) for p in zip(*parts, strict=True)]
    return SparseDelta(cols[0], cols[1], n, current.dtype, cols[2] if keep_new else None)


def _copy_out(x: torch.Tensor, out: str, stream: torch.cuda.Stream | None) -> torch.Tensor:
    if out == "device":
        return x.clone()
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=stream is not None)
    host.copy_(x, non_blocking=True)
    return host


# ------------------------------------------------------------------ scatter
def scatter_cuda(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, op: int) -> None:
    """delta.scatter for a CUDA target (positions and values may be on the host): validated
    on the device before any write; a refusal raises ValueError and leaves target untouched."""
    if not target.is_cuda:
        raise ValueError("the CUDA scatter takes a CUDA target")
    with torch.cuda.device(target.device):
        scatter_with(_require(), target, positions, values, op)


def scatter_with(lib: ctypes.CDLL, target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
                 op: int) -> None:
    """scatter_cuda with a given library (the tests pass the CPU emulation)."""
    if op not in (0, 1, 2):
        raise ValueError(f"unknown op {op}")
    t = bits(target)
    dev = target.device
    if positions.dtype not in (torch.int32, torch.int64):
        positions = positions.to(torch.int64)
    positions = positions.reshape(-1).to(dev, non_blocking=True).contiguous()
    values = values.reshape(-1).contiguous()
    values = (values if values.dtype == t.dtype else values.view(t.dtype)).to(dev, non_blocking=True)
    if positions.numel() != values.numel():
        raise ValueError(f"{positions.numel()} positions but {values.numel()} values")
    stream = _stream(dev)
    ws_bytes = lib.dcr_cuda_scatter_workspace()
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev)
    res = _host_buffer(2, torch.int64, stream)
    rc = lib.dcr_cuda_scatter(t.data_ptr(), t.numel(), t.element_size(), positions.data_ptr(),
                              int(positions.dtype == torch.int64), values.data_ptr(), positions.numel(), op,
                              ws.data_ptr(), ws_bytes, device_pointer(res, lib),
                              stream.cuda_stream if stream is not None else 0)
    if rc == -9:
        raise ValueError(f"scatter refused: op {op} does not apply to width {t.element_size()}")
    _check(lib, rc, "dcr_cuda_scatter")
    _sync(stream)
    status = int(res[0])
    if status < 0:
        raise ValueError(f"scatter refused: positions out of range or unsorted ({status})")


# ------------------------------------------------------------------ sender side
def check_baseline_option(where: str) -> str:
    if where not in BASELINE_PLACES:
        raise ValueError(f"baseline must be one of {', '.join(BASELINE_PLACES)} (where the baselines of CUDA "
                         f"shards live), not {where!r}")
    return where


def place_baseline(baseline: torch.Tensor, where: str, like: torch.Tensor | None = None) -> torch.Tensor:
    """baseline in GPU memory or pinned host memory, at the same 16-byte phase as `like` (the
    shard it is diffed against: a slice of a flat buffer may start anywhere) so the kernel's
    16-byte loads line up. Returns baseline itself when it is already so."""
    check_baseline_option(where)
    dev = (like if like is not None else baseline).device
    if dev.type != "cuda":
        raise ValueError("place_baseline is for the baselines of CUDA shards")
    w = baseline.element_size()
    phase = (like.data_ptr() % 16) // w if like is not None else 0
    on_place = baseline.is_cuda if where == "gpu" else (not baseline.is_cuda and baseline.is_pinned())
    if on_place and (baseline.data_ptr() % 16) // w == phase and baseline.is_contiguous():
        return baseline
    n = baseline.numel()
    if where == "gpu":
        buf = torch.empty(n + phase, dtype=baseline.dtype, device=dev)
    else:
        buf = torch.empty(n + phase, dtype=baseline.dtype, pin_memory=True)
    out = buf[phase:phase + n].view(baseline.shape)
    out.copy_(baseline)
    return out


class SideStream:
    """Delta passes for CUDA shards off the training stream.

    take(): an event recorded on the current (training) stream, a side stream waiting on it,
    the kernel and the copies of the compacted output into pinned host buffers on the side
    stream, then this thread waits on the side stream's event. The training stream is never
    made to wait; by the time take() returns the kernel has read the shard, so the next
    optimizer step (queued after) cannot race it, and the host buffers are ready to encode.
    """

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def take(self, current: torch.Tensor, baseline: torch.Tensor, keep_new: bool = True) -> SparseDelta:
        dev = current.device
        side = self._streams.get(dev)
        if side is None:
            side = self._streams[dev] = torch.cuda.Stream(dev)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dev))
        side.wait_event(ready)
        with torch.cuda.stream(side):
            return take_delta_cuda(current, baseline, keep_new, out="pinned", wait=True)

