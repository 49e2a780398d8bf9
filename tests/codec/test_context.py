"""Context-modelled coding (issue 35): positions and tokens coded per class of the old value's
exponent. The oracle is the new tensor; the decoder reads the receiver's old bits, so a wrong
base or none at all must be refused, never silently misapplied."""

from __future__ import annotations

import pytest
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import context
from nemo_dcr_callback.codec import format as fmt
from nemo_dcr_callback.core.delta import take_delta
from nemo_dcr_callback.core.rawbits import bits
from tests.helpers.tensors import adam_like


def _chunk(old, new, name="w"):
    d = take_delta(new, old.clone(), keep_new=True)
    plain = codec.encode_delta(name, d)
    ctx = codec.encode_delta(name, d, old=old)
    return d, plain, ctx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_context_coding_is_smaller_and_lands_on_the_new_bits(dtype):
    old, new = adam_like(200_000, 1e-6, 0, dtype)
    d, plain, ctx = _chunk(old, new)
    assert d.count > 1000
    h = codec.parse_header(ctx[0])
    assert h.classes > 1, "the encoder kept the plain coding on data the contexts should win on"
    # (F32 changes nearly everywhere at this step: little for the contexts to find there)
    limit = 0.9 if dtype != torch.float32 else 1.0
    assert sum(map(len, ctx)) < limit * sum(map(len, plain)), (sum(map(len, ctx)), sum(map(len, plain)))
    t = old.clone()
    for c in ctx:
        for dc in codec.decode_parts(c, old=lambda _h: t.view(-1)):
            codec.apply_decoded(dc, t)
    assert torch.equal(bits(t), bits(new))


def test_a_tensor_cut_into_several_context_chunks_lands_on_the_new_bits():
    """Each chunk after a tensor's first starts at its lo: the decoder's walk numbers positions
    within the range (before the fix they landed at lo 0: any tensor over one span, e.g. a
    large embedding in `nemo-dcr diff`, decoded to the wrong positions)."""
    old, new = adam_like(200_000, 1e-6, 7)
    d = take_delta(new, old.clone(), keep_new=True)
    ctx = codec.encode_delta("w", d, span=1 << 16, old=old)
    heads = [codec.parse_header(c) for c in ctx]
    assert len(ctx) == 4 and sum(1 for h in heads if h.classes and h.lo > 0) >= 2  # (the short last one may be plain)
    t = old.clone()
    for c in ctx:
        for dc in codec.decode_parts(c, old=lambda _h: old):
            codec.apply_decoded(dc, t)
    assert torch.equal(bits(t), bits(new))


def test_context_coded_batch_lands_on_the_new_bits():
    pairs = {f"model.layers.{i}.mlp.down_proj.weight": adam_like(3000 + i, 1e-6, i) for i in range(30)}
    members, olds = [], []
    for name, (o, n) in pairs.items():
        d = take_delta(n, o.clone(), keep_new=True)
        members.append((name, o.numel(), d.positions, d.xor, d.new))
        olds.append(o)
    chunk = codec.encode_batch(torch.bfloat16, members, olds=olds)
    h = codec.parse_header(chunk)
    assert h.batched and h.classes
    state = {k: o.clone() for k, (o, _) in pairs.items()}
    for dc in codec.decode_parts(chunk, old=lambda m: state[m.name].view(-1)):
        codec.apply_decoded(dc, state[dc.header.name])
    for k, (_, n) in pairs.items():
        assert torch.equal(bits(state[k]), bits(n)), k


def test_without_the_old_bits_it_is_refused_by_name():
    old, new = adam_like(50_000, 1e-6, 1)
    _, _, ctx = _chunk(old, new, "model.norm.weight")
    t = old.clone()
    with pytest.raises(codec.ChunkError, match="context-coded.*old bits"):
        codec.apply_chunk(ctx[0], t, "model.norm.weight")
    assert torch.equal(bits(t), bits(old))


def test_a_state_dict_decodes_with_its_own_bits():
    """apply_chunks reads the old bits from the tensors it applies to, before any is written."""
    from nemo_dcr_callback.receiver.targets import apply_chunks

    old, new = adam_like(50_000, 1e-6, 1)
    _, _, ctx = _chunk(old, new, "model.norm.weight")
    state = {"model.norm.weight": old.clone()}
    apply_chunks(state, ctx)
    assert torch.equal(bits(state["model.norm.weight"]), bits(new))


