"""Chunk codec: exact round trips against the new tensor (the oracle), every coding mode,
compiled vs reference streams, corrupt/truncated/hostile chunks refused with nothing written."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import ChunkError, GapMode, Kind, Layout, ValueMode, streams
from nemo_dcr_callback.core import bitops, delta
from nemo_dcr_callback.core.rawbits import bits
from tests.helpers.tensors import FLOAT_DTYPES, perturb, random_tensor

SHAPES = [(), (1,), (5,), (63,), (130, 7), (1000,), (3, 0)]
RATES = [0.0, "one", 0.01, 0.5, 1.0]


def _pair(shape, dtype, rate, seed, specials=True):
    g = torch.Generator().manual_seed(seed)
    old = random_tensor(shape, dtype, g, specials=specials)
    if rate == "one":
        new = old.clone()
        if new.numel():
            bits(new).view(-1)[-1] ^= 1
    else:
        new = perturb(old, rate, g, specials=specials)
    return old, new


def _round_trip(old, new, span=codec.DEFAULT_CHUNK_SPAN, **kw):
    base = old.clone()
    d = delta.take_delta(new, base, keep_new=True)
    chunks = codec.encode_delta("w", d, span=span, **kw)
    target = old.clone().reshape(-1)
    for c in chunks:
        codec.apply_chunk(c, target, "w")
    return chunks, target.reshape(new.shape)


@given(shape=st.sampled_from(SHAPES), dtype=st.sampled_from(FLOAT_DTYPES + [torch.int8, torch.float64]),
       rate=st.sampled_from(RATES), seed=st.integers(0, 2**31), span=st.sampled_from([7, 64, 1 << 24]))
@settings(max_examples=200, deadline=None)
def test_round_trip_exact(shape, dtype, rate, seed, span):
    old, new = _pair(shape, dtype, rate, seed)
    chunks, out = _round_trip(old, new, span=span)
    assert torch.equal(bits(out), bits(new))
    assert codec.tensor_digest(out) == codec.tensor_digest(new)
    if rate == 0.0:
        assert chunks == []


@pytest.mark.parametrize("vm", [ValueMode.RAW, ValueMode.ULP])
@pytest.mark.parametrize("layout", [Layout.TOKENS, Layout.PLANES])
@pytest.mark.parametrize("gm", [GapMode.GAP8, GapMode.GAP16])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rate", [0.001, 0.03, 0.6])
def test_every_forced_coding(vm, layout, gm, dtype, rate):
    old, new = _pair((20011,), dtype, rate, 11)
    base = old.clone()
    d = delta.take_delta(new, base, keep_new=True)
    c = codec.encode_chunk("w", Kind.XOR, dtype, d.numel, 0, d.numel, d.positions, d.xor, d.new,
                           value_modes=(vm,), layouts=(layout,), gap_modes=(gm,))
    h = codec.parse_header(c)
    assert (h.value_mode, h.layout, h.gap_mode) == (vm, layout, gm)
    target = old.clone()
    codec.apply_chunk(c, target)
    assert torch.equal(bits(target), bits(new))


def test_reference_and_compiled_interoperate(monkeypatch):
    """Chunks written by one implementation decode with the other, to the same bits."""
    from nemo_dcr_callback.core import kernels
    old, new = _pair((5000,), torch.bfloat16, 0.05, 5)
    nat_chunks, nat_out = _round_trip(old, new, span=2048)
    native = kernels.native
    monkeypatch.setattr(kernels, "native", lambda: None)
    ref_chunks, ref_out = _round_trip(old, new, span=2048)
    assert nat_chunks == ref_chunks  # byte-identical encoders
    t = old.clone()
    for c in nat_chunks:
        codec.apply_chunk(c, t)
    assert torch.equal(bits(t), bits(new))
    monkeypatch.setattr(kernels, "native", native)
    t = old.clone()
    for c in ref_chunks:
        codec.apply_chunk(c, t)
    assert torch.equal(bits(t), bits(new)) and torch.equal(bits(ref_out), bits(nat_out))


@given(dtype=st.sampled_from(FLOAT_DTYPES), rate=st.sampled_from([0.00005, 0.0005, 0.004, 0.05, 0.6, 1.0]),
       seed=st.integers(0, 2**31), pos64=st.booleans(), specials=st.booleans())
@settings(max_examples=80, deadline=None)
def test_fused_encoder_matches_the_generic_path(dtype, rate, seed, pos64, specials):
    """The compiled single-call XOR encoder (gaps, tokens, rANS, digest terms) writes the
    chunk the stream-by-stream path writes, byte for byte, and the digest terms it adds are
    update_xor's; the chunk decodes to the new bits. Rates cover GAP16 and both-gap-mode
    chunks (sparse) and many escapes (the fused call hands the values back)."""
    from nemo_dcr_callback.codec import digest

    old, new = _pair((70001,), dtype, rate, seed, specials=specials)
    d = delta.take_delta(new, old.clone(), keep_new=True)
    if d.count == 0:
        return
    pos = d.positions.to(torch.int64 if pos64 else torch.int32)
    terms = [0, 0]
    fused = codec.encode_chunk("w", Kind.XOR, dtype, d.numel, 0, d.numel, pos, d.xor, d.new, terms=terms)
    generic = codec.encode_chunk("w", Kind.XOR, dtype, d.numel, 0, d.numel, pos, d.xor, d.new,
                                 value_modes=(ValueMode.RAW, ValueMode.ULP))
    assert fused == generic
    assert digest.move(12345, terms) == digest.update_xor(12345, pos, d.new, d.xor)
    target = old.clone()
    codec.apply_chunk(fused, target)
    assert torch.equal(bits(target), bits(new))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pos64", [False, True])
def test_fused_encoder_vector_and_scalar_paths_agree(monkeypatch, dtype, pos64):
    """The AVX-512 first pass of the fused encoder (16-bit floats, where the CPU has it) and
    the portable loop write the same chunk and digest terms: dense and sparse changes, gaps
    of 255 and more inside a block of 16 (the block's scalar fallback), escapes, counts that
    are not a multiple of 16, NaN/Inf/-0.0."""

    cases = [_pair((70001,), dtype, rate, seed, specials=True)
             for seed, rate in [(1, 0.05), (2, 0.004), (3, 0.6), (4, 0.0005), (5, 1.0)]]
    # gaps at the GAP8 boundaries (254 is one byte, 255 two: 255 then 0), placed in blocks
    rng = np.random.default_rng(7)
    gaps = rng.integers(0, 40, 4000)
    gaps[rng.choice(4000, 300, replace=False)] = rng.choice([254, 255, 256, 509, 510, 511, 5000], 300)
    old = random_tensor((int(gaps.sum()) + 4000 + 10,), dtype, torch.Generator().manual_seed(8), specials=True)
    new = old.clone()
    at = torch.from_numpy(np.cumsum(gaps + 1) - 1)
    step = rng.choice([-300, -3, -2, -1, 1, 2, 3, 300], 4000, p=[0.01, 0.1, 0.2, 0.19, 0.19, 0.2, 0.1, 0.01])
    bits(new)[at] += torch.from_numpy(step).to(torch.int16)  # a few ulps up or down (the ULP coding wins)
    cases.append((old, new))
    for old, new in cases:
        d = delta.take_delta(new, old.clone(), keep_new=True)
        pos = d.positions.to(torch.int64 if pos64 else torch.int32)
        for s, e in [(0, d.count), (0, d.count - d.count % 16), (3, d.count - 5)]:
            if e <= s:
                continue
            lo, hi = int(pos[s]), int(pos[e - 1]) + 1
            out = []
            for env in (None, "1"):
                if env:
                    monkeypatch.setenv("NEMO_DCR_NO_AVX512", env)
                else:
                    monkeypatch.delenv("NEMO_DCR_NO_AVX512", raising=False)
                terms = [0, 0]
                out.append((codec.encode_chunk("w", Kind.XOR, dtype, d.numel, lo, hi, pos[s:e], d.xor[s:e],
                                               d.new[s:e], terms=terms), terms))
            assert out[0] == out[1], (d.count, s, e)


def test_fused_encoder_scratch_is_per_thread():
    """The fused path writes into reusable per-thread buffers: chunks of different sizes
    encoded by four threads at once (as the relay bench's senders and a thread worker do) are
    the chunks, and digest terms, each gives alone."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    for i, rate in enumerate([0.002, 0.05, 0.3, 0.01, 0.6, 0.0005, 0.1, 0.02]):
        old, new = _pair((20000 + 7919 * i,), torch.bfloat16, rate, 100 + i)
        jobs.append(delta.take_delta(new, old.clone(), keep_new=True))

    def enc(d):
        terms = [0, 0]
        out = codec.encode_chunk("w", Kind.XOR, d.dtype, d.numel, 0, d.numel, d.positions, d.xor, d.new,
                                 terms=terms)
        return out, terms

    alone = [enc(d) for d in jobs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            assert list(pool.map(enc, jobs * 3)) == alone * 3


def test_fused_encoder_refuses_unsorted_positions():
    old, new = _pair((5000,), torch.bfloat16, 0.05, 3)
    d = delta.take_delta(new, old.clone(), keep_new=True)
    pos = d.positions.clone()
    pos[[3, 4]] = pos[[4, 3]]
    with pytest.raises(ValueError, match="not sorted"):
        codec.encode_chunk("w", Kind.XOR, torch.bfloat16, d.numel, 0, d.numel, pos, d.xor, d.new, terms=[0, 0])


@given(n=st.integers(0, 3000), k=st.integers(1, 256), seed=st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_rans_compiled_matches_python(n, k, seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(k, 0.3))
    sym = rng.choice(k, size=n, p=p).astype(np.uint8)
    a = streams.ans_encode(sym)
    assert a == streams._ans_encode_py(sym)
    assert np.array_equal(streams.ans_decode(a, n), sym)
    assert np.array_equal(streams._ans_decode_py(np.frombuffer(a, np.uint8), n), sym)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_ulp_compiled_matches_reference(dtype):
    old, new = _pair((9000,), dtype, 0.3, 2)
    d = delta.take_delta(new, old.clone(), keep_new=True)
    assert torch.equal(streams.ulp_encode(d.xor, d.new), bitops.ulp_diff_reference(d.new ^ d.xor, d.new))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.int8])
def test_overwrite_chunks_are_idempotent(dtype):
    old, new = _pair((3001,), dtype, 0.2, 4)
    d = delta.take_delta(new, old.clone())
    chunks = codec.encode_overwrite("w", new, d.positions, span=1000)
    t = old.clone()
    for _ in range(2):  # a retry replays the same chunks: still exact
        for c in chunks:
            codec.apply_chunk(c, t, "w")
        assert torch.equal(bits(t), bits(new))
    dense = codec.encode_overwrite("w", new)  # keyframe: every position
    t = torch.zeros_like(new)
    for c in dense:
        codec.apply_chunk(c, t)
    assert torch.equal(bits(t), bits(new))


def test_ulp_coding_is_smaller_on_adam_like_deltas():
    from nemo_dcr_callback.recipes import synthetic
    pol = synthetic.make_policy(1 << 20, seed=1)
    lr = pol.lr_for_rate(0.03)
    k = next(n for n in pol.master if "mlp" in n)
    old = pol.master[k].to(torch.bfloat16)
    new = (pol.master[k] - lr * pol.direction[k]).to(torch.bfloat16)
    d = delta.take_delta(new, old.clone(), keep_new=True)
    raw = sum(map(len, codec.encode_delta(k, d, value_modes=(ValueMode.RAW,))))
    auto = codec.encode_delta(k, d)
    assert codec.parse_header(auto[0]).value_mode == ValueMode.ULP
    assert sum(map(len, auto)) < 0.95 * raw


# ------------------------------------------------------------------ refusals
def _chunk():
    old, new = _pair((4000,), torch.bfloat16, 0.05, 9)
    d = delta.take_delta(new, old.clone(), keep_new=True)
    return old, new, codec.encode_delta("layer.w", d)[0]


def _refused(buf, target, name="layer.w", match=None):
    before = bits(target).clone()
    with pytest.raises(ChunkError, match=match):
        codec.apply_chunk(buf, target, name)
    assert torch.equal(bits(target), before)


def test_corrupt_chunk_refused_target_untouched():
    old, _, c = _chunk()
    for i in [0, 5, 20, len(c) // 2, len(c) - 1]:
        bad = bytearray(c)
        bad[i] ^= 0x40
        _refused(bytes(bad), old.clone())


def test_truncated_chunk_refused():
    old, _, c = _chunk()
    for n in [0, 3, 40, len(c) // 2, len(c) - 1]:
        _refused(c[:n], old.clone())
    _refused(c + b"\0", old.clone())


def test_wrong_tensor_refused():
    old, _, c = _chunk()
    _refused(c, old.clone(), name="other.w", match="not 'other.w'")
    _refused(c, torch.zeros(4001, dtype=torch.bfloat16), match="spans 4000")
    _refused(c, torch.zeros(4000, dtype=torch.float16), match="BF16")


def test_wrong_version_refused():
    old, _, c = _chunk()
    bad = bytearray(c)
    struct.pack_into("<H", bad, 4, 99)
    body = bytes(bad[:-8])
    bad[-8:] = struct.pack("<Q", codec.checksum(body))
    _refused(bytes(bad), old.clone(), match="version 99")


def _resum(b: bytearray) -> bytes:
    b[-8:] = struct.pack("<Q", codec.checksum(bytes(b[:-8])))
    return bytes(b)


@given(data=st.data())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fuzz_decoder_never_writes_out_of_bounds(data):
    """Mutated chunks with a valid checksum (so the decoder's own checks are what stands)
    and random bytes: only ChunkError, and nothing outside the target is ever touched."""
    old, new, c = _FUZZ
    guard = 64
    arena = torch.zeros(old.numel() + 2 * guard, dtype=torch.bfloat16)
    bits(arena).fill_(0x5A5A)
    target = arena[guard:guard + old.numel()]
    target.copy_(old)
    kind = data.draw(st.sampled_from(["flip", "splice", "random", "header"]))
    b = bytearray(c)
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(b) - 9))
            b[i] = data.draw(st.integers(0, 255))
        buf = _resum(b)
    elif kind == "header":
        i = data.draw(st.integers(0, min(len(b) - 9, 140)))
        b[i:i + 8] = data.draw(st.binary(min_size=8, max_size=8))
        buf = _resum(b)
    elif kind == "splice":
        i = data.draw(st.integers(0, len(b) - 9))
        j = data.draw(st.integers(i, len(b) - 8))
        b = b[:i] + data.draw(st.binary(max_size=64)) + b[j:]
        buf = _resum(b) if len(b) >= 8 else bytes(b)
    else:
        buf = data.draw(st.binary(max_size=512))
    try:
        codec.apply_chunk(buf, target)
    except ChunkError:
        assert torch.equal(bits(target), bits(old))  # refused: nothing written
    else:
        pass  # a mutation can still be a valid chunk for this tensor; it was bounds-checked
    assert bool((bits(arena[:guard]) == 0x5A5A).all()) and bool((bits(arena[-guard:]) == 0x5A5A).all())


def _fuzz_case():
    old, new = _pair((3000,), torch.bfloat16, 0.05, 21)
    d = delta.take_delta(new, old.clone(), keep_new=True)
    return old, new, codec.encode_delta("w", d)[0]


_FUZZ = _fuzz_case()


def test_fuzz_every_stream_mode_with_reference(reference_only):
    """The numpy/Python decoders refuse the same hostile inputs (spot checks)."""
    old, _, c = _FUZZ
    for i in range(60, len(c) - 8, max(1, (len(c) - 68) // 40)):
        b = bytearray(c)
        b[i] ^= 0xFF
        buf = _resum(b)
        t = old.clone()
        try:
            codec.apply_chunk(buf, t)
        except ChunkError:
            assert torch.equal(bits(t), bits(old))


def test_zstd_stream_declaring_a_huge_size_is_refused_not_allocated():
    """Found by the fuzz test in CI: a zstd frame whose header declares an enormous content
    size (checksum valid) must be a ChunkError naming it, not a MemoryError."""
    old, _, c = _FUZZ
    h = codec.parse_header(c)
    off = h.payload_offset
    for _raw, stored, kind in h.streams:
        if kind == codec.ZSTD:
            break
        off += stored
    else:
        pytest.skip("no zstd stream in this chunk")
    b = bytearray(c)
    b[off + 4:off + 13] = b"\xe0" + struct.pack("<Q", 1 << 40)  # single segment, 8-byte content size: 1 TB
    target = old.clone()
    with pytest.raises(ChunkError, match="declares 1099511627776 bytes"):
        codec.apply_chunk(_resum(b), target)
    assert torch.equal(bits(target), bits(old))


@pytest.mark.parametrize("idt", [torch.int32, torch.int64])
@pytest.mark.parametrize("rate", [0.002, 0.03, 0.5, 1.0])
def test_gap8_decoder_equals_the_numpy_reference(idt, rate):
    """The compiled GAP8 decoder (16 gaps a block with AVX-512 for int32 positions, 8 a block,
    one at a time at escapes and near the end of the range) against the numpy reference, on
    streams with escapes (gaps of 255 and more, some exact multiples) and positions that run
    up to the last element of the range; then the same stream cut short or with a gap too
    many is refused by both."""
    from nemo_dcr_callback.codec.streams import StreamError, _decode_gaps_py, decode_gaps, encode_gaps

    g = torch.Generator().manual_seed(int(rate * 1000))
    lo, span = 1000, 200_000
    mask = torch.rand(span, generator=g) < rate
    mask[-3000:] |= torch.rand(3000, generator=g) < 0.5  # dense again right below hi
    mask[[5000, 5000 + 256, 5000 + 256 + 511, span - 1]] = True
    mask[5001:5000 + 256] = False  # a gap of exactly 255: one escape, then 0
    mask[5257:5000 + 256 + 511] = False  # 510 = 2 x 255: two escapes, then 0
    pos = (mask.nonzero().flatten() + lo).to(idt)
    hi = lo + span
    stream = encode_gaps(pos, lo, hi, GapMode.GAP8)
    got = decode_gaps(stream, GapMode.GAP8, pos.numel(), lo, hi, idt)
    want = _decode_gaps_py(stream, GapMode.GAP8, pos.numel(), lo, hi)
    assert got.dtype == idt and torch.equal(got.to(torch.int64), want) and torch.equal(got, pos)
    for bad in (stream[:-1], np.concatenate([stream, [7]])):  # truncated / trailing bytes
        with pytest.raises(StreamError):
            decode_gaps(bad, GapMode.GAP8, pos.numel(), lo, hi, idt)
        with pytest.raises(StreamError):
            _decode_gaps_py(bad, GapMode.GAP8, pos.numel(), lo, hi)
    with pytest.raises(StreamError, match="out of range"):  # the same gaps in a shorter range
        decode_gaps(stream, GapMode.GAP8, pos.numel(), lo, hi - 1, idt)
