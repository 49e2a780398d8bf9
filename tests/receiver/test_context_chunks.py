"""Context-coded chunks (codec/context.py: positions coded by classes of the old value's
exponent) reaching receivers that decode without their old bits: refused by name, nothing
applied. And a decoder given other old bits than the sender's decodes other positions, which
the version record's digests refuse: no receiver applies a context chunk silently wrong."""

from __future__ import annotations

import pytest
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.core.delta import take_delta
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol import commit, upload
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.tensors import adam_like, same_bits


def _publish_context_coded(store, old: torch.Tensor, new: torch.Tensor) -> int:
    """Version 1 (old -> new) with context-coded chunks; returns how many chunks were."""
    base = old.clone()
    d = take_delta(new, base, keep_new=True)
    terms = [0, 0]
    chunks = codec.encode_delta("w", d, span=1 << 13, terms=terms, old=old)
    w = upload.RankWriter(store, 1, 0, 0, 1)
    for c in chunks:
        w.add(c)
    w.finish(d.numel, d.count, {"w": digest.move(digest.sum64(old), terms)})
    rec = commit.seal_version(store, 1, 0, 1, timeout=10)
    commit.run_commit(store, rec, commit.CommitPolicy())
    return sum(codec.parse_header(c).classes > 0 for c in chunks)


def test_a_receiver_without_old_bits_refuses_a_context_chunk_by_name(tmp_path):
    store = FileStore(tmp_path)
    old, new = adam_like(1 << 15, 3e-4, 0)
    commit.write_keyframe(store, 0, {"w": old})
    assert _publish_context_coded(store, old, new) > 0
    held = {"w": old.clone()}
    with pytest.raises(codec.ChunkError, match="'w' is context-coded: decoding it needs the receiver's old bits"):
        Follower(store, held).apply_version(1)
    assert same_bits(held, {"w": old})  # nothing applied


def test_other_old_bits_decode_other_positions_and_the_digests_refuse_them(tmp_path):
    """Decoded with the sender's old bits, the chunks give the new tensor; with a receiver's
    bits that differ (one value), positions shift and the applied result misses the record's
    digest: the check every receiver runs after an apply refuses it."""
    store = FileStore(tmp_path)
    old, new = adam_like(1 << 15, 3e-4, 1)
    commit.write_keyframe(store, 0, {"w": old})
    _publish_context_coded(store, old, new)
    rec = commit.read_record(store, 1)
    part = store.get(commit.part_key(1, 0, 0))
    chunks = codec.split_chunks(part)

    def applied(held: torch.Tensor) -> torch.Tensor:
        out = held.clone()
        for c in chunks:
            for dc in codec.decode_parts(c, old=lambda h: held):
                codec.apply_decoded(dc, out.view(-1))
        return out

    right = applied(old)
    assert torch.equal(bits(right), bits(new))
    assert digest.hexd(digest.sum64(right)) == rec["digests"]["w"]
    drifted = old.clone()
    big = int(torch.argmax(old.abs()))  # a large value becomes a tiny one: its exponent class moves
    drifted[big] = torch.tensor(1e-6, dtype=torch.bfloat16)
    wrong = applied(drifted)
    assert digest.hexd(digest.sum64(wrong)) != rec["digests"]["w"]