def test_old_bits_of_the_wrong_size_are_refused():
    old, new = adam_like(50_000, 1e-6, 2)
    _, _, ctx = _chunk(old, new)
    with pytest.raises(codec.ChunkError, match="spans 50000 positions"):
        codec.decode_parts(ctx[0], old=lambda _h: old[:100].view(-1))


def _restream(chunk: bytes, i: int, data: bytes, raw: int, codec_id: int) -> bytes:
    """chunk with stream i replaced, re-assembled with a valid checksum."""
    h = codec.parse_header(chunk)
    streams, off = [], h.payload_offset
    for raw_len, stored, c in h.streams:
        streams.append((raw_len, bytes(chunk[off:off + stored]), c))
        off += stored
    streams[i] = (raw, data, codec_id)
    return fmt.assemble_chunk(h.name, h.kind, h.dtype, h.gap_mode, h.value_mode, h.layout, h.numel, h.lo, h.hi,
                              h.count, streams, classes=h.classes)


def test_corrupt_class_map_is_refused_with_nothing_decoded():
    old, new = adam_like(50_000, 1e-6, 3)
    _, _, ctx = _chunk(old, new)
    h = codec.parse_header(ctx[0])
    bad = bytes([h.classes + 3]) * context.map_size("BF16")  # every exponent in a class that does not exist
    with pytest.raises(codec.ChunkError, match="class map names class"):
        codec.decode_parts(_restream(ctx[0], 0, bad, len(bad), fmt.STORED), old=lambda _h: old.view(-1))
    # one class's changes moved to another class: the token streams no longer add up
    k = h.classes
    tok = h.streams[1 + k]
    with pytest.raises(codec.ChunkError, match="do not add up"):
        codec.parse_header(_restream(ctx[0], 1 + k, b"\x01" * (tok[0] + 1), tok[0] + 1, fmt.STORED))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_and_numpy_context_decoders_land_on_the_new_bits(dtype, monkeypatch):
    """The compiled walk over the old bits and the numpy sort by class are two decoders of
    the same streams: each must land on the new tensor."""
    old, new = adam_like(80_000, 1e-6 if dtype != torch.float32 else 1e-8, 11, dtype)
    _, _, ctx = _chunk(old, new)
    assert any(codec.parse_header(c).classes for c in ctx)
    for native in (True, False):
        if not native:
            monkeypatch.setattr(context.kernels, "native", lambda: None)
        t = old.clone().view(-1)
        for c in ctx:
            for d in codec.decode_parts(c, old=lambda _h, t=t: t):
                codec.apply_decoded(d, t)
        assert torch.equal(bits(t), bits(new).view(-1)), native


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("source", ["old", "current"])
@pytest.mark.parametrize("walk", ["default", "NEMO_DCR_NO_GFNI"])  # up to 8 classes counted at once, or per class
def test_compiled_and_numpy_context_encoders_make_the_same_chunks(dtype, source, walk, monkeypatch):
    """The fused encoder (dcr_ctx_encode: class choice, walk, streams in one call) and the
    numpy one choose the same classes and write the same bytes, from the old bits or from a
    sender's current ones, with either compiled rank walk; and the chunks land on the new tensor."""
    old, new = adam_like(300_000, 1e-6 if dtype != torch.float32 else 1e-8, 5, dtype)
    d = take_delta(new, old.clone(), keep_new=True)
    kw = {"old": old} if source == "old" else {"current": new}
    if walk != "default":
        monkeypatch.setenv(walk, "1")
    compiled = codec.encode_delta("w", d, span=1 << 17, **kw)
    monkeypatch.setattr(context.kernels, "native", lambda: None)
    numpy_made = codec.encode_delta("w", d, span=1 << 17, **kw)
    monkeypatch.undo()
    assert sum(1 for c in compiled if codec.parse_header(c).classes) >= 2
    assert compiled == numpy_made
    t = old.clone().view(-1)
    for c in compiled:
        for dc in codec.decode_parts(c, old=lambda _h: old.view(-1)):
            codec.apply_decoded(dc, t)
    assert torch.equal(bits(t), bits(new).view(-1))


