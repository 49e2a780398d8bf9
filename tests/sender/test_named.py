"""NamedPublisher: versions of HF-named tensors (the trainer side of the vLLM and verl
integrations), checked against the sender's own dense tensors as the oracle through two
independent readers: protocol.rebuild (keyframe + chain) and a receiver's Follower."""

from __future__ import annotations

import threading

import pytest
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.config import CommitPolicy
from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.protocol.rebuild import reconstruct
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.receiver.targets import StateDictTarget
from nemo_dcr_callback.sender.named import NamedPublisher, NamedSender, PublishError
from nemo_dcr_callback.transport.store import FileStore, open_store

from ..helpers.tensors import adam_like, perturb, same_bits
from ..helpers.versions import model


def _next(state, g, rate=0.03):
    return {k: perturb(t, rate, g) for k, t in state.items()}


def test_publishes_a_chain_a_receiver_follows_bit_exact(tmp_path):
    store = open_store(f"file://{tmp_path}")
    state = model()
    pub = NamedPublisher(store, state, config_json='{"model_type": "llama"}')
    assert commit.keyframes(store) == [0]
    assert store.get(keys.keyframe_config(0)) == b'{"model_type": "llama"}'
    replica = {k: t.clone() for k, t in state.items()}
    f = Follower(store, StateDictTarget(replica), 0, receiver_id="r0")
    g = torch.Generator().manual_seed(3)
    for v in range(1, 5):
        before = {k: t.clone() for k, t in replica.items()}
        state = _next(state, g)
        # a receiver is registered: the joint commit waits for its ack, given in a thread
        t = threading.Thread(target=f.follow, kwargs={"until": v, "timeout": 30})
        t.start()
        d = pub.publish(state)
        t.join(30)
        assert d["committed"] and d["version"] == v and d["acked"] == ["r0"]
        assert 0 < d["changed"] < d["params"]
        assert same_bits(replica, state) and not same_bits(before, state)
        assert same_bits(reconstruct(store, v), state)


def test_resumes_from_the_store_and_carries_what_differs(tmp_path):
    store = open_store(f"file://{tmp_path}")
    g = torch.Generator().manual_seed(4)
    s0 = model()
    pub = NamedPublisher(store, s0)
    s1 = _next(s0, g)
    assert pub.publish(s1)["committed"]
    # a restarted trainer holds other weights (its checkpoint is older than the store's head)
    s2 = _next(s0, g)
    pub2 = NamedPublisher(store, s2)
    assert pub2.last == 1 and pub2.newest == 1
    d = pub2.publish(s2)
    assert d["version"] == 2 and d["base"] == 1 and d["committed"]
    assert same_bits(reconstruct(store, 2), s2)


def test_an_aborted_version_rolls_back_and_the_next_covers_it(tmp_path):
    store = open_store(f"file://{tmp_path}")
    g = torch.Generator().manual_seed(5)
    s0 = model()
    pub = NamedPublisher(store, s0, policy=CommitPolicy(mode="abort", timeout=0.3))
    commit.register(store, "gone", 0)  # a receiver that never acks: the version is aborted
    s1 = _next(s0, g)
    d = pub.publish(s1)
    assert not d["committed"] and d["decision"] == "abort" and pub.last == 0
    store.delete(["receivers/gone.json"])
    s2 = _next(s1, g)
    d = pub.publish(s2)
    assert d["committed"] and d["version"] == 2 and d["base"] == 0
    assert same_bits(reconstruct(store, 2), s2)


def test_bad_input_is_refused_and_nothing_is_written(tmp_path):
    store = open_store(f"file://{tmp_path}")
    s0 = model()
    pub = NamedPublisher(store, s0)
    before = sorted(store.list(""))
    wrong = dict(s0)
    wrong["extra.w"] = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(PublishError, match="unknown \\['extra.w'\\]"):
        pub.publish(wrong)
    with pytest.raises(PublishError, match="layer.0.w: torch.float32"):
        pub.publish({k: t.float() if k == "layer.0.w" else t for k, t in s0.items()})
    with pytest.raises(PublishError, match="versions only increase"):
        pub.publish(s0, version=0)
    assert sorted(store.list("")) == before
    with pytest.raises(PublishError, match="missing \\['layer.3.w'\\]"):
        NamedPublisher(store, {k: t for k, t in s0.items() if k != "layer.3.w"})


def test_a_stream_of_tensors_is_published_one_at_a_time(tmp_path):
    """A generator of (name, tensor) pairs (what verl's actor yields) is diffed and sent as it
    comes; a bad tensor mid-stream fails that version, which is aborted and rolled back: the
    next version, streamed whole, lands bit-exact."""
    store = open_store(f"file://{tmp_path}")
    g = torch.Generator().manual_seed(6)
    s0 = model()
    pub = NamedPublisher(store, s0)
    s1 = _next(s0, g)
    d = pub.publish((n, s1[n]) for n in sorted(s1, reverse=True))
    assert d["committed"] and same_bits(reconstruct(store, 1), s1)
    s2 = _next(s1, g)

    def bad():
        yield "layer.0.w", s2["layer.0.w"]
        yield "layer.9.w", s2["layer.1.w"]

    with pytest.raises(PublishError, match="unknown 'layer.9.w'"):
        pub.publish(bad())
    with pytest.raises(PublishError, match="missing \\['layer.3.w'\\]"):
        pub.publish((n, s2[n]) for n in sorted(s2)[:3])
    assert [commit.read_decision(store, v)["decision"] for v in (2, 3)] == ["abort", "abort"]
    d = pub.publish(iter(s2.items()))
    assert d["committed"] and d["version"] == 4 and d["base"] == 1
    assert same_bits(reconstruct(store, 4), s2)


