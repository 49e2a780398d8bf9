"""Format version 2: compact headers and batched chunks (issue 35).

The oracle is the new tensors themselves: every round trip must land on their bits. The bad
inputs are crafted with valid checksums (re-assembled), as a buggy or hostile writer would
make them, and each must be refused with every target tensor as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import format as fmt
from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.core.delta import take_delta
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.receiver.targets import apply_chunks
from tests.helpers import GOLDEN


def _pair(numel: int, changes: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(numel, generator=g) * 0.02).to(dtype)
    new = old.clone()
    idx = torch.randperm(numel, generator=g)[:changes]
    new[idx] = (new[idx].float() * (1.05 + 0.05 * torch.rand(changes, generator=g))).to(dtype)
    return old, new


def _members(specs, dtype=torch.bfloat16):
    olds, news, members = {}, {}, []
    for i, (numel, changes) in enumerate(specs):
        name = f"model.layers.{i}.post_attention_layernorm.weight"
        old, new = _pair(numel, changes, i, dtype)
        d = take_delta(new, old.clone(), keep_new=True)
        olds[name], news[name] = old, new
        members.append((name, numel, d.positions, d.xor, d.new))
    return olds, news, members


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_batched_chunk_lands_every_member_on_the_new_bits(dtype):
    olds, news, members = _members([(384, 6), (1000, 0), (4096, 300), (7, 7), (50_000, 2000)], dtype)
    members = [m for m in members if m[2].numel()] + [m for m in members if not m[2].numel()]
    chunk = codec.encode_batch(dtype, members)
    h = codec.parse_header(chunk)
    assert h.batched and {p.name for p in h.parts()} == set(olds)
    state = {k: v.clone() for k, v in olds.items()}
    assert apply_chunks(state, [chunk]) == sum(m[2].numel() for m in members)
    for k in olds:
        assert torch.equal(bits(state[k]), bits(news[k])), k


def test_batch_is_smaller_than_a_chunk_per_tensor():
    _, _, members = _members([(384, 6)] * 40 + [(2048, 40)] * 40)
    one = sum(len(codec.encode_chunk(n, codec.Kind.XOR, torch.bfloat16, numel, 0, numel, p, x, nv))
              for n, numel, p, x, nv in members)
    batch = len(codec.encode_batch(torch.bfloat16, members))
    assert batch < 0.6 * one, (batch, one)


def test_small_chunk_header_is_compact():
    """A 384-element norm with 6 changes cost 209 bytes in format 1."""
    old, new = _pair(384, 6, 0)
    d = take_delta(new, old.clone(), keep_new=True)
    (c,) = codec.encode_delta("model.layers.0.input_layernorm.weight", d)
    assert len(c) < 100, len(c)
    t = old.clone()
    codec.apply_chunk(c, t, "model.layers.0.input_layernorm.weight")
    assert torch.equal(bits(t), bits(new))


def _reassemble(chunk: bytes, table: bytes, m: int | None = None) -> bytes:
    """chunk with its member table replaced (stored) and a valid checksum."""
    h = codec.parse_header(chunk)
    streams, off = [], h.payload_offset
    for raw, stored, c in h.streams:
        streams.append((raw, bytes(chunk[off:off + stored]), c))
        off += stored
    return fmt.assemble_chunk("", h.kind, h.dtype, h.gap_mode, h.value_mode, h.layout, h.numel, h.lo, h.hi, h.count,
                              streams, members=(m if m is not None else len(h.members), table, fmt.STORED, len(table)))


def _entry(prefix: int, suffix: bytes, numel: int, count: int) -> bytes:
    return fmt.varint(prefix) + fmt.varint(len(suffix)) + suffix + fmt.varint(numel) + fmt.varint(count)


def _refused(chunk: bytes, olds: dict, says: str) -> None:
    state = {k: v.clone() for k, v in olds.items()}
    with pytest.raises(codec.ChunkError, match=says):
        apply_chunks(state, [chunk])
    for k in olds:
        assert torch.equal(bits(state[k]), bits(olds[k])), k  # nothing written


def _two():
    """Two tensors of 300 elements with 10 changes each, in one batch."""
    olds, _, members = _members([(300, 10), (300, 10)])
    for _, _, p, _, _ in members:
        assert p.numel() == 10
    return olds, members, codec.encode_batch(torch.bfloat16, members)


def test_corrupt_member_table_is_refused():
    olds, members, chunk = _two()
    a, b = (m[0].encode() for m in members)
    k = next(i for i in range(len(a)) if a[i] != b[i])  # the shared prefix
    good = _entry(0, a, 300, 10) + _entry(k, b[k:], 300, 10)
    assert codec.parse_header(_reassemble(chunk, good)).members[1].name == members[1][0]  # the crafting is honest
    _refused(_reassemble(chunk, good[:-3]), olds, "corrupt member table")  # cut inside an entry
    _refused(_reassemble(chunk, good + b"\x00"), olds, "trailing bytes")
    _refused(_reassemble(chunk, _entry(0, a, 300, 10) + _entry(0, a, 300, 10)), olds, "named twice")
    _refused(_reassemble(chunk, _entry(0, a, 300, 10) + _entry(0, b, 301, 10)), olds, "covers 601 elements")
    _refused(_reassemble(chunk, _entry(0, b"\xff\xfe", 300, 10) + _entry(0, b, 300, 10)), olds, "not UTF-8")


def test_member_name_reference_out_of_range_is_refused():
    """A member names itself by a prefix of the name before it: a prefix longer than that
    name (an id into the table beyond its end) is refused."""
    olds, members, chunk = _two()
    a, b = (m[0].encode() for m in members)
    _refused(_reassemble(chunk, _entry(0, a, 300, 10) + _entry(len(a) + 5, b"x", 300, 10)), olds, "refers to")
    _refused(_reassemble(chunk, _entry(3, a, 300, 10) + _entry(0, b, 300, 10)), olds, "refers to")
    _refused(_reassemble(chunk, _entry(0, a, 300, 10), m=2), olds, "ends inside entry 1")


def test_batched_chunk_truncated_mid_tensor_is_refused():
    olds, members, chunk = _two()
    for cut in (len(chunk) // 2, len(chunk) - 9, 20):
        _refused(chunk[:cut], olds, "checksum|truncated")
    with pytest.raises(codec.ChunkError, match="truncated|runs past"):
        codec.split_chunks(chunk[:len(chunk) - 20])
    # the counts say the first tensor's changes end one later than its positions do
    a, b = (m[0].encode() for m in members)
    _refused(_reassemble(chunk, _entry(0, a, 300, 11) + _entry(0, b, 300, 9)), olds, "declares 11 changes")


def test_a_batch_is_not_applied_as_one_tensor():
    olds, _, chunk = _two()
    with pytest.raises(codec.ChunkError, match="batched"):
        codec.apply_chunk(chunk, next(iter(olds.values())).clone())
    with pytest.raises(codec.ChunkError, match="batched"):
        codec.decode_chunk(chunk)


def test_format_1_chunk_is_refused_by_version():
    data = (GOLDEN / "delta_v1.dcr").read_bytes()
    v1 = data[8:]  # the first chunk starts after the file header
    with pytest.raises(codec.ChunkError, match="unsupported chunk format version 1"):
        codec.parse_header(v1[:200])
    with pytest.raises(codec.ChunkError, match="version 1"):
        codec.chunk_end(memoryview(v1), 0)


def test_apply_all_lands_batches_and_single_chunks_in_any_order():
    """apply_all writes runs of a batch's members in one compiled call, from the batch's
    arrays; mixed with one-tensor chunks and with the members out of order it must still
    land every tensor on the new bits (the oracle: the new tensors)."""
    olds, news, members = _members([(384, 6), (4096, 300), (7, 7), (2048, 40), (50_000, 2000)])
    batch = codec.encode_batch(torch.bfloat16, members[:4])
    n, numel, pos, xor, nv = members[4]
    singles = codec.encode_delta(n, take_delta(news[n], olds[n].clone(), keep_new=True), span=16384)
    assert len(singles) > 1
    decoded = codec.decode_parts(batch) + [d for c in singles for d in codec.decode_parts(c)]
    decoded = decoded[2:3] + decoded[:2] + decoded[3:][::-1]  # runs split and reordered
    state = {k: v.clone() for k, v in olds.items()}
    codec.apply_all(decoded, [state[d.header.name] for d in decoded])
    for k in olds:
        assert torch.equal(bits(state[k]), bits(news[k])), k


def test_scatter_many_refuses_a_bad_member_before_writing_any():
    from nemo_dcr_callback.core.bitops import scatter_many
    from nemo_dcr_callback.core.rawbits import OP_XOR

    targets = [torch.zeros(100, dtype=torch.int16) for _ in range(3)]
    ones = torch.ones(3, dtype=torch.int16)
    items = [(targets[0], torch.tensor([1, 5, 9], dtype=torch.int32), ones, OP_XOR),
             (targets[1], torch.tensor([2, 50, 99], dtype=torch.int32), ones, OP_XOR),
             (targets[2], torch.tensor([3, 60, 100], dtype=torch.int32), ones, OP_XOR)]  # 100: out of range
    with pytest.raises(ValueError, match="out of range"):
        scatter_many(items)
    assert all(int(t.abs().sum()) == 0 for t in targets)
    scatter_many(items[:2])
    assert targets[0].tolist()[:10] == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1] and int(targets[1][99]) == 1


_EXPERTS = [f"model.layers.{i // 3}.mlp.experts.{i}.{p}.weight" for i in range(300) for p in ("up_proj", "down_proj")]
TABLES = {  # valid member tables: (name, numel, count) per member
    "600 experts": [(n, 1000 + 37 * i, i % 50) for i, n in enumerate(_EXPERTS)],
    "one member": [("lm_head.weight", 1, 1)],
    "no shared prefixes": [("a", 5, 0), ("zz.w", 300, 300), ("b", 1 << 40, 3)],  # count 0, all, a 6-byte varint
    "a name that extends the last": [("w", 10, 1), ("w.bias", 10, 2), ("w.bias.extra", 10, 3)],
    "utf-8 names": [("couche.poids.é", 9, 4), ("couche.poids.ê", 9, 9), ("层.权重", 2, 1)],
    "names at the limit": [("x" * fmt.MAX_NAME, 7, 1), ("x" * (fmt.MAX_NAME - 1) + "y", 7, 2)],
}
_H = {"kind": codec.Kind.XOR, "dtype": codec.dtype_info(torch.bfloat16), "gm": codec.GapMode.GAP8,
      "vm": codec.ValueMode.RAW, "lay": codec.Layout.TOKENS, "classes": 0,
      "version": codec.FORMAT_VERSION}


def _compiled_members(table: bytes, m: int) -> tuple[int, list[tuple[str, int, int]]]:
    """The compiled parser called directly, as format._members calls it (no Python fallback
    behind it): its return code (0, or -(i + 1) for a bad entry i) and the members it read."""
    lib = kernels.native()
    assert lib is not None
    fields = np.full(5 * m, -1, dtype=np.int64)
    rc = lib.dcr_member_table(table, len(table), m, fmt.MAX_NAME, fields.ctypes.data)
    out, prev = [], b""
    if rc == 0:
        for k, s, off, numel, count in fields.reshape(m, 5).tolist():
            name = prev[:k] + table[off:off + s]
            out.append((name.decode(), numel, count))
            prev = name
    return rc, out


@pytest.mark.parametrize("which", sorted(TABLES))
def test_compiled_member_table_parser_accepts_every_valid_table_and_agrees_with_python(which, monkeypatch):
    """The compiled parser reads the varints; the Python one (used for every refusal, and
    without the kernels) is the reference. format._members falls back to Python whenever the
    compiled parser refuses, so a broken compiled parser would pass through _members: here it
    is called directly and must accept the table and read the same members, and _members
    must return them without falling back."""
    members = TABLES[which]
    table = fmt.member_table(members)
    total, count = sum(m[1] for m in members), sum(m[2] for m in members)
    ref = fmt._members_py(table, len(members), _H, total, count)
    assert [(h.name, h.numel, h.count) for h in ref] == members  # the reference reads what was written
    rc, got = _compiled_members(table, len(members))
    assert rc == 0, f"the compiled parser refused a valid table at entry {-rc - 1}"
    assert got == members
    monkeypatch.setattr(fmt, "_members_py", lambda *a: pytest.fail("format._members fell back to Python"))
    fast = fmt._members(table, len(members), _H, total, count)
    assert fast == ref
    assert [(h.offset, h.hi) for h in fast] == [(h.offset, h.hi) for h in ref]


def test_compiled_member_table_parser_refuses_what_python_refuses():
    """A table cut short is refused by both at the entry it ends in, and one with trailing
    bytes after its last entry; _members then names the problem (the Python parser's error)."""
    members = TABLES["600 experts"]
    table = fmt.member_table(members)
    total, count = sum(m[1] for m in members), sum(m[2] for m in members)
    assert _compiled_members(table[:-1], len(members))[0] == -600  # -(i + 1): entry 599
    with pytest.raises(codec.ChunkError, match="ends inside entry 599"):
        fmt._members(table[:-1], len(members), _H, total, count)
    assert _compiled_members(table + b"\x00", len(members))[0] == -(len(members) + 1)
    with pytest.raises(codec.ChunkError, match="trailing bytes"):
        fmt._members(table + b"\x00", len(members), _H, total, count)
    short = fmt.member_table(members[:2])  # a table of 2 entries read as 3
    assert _compiled_members(short, 3)[0] == -3
    with pytest.raises(codec.ChunkError, match="ends inside entry 2"):
        fmt._members(short, 3, _H, total, count)
