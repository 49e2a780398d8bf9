"""A receiver streaming a version while it is written, on a real S3 server (SeaweedFS, the
`seaweed` fixture): parts fetched and decoded before the version is sealed, applied in place
early (early=True) or once sealed (early="sealed"), and taken back bit for bit on an abort,
a failed digest check or a stray part. The sender is TensorSender (the sender path over
canonical tensors held whole); the oracle is the old and new tensors themselves."""

from __future__ import annotations

import threading

import pytest
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.core.rawbits import OP_ULP, OP_XOR, bits
from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.testing.tensor_sender import TensorSender
from tests.helpers.s3 import s3_states
from tests.helpers.tensors import same_bits


@pytest.mark.parametrize("early", [True, False, "sealed"])
def test_receiver_streams_a_version_while_it_is_written(s3_store, early):
    """Parts are fetched and decoded before the sender has finished the version; with early
    apply they are also applied in place as they arrive, otherwise (and with early="sealed",
    which waits for the seal) nothing is applied yet."""
    states = s3_states(1)
    s = TensorSender(states[0])
    for n in s.tensors:
        s.tensors[n] = states[1][n]
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(s3_store, tensors, early=early)
    assert f.early == bool(early)
    seen, applied = [], []

    def after_chunk():
        import time

        # parts upload asynchronously: wait (bounded) until this chunk's part has landed; a fixed
        # 0.2 s was too short for the first PUT to a SeaweedFS no earlier test had used
        deadline = time.monotonic() + 10
        while (sum(keys.is_part(k) for k in s3_store.list(commit.vdir(1))) <= len(seen)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        f.poll()  # the version is not sealed: the follower streams what is there
        st = f._parts.get(1)
        if st is not None:  # the fetches run in the store's pool: let them land
            for fut in list(st.pending.values()):
                fut.result()
            st.harvest()
        seen.append(len(st.parts) if st is not None else 0)
        f._apply_early(1)
        applied.append(len(st.applied) if st is not None else 0)
        assert commit.read_record(s3_store, 1) is None
        assert same_bits(tensors, states[0]) == (applied[-1] == 0)

    m = s.write(s3_store, 1, 0, s.take(), part_bytes=1, after_chunk=after_chunk)  # one part per chunk
    assert seen[0] >= 1 and seen == sorted(seen) and seen[-1] == len(m["parts"]) > 1
    assert applied == (seen if early is True else [0] * len(seen))
    commit.run_commit(s3_store, commit.seal_version(s3_store, 1, 0, 1), commit.CommitPolicy())
    f.poll()
    assert f.version == 1 and same_bits(tensors, states[1])


def _stream_early(store, f, old, new, part_bytes=1):
    """Write version 1 from old to new one part per chunk while f streams and applies it early;
    returns the manifest (the version is not sealed)."""
    s = TensorSender(old)
    for n in s.tensors:
        s.tensors[n] = new[n]

    def after_chunk():
        import time

        time.sleep(0.1)
        f.poll()
        st = f._parts.get(1)
        if st is not None:
            for fut in list(st.pending.values()):
                fut.result()
        f._apply_early(1)

    return s.write(store, 1, 0, s.take(), part_bytes=part_bytes, after_chunk=after_chunk)


def test_early_apply_undone_on_abort(s3_store):
    """Parts applied in place while the version streams are taken back, bit for bit, when the
    version is aborted: the receiver holds version 0 exactly."""
    states = s3_states(1)
    name = next(iter(states[1]))  # sign flips: cheapest as XOR, so this tensor's chunk is an XOR one
    old = states[0][name]
    flips = torch.rand(old.numel(), generator=torch.Generator().manual_seed(3)) < 0.03
    states[1][name] = (bits(old) ^ (flips.to(torch.int16) << 15)).view(torch.bfloat16).reshape(old.shape)
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(s3_store, tensors, early=True)
    _stream_early(s3_store, f, states[0], states[1])
    assert f._parts[1].applied and not same_bits(tensors, states[0])  # really applied early
    # both undo ways run: XOR chunks XOR again, ulp chunks add the negated differences
    assert {d.op for d, _ in f._parts[1].undo} == {OP_XOR, OP_ULP}
    rec = commit.seal_version(s3_store, 1, 0, 1)
    commit.decide(s3_store, 1, 0, "abort", [], [], "test")
    assert f.poll() == [] and f.version == 0 and 1 not in f._parts
    assert same_bits(tensors, states[0])
    assert rec["version"] == 1


def test_sealed_apply_before_the_decision_undone_on_abort(s3_store):
    """early="sealed": once the version is sealed the receiver applies what it holds, checks
    the digests and acks, all before the decision; an abort then takes it all back exactly."""
    import time

    states = s3_states(1)
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(s3_store, tensors, receiver_id="worker-0", early="sealed")
    _stream_early(s3_store, f, states[0], states[1])
    assert not f._parts[1].applied and same_bits(tensors, states[0])  # streamed, not applied: not sealed
    commit.seal_version(s3_store, 1, 0, 1)
    out: list = []
    th = threading.Thread(target=lambda: out.append(f.poll()))
    th.start()
    deadline = time.monotonic() + 20
    while not commit.read_acks(s3_store, 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert commit.read_acks(s3_store, 1)["worker-0"]["ok"]
    assert same_bits(tensors, states[1])  # applied (and its digests checked) before any decision
    commit.decide(s3_store, 1, 0, "abort", [], ["worker-0"], "test")
    th.join(20)
    assert out == [[]] and f.version == 0 and same_bits(tensors, states[0])


def test_early_apply_undone_when_the_digests_fail(s3_store):
    """A receiver that does not hold the base (one element off, untouched by the delta) applies
    early, fails the digest check before acking, and ends on exactly the bits it had."""
    states = s3_states(1)
    tensors = {k: t.clone() for k, t in states[0].items()}
    name = next(iter(tensors))
    flat = bits(tensors[name]).view(-1)
    changed = (bits(states[0][name]) != bits(states[1][name])).view(-1)
    i = int((~changed).nonzero()[0])
    flat[i] ^= 1
    before = {k: t.clone() for k, t in tensors.items()}
    f = Follower(s3_store, tensors, early=True)  # holds "version 0": no record to check it against
    _stream_early(s3_store, f, states[0], states[1])
    assert f._parts[1].applied
    commit.seal_version(s3_store, 1, 0, 1)
    with pytest.raises(codec.ChunkError, match="does not match the version's digest"):
        f.poll()
    assert f.version == 0 and same_bits(tensors, before)


def test_early_apply_of_a_stray_part_is_taken_back(s3_store):
    """A part object that no manifest lists (left by a failed writer) may be applied early; at
    the seal it is undone with the rest and the version's own parts give the exact bits."""
    states = s3_states(1)
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(s3_store, tensors, early=True)
    m = _stream_early(s3_store, f, states[0], states[1])
    stray = commit.part_key(1, 0, 999)
    s3_store.put(stray, s3_store.get(m["parts"][0]["key"]))  # a valid copy: applying it twice undoes it
    f.poll()
    st = f._parts[1]
    for fut in list(st.pending.values()):
        fut.result()
    f._apply_early(1)
    assert stray in st.applied
    commit.run_commit(s3_store, commit.seal_version(s3_store, 1, 0, 1), commit.CommitPolicy())
    f.poll()
    assert f.version == 1 and same_bits(tensors, states[1])
