"""Stream packing shared by the chunk encoders (encode.py, context_encode.py, slices.py): zstd
or stored, rANS or stored tokens, the value coding's estimate, per-thread scratch buffers."""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from nemo_dcr_callback.codec.bounds import entropy_bits
from nemo_dcr_callback.codec.format import RANS, STORED, ZSTD, Stream, ValueMode
from nemo_dcr_callback.codec.streams import ans_decode

_tls = threading.local()


def zc(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for `level` (zstandard objects are not thread-safe)."""
    cache = getattr(_tls, "zc", None)
    if cache is None:
        cache = _tls.zc = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def pack_stream(raw, level: int) -> tuple[bytes, int]:
    """zstd a stream unless that does not make it smaller (then store it)."""
    if len(raw) == 0:
        return b"", STORED
    comp = zc(level).compress(raw)
    if len(comp) < len(raw):
        return comp, ZSTD
    return bytes(raw), STORED


def token_stream(tok: np.ndarray | None, coded: bytes, count: int | None = None) -> Stream:
    """The token stream rANS-coded, or stored where that is smaller (a handful of changes:
    the rANS table and states alone are 35-100 bytes)."""
    count = tok.size if tok is not None else count
    if len(coded) < count:
        return (count, coded, RANS)
    if tok is None:
        tok = ans_decode(coded, count)
    return (count, tok.tobytes(), STORED)


def ranked_modes(hist: np.ndarray, value_modes: tuple[ValueMode, ...], width: int,
                  exhaustive: bool) -> list[ValueMode]:
    """Value codings by estimated size (the tokens' order-0 information plus escaped values):
    the best one, or all of them best first when exhaustive."""
    est = {vm: entropy_bits(hist[int(vm)]) / 8 + int(hist[int(vm), 255]) * width for vm in value_modes}
    return sorted(value_modes, key=est.get) if exhaustive else [min(value_modes, key=est.get)]


def scratch(role: str, n: int, dtype=np.uint8) -> tuple[np.ndarray, int]:
    """This thread's reusable output buffer `role` for the fused encoder, and its address (its
    outputs are copied or compressed out before the thread's next chunk): no allocation and no
    fresh pages per chunk. numpy with the address kept, not torch: the encoder's Python wrapper
    is paid per chunk (16 -> 10 us on a small chunk with numpy, less with the address kept)."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    got = bufs.get(role)
    if got is None or got[0].size < n:
        a = np.empty(max(n, (1 << 16) // np.dtype(dtype).itemsize), dtype=dtype)  # at least 64 KiB
        got = bufs[role] = (a, a.ctypes.data)
    return got
