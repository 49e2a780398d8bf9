"""Stream transforms under the chunk codec: gap coding, value layouts and order-0 rANS.

Each transform runs in the compiled library when it is present and in numpy / Python
otherwise; the two are interchangeable bit for bit (tests cross-check them). Decoders
validate everything and raise StreamError; they never read or write out of bounds.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.core.bitops import ulp_diff_reference


class StreamError(ValueError):
    """A stream that does not decode to what its header declares."""


class GapMode(IntEnum):
    GAP8 = 0  # byte per gap, 255 = "add 255 and continue"
    GAP16 = 1  # 16-bit symbol per gap in two byte planes, 65535 = continue
    DENSE = 2  # every position of [lo, hi): no position stream


def _is64(t: torch.Tensor | None) -> int:
    return int(t is not None and t.dtype == torch.int64)


# ----------------------------------------------------------------------------- gaps
def gap_bound(mode: GapMode, count: int, span: int) -> int:
    """Largest legal gap stream for count positions in a span (also the decoder's bound)."""
    if mode == GapMode.GAP8:
        return count + span // 255 + 1
    if mode == GapMode.GAP16:
        return 2 * (count + span // 65535 + 1)
    return 0


def encode_gaps(positions: torch.Tensor, lo: int, hi: int, mode: GapMode) -> np.ndarray:
    """Sorted positions in [lo, hi) -> gap stream (gap = p - previous - 1, previous = lo - 1)."""
    lib = kernels.native()
    if lib is None:
        return _encode_gaps_py(positions.to(torch.int64).numpy(), lo, hi, mode)
    cap = gap_bound(mode, positions.numel(), hi - lo)
    out = np.empty(cap, dtype=np.uint8)
    n = lib.dcr_gaps_encode(positions.data_ptr(), _is64(positions), positions.numel(), lo, hi,
                            int(mode), out.ctypes.data, cap)
    if n < 0:
        raise ValueError(f"positions not sorted within [{lo}, {hi}) ({n})")
    return out[:n]


def _encode_gaps_py(pos: np.ndarray, lo: int, hi: int, mode: GapMode) -> np.ndarray:
    if pos.size and (pos[0] < lo or pos[-1] >= hi or (np.diff(pos) <= 0).any()):
        raise ValueError(f"positions not sorted within [{lo}, {hi})")
    gaps = np.diff(np.concatenate([[lo - 1], pos])) - 1
    esc = 255 if mode == GapMode.GAP8 else 65535
    reps = gaps // esc
    out = np.full(int((reps + 1).sum()), esc, dtype=np.int64)  # escapes, then the remainder
    out[np.cumsum(reps + 1) - 1] = gaps - reps * esc
    if mode == GapMode.GAP8:
        return out.astype(np.uint8)
    return np.concatenate([(out & 255).astype(np.uint8), (out >> 8).astype(np.uint8)])


GAP_ERRORS = {-1: "position stream ends early", -2: "position out of range",
               -3: "trailing bytes in position stream"}


def decode_gaps(stream: np.ndarray, mode: GapMode, count: int, lo: int, hi: int,
                idt: torch.dtype) -> torch.Tensor:
    """Gap stream -> exactly `count` strictly increasing positions in [lo, hi)."""
    lib = kernels.native()
    if lib is None:
        return _decode_gaps_py(stream, mode, count, lo, hi).to(idt)
    pos = torch.empty(count, dtype=idt)
    rc = lib.dcr_gaps_decode(stream.ctypes.data, stream.size, int(mode), count, lo, hi,
                             pos.data_ptr(), int(idt == torch.int64))
    if rc < 0:
        raise StreamError(GAP_ERRORS.get(rc, f"gap decode error {rc}"))
    return pos


def _decode_gaps_py(stream: np.ndarray, mode: GapMode, count: int, lo: int, hi: int) -> torch.Tensor:
    if mode == GapMode.GAP8:
        sym, esc = stream.astype(np.int64), 255
    else:
        if stream.size % 2:
            raise StreamError(GAP_ERRORS[-3])
        m = stream.size // 2
        sym, esc = stream[:m].astype(np.int64) | (stream[m:].astype(np.int64) << 8), 65535
    ends = np.flatnonzero(sym != esc)
    if ends.size < count:
        raise StreamError(GAP_ERRORS[-1])
    if ends.size > count or (count and ends[-1] != sym.size - 1) or (count == 0 and sym.size):
        raise StreamError(GAP_ERRORS[-3])
    csum = np.cumsum(sym)
    gap_tot = csum[ends] - np.concatenate([[0], csum[ends[:-1]]]) if count else csum[:0]
    pos = lo - 1 + np.cumsum(gap_tot + 1)
    if count and pos[-1] >= hi:
        raise StreamError(GAP_ERRORS[-2])
    return torch.from_numpy(pos)


# --------------------------------------------------------------------------- values
def ulp_encode(values: torch.Tensor, new_values: torch.Tensor) -> torch.Tensor:
    """XOR values -> zig-zag ulp differences key(new) - key(old), old = new ^ xor."""
    lib = kernels.native()
    if lib is None:
        return ulp_diff_reference(new_values ^ values, new_values)
    values, new_values = values.contiguous(), new_values.contiguous()
    out = torch.empty_like(values)
    if lib.dcr_ulp_encode(values.data_ptr(), new_values.data_ptr(), values.numel(),
                          values.element_size(), out.data_ptr()) < 0:
        raise ValueError("ulp coding needs 2-, 4- or 8-byte values")
    return out


def _u8(values: torch.Tensor) -> np.ndarray:
    return values.contiguous().numpy().view(np.uint8)


def split_planes(values: torch.Tensor) -> np.ndarray:
    count, w = values.numel(), values.element_size()
    return np.ascontiguousarray(_u8(values).reshape(count, w).T).reshape(-1)


def join_planes(planes: np.ndarray, count: int, bits_dtype: torch.dtype) -> torch.Tensor:
    w = torch.empty(0, dtype=bits_dtype).element_size()
    return torch.from_numpy(np.ascontiguousarray(planes.reshape(w, count).T).reshape(-1).copy()).view(bits_dtype)


def _unsigned(values: torch.Tensor) -> np.ndarray:
    w = values.element_size()
    return values.contiguous().numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[w])


def tokens(values: torch.Tensor, ulp: bool = False, new_values: torch.Tensor | None = None,
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Values (as zig-zag ulp differences if ulp) -> (byte token min(v, 255) per value, the
    escaped values v >= 255 as raw little-endian bytes, token histograms [raw, ulp] (2 x 256;
    the ulp row only with new_values))."""
    values = values.contiguous()
    count, w = values.numel(), values.element_size()
    lib = kernels.native()
    if lib is None:
        raw = _unsigned(values)
        z = _unsigned(ulp_diff_reference(new_values ^ values, new_values)) if new_values is not None else None
        u = z if ulp else raw
        big = u >= 255
        hist = np.zeros((2, 256), dtype=np.uint64)
        hist[0] = np.bincount(np.minimum(raw, 255).astype(np.int64), minlength=256)
        if z is not None:
            hist[1] = np.bincount(np.minimum(z, 255).astype(np.int64), minlength=256)
        return np.where(big, 255, u).astype(np.uint8), np.ascontiguousarray(u[big]).view(np.uint8), hist
    if new_values is not None:
        new_values = new_values.contiguous()
    tok = np.empty(count, dtype=np.uint8)
    esc = np.empty(count * w, dtype=np.uint8)
    hist = np.empty(512, dtype=np.uint64)
    n_esc = lib.dcr_tokens(values.data_ptr(), kernels.ptr(new_values), count, w, int(ulp),
                           tok.ctypes.data, esc.ctypes.data, hist.ctypes.data)
    if n_esc < 0:
        raise ValueError("ulp coding needs 2-, 4- or 8-byte values and the new values")
    return tok, esc[:n_esc * w], hist.reshape(2, 256)


def escape_width(esc: np.ndarray, bits_dtype: torch.dtype) -> int:
    """The width of one escaped value; StreamError if the escape stream is not whole values."""
    w = torch.empty(0, dtype=bits_dtype).element_size()
    if esc.size % w:
        raise StreamError("escape stream is not a whole number of values")
    return w


def join_tokens(tok: np.ndarray, esc: np.ndarray, bits_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of tokens() (before any ulp step); StreamError if the escapes do not match."""
    w = escape_width(esc, bits_dtype)
    big = tok == 255
    if int(big.sum()) != esc.size // w:
        raise StreamError("escape count does not match the token stream")
    ut = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[w]
    out = tok.astype(ut)
    out[big] = esc.view(ut)
    return torch.from_numpy(out).view(bits_dtype)


def token_values(coded: np.ndarray, count: int, esc: np.ndarray, bits_dtype: torch.dtype) -> torch.Tensor:
    """A rANS-coded token stream and its escapes -> values (fused in the compiled path)."""
    lib = kernels.native()
    if lib is None:
        return join_tokens(ans_decode(coded, count), esc, bits_dtype)
    w = escape_width(esc, bits_dtype)
    out = torch.empty(count, dtype=bits_dtype)
    rc = lib.dcr_ans_decode_values(coded.ctypes.data, coded.size, count, esc.ctypes.data, esc.size // w, w,
                                   out.data_ptr())
    if rc < 0:
        msg = "escape count does not match the token stream" if rc == -7 else ANS_ERRORS.get(rc, f"rANS error {rc}")
        raise StreamError(msg)
    return out


# ----------------------------------------------------------------------------- rANS
PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 31
STATES = 4  # symbol i is coded by state i % 4
ANS_ERRORS = {-1: "rANS stream truncated", -5: "bad rANS frequency table", -6: "corrupt rANS stream"}


def ans_encode(sym: np.ndarray) -> bytes:
    """Order-0 rANS (layout in docs/FORMAT.md). Needs the compiled library."""
    lib = kernels.native()
    if lib is None:
        return _ans_encode_py(sym)
    sym = np.ascontiguousarray(sym, dtype=np.uint8)
    cap = lib.dcr_ans_bound(sym.size)
    out = np.empty(cap, dtype=np.uint8)
    n = lib.dcr_ans_encode(sym.ctypes.data, sym.size, out.ctypes.data, cap)
    if n < 0:
        raise RuntimeError("rANS output bound exceeded")
    return out[:n].tobytes()


def ans_decode(data: bytes | memoryview | np.ndarray, n: int) -> np.ndarray:
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    lib = kernels.native()
    if lib is None:
        return _ans_decode_py(buf, n)
    out = np.empty(n, dtype=np.uint8)
    rc = lib.dcr_ans_decode(buf.ctypes.data, buf.size, out.ctypes.data, n)
    if rc < 0:
        raise StreamError(ANS_ERRORS.get(rc, f"rANS error {rc}"))
    return out


def normalize_freqs(hist: np.ndarray) -> np.ndarray:
    """Counts -> frequencies summing to PROB_SCALE, every present symbol >= 1 (as in C++)."""
    total = int(hist.sum())
    freq = np.zeros(256, dtype=np.int64)
    present = np.flatnonzero(hist)
    for s in present:
        freq[s] = max(1, (int(hist[s]) * PROB_SCALE + total // 2) // total)
    best = int(present[np.argmax(hist[present])]) if present.size else 0
    excess = int(freq.sum()) - PROB_SCALE
    if excess < 0:
        freq[best] -= excess
    while excess > 0:
        cand = [s for s in range(256) if freq[s] > 1]
        s_max = max(cand, key=lambda s: (freq[s], -s))
        take = min(excess, int(freq[s_max]) - 1)
        freq[s_max] -= take
        excess -= take
    return freq


def table_bytes(freq: np.ndarray) -> bytes:
    """The compact frequency table (docs/FORMAT.md, format 3) of a normalised table."""
    present = [int(s) for s in np.flatnonzero(freq)]
    below = [s for s in present if s < 255]
    nb = below[-1] // 8 + 1 if below else 0
    bitmap = bytearray(nb)
    out = bytearray()
    for s in present:
        if s < 255:
            bitmap[s >> 3] |= 1 << (s & 7)
        v = int(freq[s]) - 1
        out += bytes([v]) if v < 128 else bytes([0x80 | (v & 0x7F), v >> 7])
    return bytes([nb | (0x80 if 255 in present else 0)]) + bytes(bitmap) + bytes(out)


def read_table(data: bytes) -> tuple[list[int], int]:
    """(frequency per symbol, bytes the compact table takes); StreamError if malformed."""
    if not data:
        raise StreamError(ANS_ERRORS[-1])
    nb = data[0] & 0x3F
    if nb > 32 or data[0] & 0x40:
        raise StreamError(ANS_ERRORS[-5])
    if 1 + nb > len(data):
        raise StreamError(ANS_ERRORS[-1])
    if nb == 32 and data[32] & 0x80:
        raise StreamError(ANS_ERRORS[-5])
    freq, k = [0] * 256, 1 + nb
    for s in range(256):
        if not (data[0] & 0x80 if s == 255 else s < 8 * nb and data[1 + (s >> 3)] & (1 << (s & 7))):
            continue
        if k >= len(data):
            raise StreamError(ANS_ERRORS[-1])
        v = data[k]
        k += 1
        if v & 0x80:
            if k >= len(data):
                raise StreamError(ANS_ERRORS[-1])
            v = (v & 0x7F) | (data[k] << 7)
            k += 1
        if v >= PROB_SCALE:
            raise StreamError(ANS_ERRORS[-5])
        freq[s] = v + 1
    return freq, k


def from_format2(data: bytes | memoryview | np.ndarray) -> np.ndarray:
    """A format 2 rANS stream (a 32-byte presence bitmap, two bytes a frequency) with the
    compact table of format 3 in its place; the states and words are the same in both."""
    data = bytes(data)
    if len(data) < 32:
        raise StreamError(ANS_ERRORS[-1])
    freq, k = np.zeros(256, dtype=np.int64), 32
    for s in range(256):
        if data[s >> 3] & (1 << (s & 7)):
            if k + 2 > len(data):
                raise StreamError(ANS_ERRORS[-1])
            freq[s] = int.from_bytes(data[k:k + 2], "little")
            k += 2
            if freq[s] == 0 or freq[s] > PROB_SCALE:
                raise StreamError(ANS_ERRORS[-5])
    return np.frombuffer(table_bytes(freq) + data[k:], dtype=np.uint8)


def _ans_encode_py(sym: np.ndarray) -> bytes:
    sym = np.asarray(sym, dtype=np.uint8)
    n = sym.size
    if n == 0:
        return bytes(1 + 8 * STATES)
    freq = normalize_freqs(np.bincount(sym, minlength=256))
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
    table = table_bytes(freq)
    words: list[int] = []  # renormalisation words in the order the encoder emits them
    x = [RANS_L] * STATES
    for i in range(n - 1, -1, -1):
        s = int(sym[i])
        f, c = int(freq[s]), int(cum[s])
        st = x[i % STATES]
        if st >= ((RANS_L >> PROB_BITS) << 32) * f:
            words.append(st & 0xFFFFFFFF)
            st >>= 32
        x[i % STATES] = ((st // f) << PROB_BITS) + (st % f) + c
    body = b"".join(v.to_bytes(8, "little") for v in x)
    body += b"".join(w.to_bytes(4, "little") for w in reversed(words))
    return table + body


def _ans_decode_py(buf: np.ndarray, n: int) -> np.ndarray:
    data = buf.tobytes()
    freq, k = read_table(data)
    if n == 0:
        if sum(freq) or k + 8 * STATES != len(data):
            raise StreamError(ANS_ERRORS[-6])
        return np.empty(0, np.uint8)
    if sum(freq) != PROB_SCALE:
        raise StreamError(ANS_ERRORS[-5])
    cum = [0] * 256
    for s in range(1, 256):
        cum[s] = cum[s - 1] + freq[s - 1]
    slot = bytearray(PROB_SCALE)
    for s in range(256):
        slot[cum[s]:cum[s] + freq[s]] = bytes([s]) * freq[s]
    if k + 8 * STATES > len(data):
        raise StreamError(ANS_ERRORS[-1])
    if (len(data) - k - 8 * STATES) % 4:
        raise StreamError(ANS_ERRORS[-6])
    x = [int.from_bytes(data[k + 8 * j:k + 8 * j + 8], "little") for j in range(STATES)]
    p = k + 8 * STATES
    if min(x) < RANS_L:
        raise StreamError(ANS_ERRORS[-6])
    out = bytearray(n)
    mask = PROB_SCALE - 1
    for i in range(n):
        st = x[i % STATES]
        sl = st & mask
        s = slot[sl]
        out[i] = s
        st = freq[s] * (st >> PROB_BITS) + sl - cum[s]
        if st < RANS_L:
            if p + 4 > len(data):
                raise StreamError(ANS_ERRORS[-1])
            st = (st << 32) | int.from_bytes(data[p:p + 4], "little")
            p += 4
        x[i % STATES] = st
    if p != len(data) or x != [RANS_L] * STATES:
        raise StreamError(ANS_ERRORS[-6])
    return np.frombuffer(bytes(out), dtype=np.uint8)