@pytest.mark.parametrize("lr", [3e-6, 1e-5])  # 17%: more than 8 classes weighed, 8 kept; 32%: more kept
def test_compiled_and_numpy_encoders_agree_on_more_than_8_classes(lr, monkeypatch):
    """More than 8 classes are chosen only where they save WIDE_GAIN of the best estimate
    with at most 8: both encoders apply the rule alike, and it keeps what it should."""
    old, new = adam_like(300_000, lr, 5)
    d = take_delta(new, old.clone(), keep_new=True)
    compiled = codec.encode_delta("w", d, span=1 << 17, old=old)
    monkeypatch.setattr(context.kernels, "native", lambda: None)
    numpy_made = codec.encode_delta("w", d, span=1 << 17, old=old)
    monkeypatch.undo()
    assert compiled == numpy_made
    assert (max(codec.parse_header(c).classes for c in compiled) > 8) == (lr > 5e-6)


def test_current_bits_that_disagree_with_the_new_values_are_refused():
    """A sender whose baseline is not the new tensor would rank positions by classes the
    receiver never sees: the walk checks each changed position's bits and refuses."""
    old, new = adam_like(100_000, 1e-6, 3)
    d = take_delta(new, old.clone(), keep_new=True)
    with pytest.raises(ValueError, match="disagree with the new values"):
        codec.encode_delta("w", d, current=old)


@pytest.mark.parametrize("lr", [1e-7, 3e-6, 1e-5])  # 1% changed, 2-3 classes; 17%, up to 8; over 8
def test_every_compiled_walk_and_numpy_decode_the_same_chunks(lr, monkeypatch):
    """The decoder's walks: each class's ranks as a bitmap deposited onto its lanes, per-class
    compares, every class counted at once (GFNI, up to 8 classes), the compiled default for the
    chunk's density, and the numpy sort by class must land on the new tensor from the same chunks."""
    old, new = adam_like(300_000, lr, 5)
    d = take_delta(new, old.clone(), keep_new=True)
    chunks = codec.encode_delta("w", d, span=1 << 17, old=old)
    ks = [codec.parse_header(c).classes for c in chunks]
    assert (max(ks) <= 8) == (lr < 1e-5), ks
    walks = (({"NEMO_DCR_BITMAP": "1"}, True), ({"NEMO_DCR_NO_BITMAP": "1"}, True),
             ({"NEMO_DCR_NO_BITMAP": "1", "NEMO_DCR_NO_GFNI": "1"}, True), ({}, True), ({}, False))
    for env, native in walks:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        if not native:
            monkeypatch.setattr(context.kernels, "native", lambda: None)
        t = old.clone()
        for c in chunks:
            for dc in codec.decode_parts(c, old=lambda _h: old):
                codec.apply_decoded(dc, t)
        assert torch.equal(bits(t), bits(new)), (env, native)
        monkeypatch.undo()


@pytest.mark.parametrize("walk", ["NEMO_DCR_BITMAP", "NEMO_DCR_NO_BITMAP"])
def test_a_rank_beyond_its_class_is_refused(walk, monkeypatch):
    """A class's gap stream naming a rank past the class's population (which only the walk
    over the old bits knows) is refused, not applied somewhere else, by either compiled walk."""
    from nemo_dcr_callback.codec.streams import GapMode, encode_gaps

    monkeypatch.setenv(walk, "1")

    old, new = adam_like(50_000, 1e-6, 12)
    _, _, ctx = _chunk(old, new)
    h = codec.parse_header(ctx[0])
    assert h.classes > 1
    c = h.streams[1 + h.classes][0]  # class 0's change count (its token stream's length)
    ranks = torch.arange(c, dtype=torch.int64)
    ranks[-1] = h.hi - h.lo - 1  # the range's last position: beyond class 0's population
    gaps = encode_gaps(ranks, 0, h.hi - h.lo, GapMode.GAP8).tobytes()
    bad = _restream(ctx[0], 1, gaps, len(gaps), fmt.STORED)
    with pytest.raises(codec.ChunkError, match="class 0 declares"):
        codec.decode_parts(bad, old=lambda _h: old.view(-1))