@pytest.mark.parametrize("context", ["off", "on"])
def test_tensors_encoded_at_once_write_the_bytes_of_one_at_a_time(tmp_path, context):
    """encode_threads: the sender's pool must not change a byte: the same chunks in the same
    parts, the same digests; and what it wrote applies to the new weights (the oracle)."""
    pairs = {f"layer.{i}.w": adam_like(64 * 129 * (i % 4 + 1), 1e-3, seed=i) for i in range(12)}
    old, new = ({k: p[j] for k, p in pairs.items()} for j in (0, 1))  # (context coding wins on them)
    got = []
    for threads in (1, 3):
        store = FileStore(tmp_path / f"threads-{threads}")
        s = NamedSender(old, context=context, encode_threads=threads)
        s.tensors = dict(new)
        s.write(store, 1, 0, s.take(), part_bytes=2 << 10)
        parts = {k: store.get(k) for k in store.list(commit.vdir(1)) if keys.is_part(k)}
        got.append((parts, s._pending))
        assert len(parts) > 3
    assert got[0] == got[1]
    chunks = [c for blob in got[1][0].values() for c in codec.split_chunks(blob)]
    assert any(codec.parse_header(c).classes for c in chunks) == (context == "on")
    commit.run_commit(store, commit.seal_version(store, 1, 0, 1, timeout=10), CommitPolicy())
    replica = {k: t.clone() for k, t in old.items()}
    Follower(store, StateDictTarget(replica), 0).follow(until=1, timeout=30)
    assert same_bits(replica, new)


def test_an_encoder_failing_in_the_pool_fails_the_version_and_rolls_back(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(6)
    old = model()
    new = _next(old, g)
    real = codec.encode_delta

    def failing(name, *a, **kw):
        if name == "layer.2.w":
            raise RuntimeError("encoder failed on layer.2.w")
        return real(name, *a, **kw)

    monkeypatch.setattr(codec, "encode_delta", failing)  # (a fault injected into the real encoder)
    s = NamedSender(old, encode_threads=3)
    s.tensors = dict(new)
    with pytest.raises(RuntimeError, match="layer.2.w"):
        s.stream(FileStore(tmp_path), 1, 0)
    s.roll_back()
    assert same_bits({k: b.view(old[k].shape) for k, b in s.baselines.items()}, old)


def test_a_generator_source_is_taken_one_tensor_at_a_time(tmp_path):
    """Keyframe 0 and the resume check from a generator (an FSDP source gathers one parameter at
    a time): each pair is copied into the baseline as it comes and the caller's tensor is not
    held; the keyframe's file reads back the same bits as safetensors' own writer."""
    import gc
    import weakref

    from safetensors.torch import load

    store = open_store(f"file://{tmp_path}")
    s0 = model()
    refs = []

    def gathered():  # a fresh tensor per pair, as full_tensor() returns
        for n, t in s0.items():
            gc.collect()  # at most the pair given last is still alive when the next is made
            assert all(r() is None for r in refs[:-1]), "the publisher holds the source's tensors at once"
            x = t.clone()
            refs.append(weakref.ref(x))
            yield n, x

    pub = NamedPublisher(store, gathered())
    gc.collect()
    assert refs and all(r() is None for r in refs), "the publisher kept a tensor the source gave it"
    assert same_bits(load(store.get(keys.keyframe_model(0))), s0)
    assert same_bits({n: b.reshape(s0[n].shape) for n, b in pub.sender.baselines.items()}, s0)
    s1 = _next(s0, torch.Generator().manual_seed(9))
    assert pub.publish(iter(s1.items()))["committed"]
    pub2 = NamedPublisher(store, iter(s1.items()))  # resumed: checked pair by pair
    assert pub2.last == 1
    with pytest.raises(PublishError, match="missing \\['layer.3.w'\\]"):
        NamedPublisher(store, ((n, t) for n, t in s1.items() if n != "layer.3.w"))


def test_a_commit_that_times_out_is_aborted_and_rolled_back(tmp_path):
    """Under "wait" a receiver that never acks makes publish raise; the version is then decided
    abort (receivers move on) and the baselines restored, so the next version is taken against
    the last committed one and lands bit-exact."""
    store = open_store(f"file://{tmp_path}")
    g = torch.Generator().manual_seed(8)
    s0 = model()
    pub = NamedPublisher(store, s0, policy=CommitPolicy(mode="wait", timeout=0.3))
    commit.register(store, "gone", 0)
    s1 = _next(s0, g)
    with pytest.raises(commit.CommitTimeout, match="gone"):
        pub.publish(s1)
    assert commit.read_decision(store, 1)["decision"] == "abort" and pub.last == 0
    assert same_bits({n: b.reshape(s0[n].shape) for n, b in pub.sender.baselines.items()}, s0)
    store.delete(["receivers/gone.json"])
    s2 = _next(s1, g)
    d = pub.publish(s2)
    assert d["committed"] and d["version"] == 2 and d["base"] == 0
    assert same_bits(reconstruct(store, 2), s2)
