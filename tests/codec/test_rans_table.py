"""rANS frequency tables: format 3's compact table (docs/FORMAT.md) read the same by the
compiled and the Python decoder, hostile tables refused by both with the same error, and a
format 2 stream rewritten into format 3's table without changing what it decodes to."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_dcr_callback.codec import streams
from nemo_dcr_callback.codec.streams import PROB_SCALE, StreamError

ERRORS = streams.ANS_ERRORS


def _sym(seed: int, n: int = 5000, k: int = 40, with_255: bool = True) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sym = rng.geometric(0.08, n).clip(0, k - 1).astype(np.uint8)
    if with_255:
        sym[rng.choice(n, n // 50, replace=False)] = 255
    return sym


def _both(data: bytes, n: int):
    """What each decoder makes of data: the symbols, or its error message."""
    out = []
    for dec in (lambda: streams.ans_decode(data, n), lambda: streams._ans_decode_py(np.frombuffer(data, np.uint8), n)):
        try:
            out.append(dec().tobytes())
        except StreamError as exc:
            out.append(str(exc))
    return out


def _format2(stream: bytes) -> bytes:
    """The same stream with format 2's table (32-byte bitmap, u16 per present symbol)."""
    freq, k = streams.read_table(stream)
    bitmap, table = bytearray(32), bytearray()
    for s, f in enumerate(freq):
        if f:
            bitmap[s >> 3] |= 1 << (s & 7)
            table += f.to_bytes(2, "little")
    return bytes(bitmap) + bytes(table) + stream[k:]


@pytest.mark.parametrize("with_255", [True, False])
def test_compact_table_is_smaller_and_decodes(with_255):
    sym = _sym(1, with_255=with_255)
    a = streams.ans_encode(sym)
    freq, k = streams.read_table(a)
    present = sum(1 for f in freq if f)
    assert k < 32 + 2 * present  # format 2's table
    assert k <= 1 + 5 + 2 * present and (freq[255] > 0) == with_255
    assert _both(a, sym.size) == [sym.tobytes()] * 2


def test_only_symbol_255_and_every_symbol():
    for sym in (np.full(100, 255, np.uint8), np.arange(256, dtype=np.uint8).repeat(3)):
        a = streams.ans_encode(sym)
        assert a == streams._ans_encode_py(sym)
        assert _both(a, sym.size) == [sym.tobytes()] * 2
    assert streams.ans_encode(np.full(100, 255, np.uint8))[0] == 0x80  # no bitmap at all


def _with_table(stream: bytes, table: bytes) -> bytes:
    return table + stream[streams.read_table(stream)[1]:]


@pytest.mark.parametrize("case", ["reserved bit", "bitmap too long", "255 in the bitmap", "frequency too large",
                                  "frequencies short of the scale", "table cut", "two-byte frequency cut"])
def test_hostile_tables_are_refused_by_both_decoders(case):
    sym = _sym(2, n=800, k=12)
    a = streams.ans_encode(sym)
    freq, k = streams.read_table(a)
    first = a[0]
    if case == "reserved bit":
        bad = bytes([first | 0x40]) + a[1:]
    elif case == "bitmap too long":
        bad = bytes([(first & 0x80) | 33]) + a[1:]
    elif case == "255 in the bitmap":  # symbol 255 is flagged in the first byte only
        bad = bytes([(first & 0x80) | 32]) + bytes(31) + b"\x80" + a[k:]
    elif case == "frequency too large":  # 4096 as a frequency - 1: more than the scale
        nb = first & 0x3F
        bad = a[:1 + nb] + bytes([0x80, PROB_SCALE >> 7]) + a[1 + nb + 1:]
    elif case == "frequencies short of the scale":
        f = freq.copy()
        top = max(range(256), key=lambda s: f[s])
        f[top] -= 1
        bad = _with_table(a, streams.table_bytes(np.array(f)))
    elif case == "table cut":
        bad = a[:2]
    else:  # the table's last frequency needs two bytes and only one is there
        bad = bytes([1, 1, 0x80 | 0x7F])
    got = _both(bad, sym.size)
    assert got[0] == got[1] and got[0] in ERRORS.values(), got
    assert got[0] == (ERRORS[-1] if "cut" in case else ERRORS[-5])


def test_format2_stream_is_rewritten_to_the_same_symbols():
    sym = _sym(3)
    a = streams.ans_encode(sym)
    old = _format2(a)
    assert len(old) > len(a)
    assert streams.from_format2(old).tobytes() == a
    assert np.array_equal(streams.ans_decode(streams.from_format2(old), sym.size), sym)
    with pytest.raises(StreamError, match="truncated"):
        streams.from_format2(old[:40])
    bad = bytearray(old)
    bad[32:34] = (0).to_bytes(2, "little")  # a present symbol of frequency 0
    with pytest.raises(StreamError, match="frequency table"):
        streams.from_format2(bytes(bad))