@pytest.mark.parametrize("which", ["gaps", "tokens"])
def test_a_corrupt_class_stream_is_refused_by_name(which):
    """The fused decoder (dcr_ctx_decode) undoes each class's rANS itself: a truncated stream
    is refused with the class and the stream named, and nothing is decoded."""
    old, new = adam_like(200_000, 3e-7, 12)
    _, _, ctx = _chunk(old, new)
    h = codec.parse_header(ctx[0])
    first = 1 if which == "gaps" else 1 + h.classes
    j = next(j for j in range(h.classes) if h.streams[first + j][2] == fmt.RANS)  # a rANS-coded class
    i = first + j
    raw, stored, _ = h.streams[i]
    off = h.payload_offset + sum(s[1] for s in h.streams[:i])
    cut = bytes(ctx[0][off:off + stored // 2])  # the table and half the words
    bad = _restream(ctx[0], i, cut, raw, fmt.RANS)
    with pytest.raises(codec.ChunkError, match=f"class {j}'s {'gap' if which == 'gaps' else 'token'} stream"):
        codec.decode_parts(bad, old=lambda _h: old.view(-1))


def test_a_different_base_decodes_to_other_positions_and_the_digest_catches_it(tmp_path):
    """The classes come from the base: against another base the chunk decodes to other
    positions. The delta file's digests refuse the result, with nothing written."""
    from safetensors.torch import save_file

    from nemo_dcr_callback.tools import delta_patch, deltafile

    old, new = adam_like(100_000, 1e-6, 4)
    other, _ = adam_like(100_000, 1e-6, 5)
    for d, t in (("old", old), ("new", new), ("other", other)):
        (tmp_path / d).mkdir()
        save_file({"w": t.view(100, 1000)}, str(tmp_path / d / "model.safetensors"))
    deltafile.diff(tmp_path / "old", tmp_path / "new", tmp_path / "d.dcr", quiet=True)
    df = deltafile.DeltaFile(tmp_path / "d.dcr")
    assert codec.parse_header(df.read([8, df.manifest["chunk_lengths"][0]])).classes  # context-coded
    df.close()
    with pytest.raises(deltafile.DeltaError, match="wrong base"):
        delta_patch.patch(tmp_path / "other", tmp_path / "d.dcr", tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()
    delta_patch.patch(tmp_path / "old", tmp_path / "d.dcr", tmp_path / "out", quiet=True)
    got, want = (tmp_path / d / "model.safetensors" for d in ("out", "new"))
    assert got.read_bytes() == want.read_bytes()


@pytest.mark.parametrize("span", [512, 1 << 24])
@pytest.mark.parametrize("ctx", [True, False])
def test_diff_patch_is_byte_exact_with_batches_and_contexts(tmp_path, span, ctx):
    """A checkpoint of mixed tensors: norms and biases with a few changes (batched), large
    matrices (own chunks, several where a tensor spans more than `span`), F32 and I64."""
    from safetensors.torch import save_file

    from nemo_dcr_callback.tools import delta_patch, deltafile

    old, new = {}, {}
    for i in range(6):
        for part, n, lr in (("norm.weight", 300, 1e-4), ("q_proj.bias", 64, 1e-6), ("q_proj.weight", 40_000, 1e-6),
                            ("mlp.weight", 3000, 1e-5)):
            o, nw = adam_like(n, lr, 100 * i + n)
            old[f"model.layers.{i}.{part}"], new[f"model.layers.{i}.{part}"] = o, nw
    old["scale"], new["scale"] = adam_like(1000, 1e-6, 7, torch.float32)
    old["step"], new["step"] = torch.tensor([3]), torch.tensor([4])
    for d, sd in (("old", old), ("new", new)):
        (tmp_path / d).mkdir()
        save_file(sd, str(tmp_path / d / "model.safetensors"))
    deltafile.diff(tmp_path / "old", tmp_path / "new", tmp_path / "d.dcr", quiet=True, span=span, context=ctx)
    df = deltafile.DeltaFile(tmp_path / "d.dcr")
    heads, off = [], 8
    for n in df.manifest["chunk_lengths"]:
        heads.append(codec.parse_header(df.read([off, n])))
        off += n
    df.close()
    assert any(h.batched for h in heads)
    if ctx and span > 512:  # (512-position chunks are too small for the class tables to pay)
        assert any(h.classes for h in heads)
    if not ctx:
        assert not any(h.classes for h in heads)
    delta_patch.patch(tmp_path / "old", tmp_path / "d.dcr", tmp_path / "out", quiet=True)
    got, want = (tmp_path / d / "model.safetensors" for d in ("out", "new"))
    assert got.read_bytes() == want.read_bytes()
