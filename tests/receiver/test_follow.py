"""The receiver's follow loop (receiver/follow.py, fetch.py) on a real file:// store: chains
applied bit-exact, damaged, truncated or swapped parts and wrong bases refused before any
write, digests checked, parts fetched in order a few at a time and decoded as their bytes
arrive, and an idle follower's back-off.

Senders are the TensorSender harness (tests/helpers/versions.py; two "ranks" splitting the
tensors): the sender path over canonical tensors held whole, without Megatron placement,
standing in for training's ShardSender + Publisher. The oracle is the new tensors themselves."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.keys import RECEIVERS
from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.testing.tensor_sender import TensorSender
from nemo_dcr_callback.transport.store import FileStore, open_store
from tests.helpers import versions
from tests.helpers.stores import CountingStore, TimedListings
from tests.helpers.tensors import perturb, random_tensor


def test_follow_applies_chain_bit_exact(tmp_path):
    store = open_store(f"file://{tmp_path}")
    states = versions.chain(store)
    tensors = {k: t.clone() for k, t in states[0].items()}
    seen = []
    f = Follower(store, tensors)
    f.follow(until=3, timeout=5, on_apply=lambda a: seen.append(
        (a.version, all(torch.equal(bits(tensors[k]), bits(states[a.version][k])) for k in tensors))))
    assert seen == [(1, True), (2, True), (3, True)]  # checked right after each version


def test_follow_waits_for_versions(tmp_path):
    store = FileStore(tmp_path)
    states = [versions.model()]
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        states.append({k: perturb(t, 0.05, g) for k, t in states[-1].items()})
    tensors = {k: t.clone() for k, t in states[0].items()}

    def late():
        for v in (1, 2):
            versions.publish(store, v, v - 1, states[v - 1], states[v])

    th = threading.Timer(0.3, late)
    th.start()
    Follower(store, tensors).follow(until=2, timeout=10, poll_s=0.02)
    th.join()
    assert all(torch.equal(bits(tensors[k]), bits(states[2][k])) for k in tensors)


def test_corrupt_version_applies_nothing(tmp_path):
    store = FileStore(tmp_path)
    states = versions.chain(store, steps=1)
    obj = tmp_path / commit.part_key(1, 1, 0)
    raw = bytearray(obj.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    obj.write_bytes(bytes(raw))
    tensors = {k: t.clone() for k, t in states[0].items()}
    with pytest.raises(codec.ChunkError, match="checksum mismatch"):
        Follower(store, tensors).apply_version(1)
    assert all(torch.equal(bits(tensors[k]), bits(states[0][k])) for k in tensors)  # rank 0's chunks not applied


def test_wrong_base_and_wrong_model_refused(tmp_path):
    store = FileStore(tmp_path)
    states = versions.chain(store, steps=2)
    tensors = {k: t.clone() for k, t in states[0].items()}
    with pytest.raises(codec.ChunkError, match="builds on 1"):
        Follower(store, tensors).apply_version(2)
    other = {k.replace("layer", "blk"): t.clone() for k, t in states[0].items()}
    with pytest.raises(codec.ChunkError, match="no tensor"):
        Follower(store, other).apply_version(1)


def test_part_truncated_or_swapped_refused(tmp_path):
    """A part cut short, or replaced by another valid part, never reaches the weights."""
    store = FileStore(tmp_path)
    states = versions.chain(store, steps=1)
    p0, p1 = tmp_path / commit.part_key(1, 0, 0), tmp_path / commit.part_key(1, 1, 0)
    good0 = p0.read_bytes()
    p0.write_bytes(good0[:-5])
    tensors = {k: t.clone() for k, t in states[0].items()}
    with pytest.raises(codec.ChunkError, match="truncated"):
        Follower(store, tensors).apply_version(1)
    p0.write_bytes(p1.read_bytes())  # well-formed chunks, wrong part
    with pytest.raises(codec.ChunkError, match="do not match the manifest"):
        Follower(store, tensors).apply_version(1)
    assert all(torch.equal(bits(tensors[k]), bits(states[0][k])) for k in tensors)
    p0.write_bytes(good0)
    Follower(store, tensors).apply_version(1)
    assert all(torch.equal(bits(tensors[k]), bits(states[1][k])) for k in tensors)


def test_wrong_baseline_detected_by_digest(tmp_path):
    """A receiver whose bits differ from the version it claims to hold is refused before any
    apply (the version record's additive digests), naming the tensor."""
    store = FileStore(tmp_path)
    states = versions.chain(store, steps=2)
    tensors = {k: t.clone() for k, t in states[1].items()}
    tensors["layer.2.w"].view(-1)[7] += 1
    with pytest.raises(codec.ChunkError, match="layer.2.w"):
        Follower(store, tensors, version=1)
    ok = {k: t.clone() for k, t in states[1].items()}
    f = Follower(store, ok, version=1)
    a = f.apply_version(2)
    assert a.digest_checked and all(torch.equal(bits(ok[k]), bits(states[2][k])) for k in ok)


def test_bits_drifting_after_start_caught_by_the_apply_check(tmp_path):
    """The per-version check reads back every element it touches (fused into the apply): a
    receiver element that drifted since start-up, and that the version changes, is named."""
    store = FileStore(tmp_path)
    states = versions.chain(store, steps=2)
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, tensors)
    f.apply_version(1)
    changed = (bits(states[2]["layer.1.w"]) != bits(states[1]["layer.1.w"])).view(-1).nonzero()[0, 0]
    tensors["layer.1.w"].view(-1)[changed] += 1  # drift at a position version 2 touches
    with pytest.raises(codec.ChunkError, match="layer.1.w"):
        f.apply_version(2)
    assert f.version == 1


class _SlowPooledStore(FileStore):
    """A file store with a thread pool (as S3 and relay clients have) whose part GETs take a
    while and are recorded: which started when, and how many ran at once."""

    def __init__(self, root):
        super().__init__(root)
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(8)
        self.started: list[str] = []
        self.running = self.most = 0
        self._lock = threading.Lock()

    def executor(self):
        return self._pool

    def get(self, key, limit=None):
        if not key.endswith(".dcr"):
            return super().get(key, limit=limit)

        with self._lock:
            self.started.append(key)
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(0.05)
            return super().get(key)
        finally:
            with self._lock:
                self.running -= 1


@pytest.mark.parametrize("lanes", [2, 4])
def test_parts_are_fetched_in_order_a_few_at_a_time(tmp_path, lanes):
    """A receiver downloads a version's parts in key order with at most fetch_lanes under way
    (all at once, they would share a link-bound transfer and land together at the end), and
    still ends bit-exact."""
    g = torch.Generator().manual_seed(3)
    old = {f"layer.{i}.w": random_tensor((32, 17), torch.bfloat16, g, specials=False) for i in range(10)}
    new = {k: perturb(t, 0.05, g) for k, t in old.items()}
    store = _SlowPooledStore(tmp_path)
    s = TensorSender(old)
    for n in s.tensors:
        s.tensors[n] = new[n]
    m = s.write(store, 1, 0, s.take(), part_bytes=1)  # one part per chunk
    commit.run_commit(store, commit.seal_version(store, 1, 0, 1, timeout=5), commit.CommitPolicy())
    assert len(m["parts"]) == 10
    tensors = {k: t.clone() for k, t in old.items()}
    f = Follower(store, tensors, fetch_lanes=lanes)
    assert [a.version for a in f.poll()] == [1]
    assert store.started == sorted(p["key"] for p in m["parts"])
    assert store.most == lanes
    assert all(torch.equal(bits(tensors[k]), bits(new[k])) for k in new)
    with pytest.raises(ValueError, match="fetch_lanes"):
        Follower(store, tensors, version=1, fetch_lanes=0)


def test_a_streaming_version_is_not_listed_while_its_parts_wait_for_a_lane(tmp_path):
    """While parts it knows of wait for a fetch lane, a receiver does not list the version's
    folder again (each listing crosses the link the parts need, and could only add more to
    wait for); once the queue runs dry it lists, finds the record and ends bit-exact."""
    g = torch.Generator().manual_seed(4)
    old = {f"layer.{i}.w": random_tensor((32, 17), torch.bfloat16, g, specials=False) for i in range(10)}
    new = {k: perturb(t, 0.05, g) for k, t in old.items()}

    class Listings(_SlowPooledStore):
        lists = 0

        def list(self, prefix=""):
            Listings.lists += 1
            return super().list(prefix)

    store = Listings(tmp_path)
    s = TensorSender(old)
    for n in s.tensors:
        s.tensors[n] = new[n]
    assert len(s.write(store, 1, 0, s.take(), part_bytes=1)["parts"]) == 10  # written, not sealed
    tensors = {k: t.clone() for k, t in old.items()}
    f = Follower(store, tensors, fetch_lanes=2)
    assert f.poll() == []  # streaming: its parts found and queued
    seen = Listings.lists
    for _ in range(4):  # ten parts of 0.05 s, two at a time: most still queued
        assert f.poll() == []
    assert Listings.lists == seen
    commit.run_commit(store, commit.seal_version(store, 1, 0, 1, timeout=5), commit.CommitPolicy())
    f.follow(until=1, timeout=30)
    assert Listings.lists > seen and all(torch.equal(bits(tensors[k]), bits(new[k])) for k in new)


def test_a_new_version_costs_one_listing_before_its_first_part(tmp_path):
    """A receiver waiting for the next version finds its first part with the version listing
    and one listing of its folder (no record or decision reads while neither exists), and
    still ends bit-exact."""
    states = [versions.model()]
    g = torch.Generator().manual_seed(3)
    states.append({k: perturb(v, 0.05, g) for k, v in states[0].items()})
    store = CountingStore(tmp_path)
    commit.write_keyframe(store, 0, states[0])
    f = Follower(store, {k: v.clone() for k, v in states[0].items()}, version=0)
    s = TensorSender(states[0])
    s.tensors = states[1]
    s.write(store, 1, 0, s.take())  # parts and manifest, not sealed yet
    store.calls.clear()
    f.poll()
    first_part = next(i for i, c in enumerate(store.calls) if c[1].endswith(".dcr"))
    assert [c[0] for c in store.calls[:first_part]] == ["children", "list"], store.calls[:first_part]
    commit.run_commit(store, commit.seal_version(store, 1, 0, 1, timeout=5), commit.CommitPolicy())
    f.follow(until=1, timeout=30, poll_s=0.01)
    assert all(torch.equal(bits(f.tensors[k]), bits(states[1][k])) for k in states[1])


def test_part_decoded_as_its_bytes_arrive(tmp_path):
    """A part fed in pieces of any size decodes to the chunks of the whole part, with its
    length and xxh3; a part that ends inside a chunk or holds garbage is refused; a fetch that
    starts again (reset) does not keep what the broken one fed."""
    import random

    import xxhash

    from nemo_dcr_callback.receiver.fetch import _PartDecoder

    old = versions.model()
    g = torch.Generator().manual_seed(5)
    new = {k: perturb(v, 0.2, g) for k, v in old.items()}
    s = TensorSender(old)
    s.tensors = new
    chunks = [c for n, d in s.take() for c in codec.encode_delta(n, d, d.new, span=500)]
    blob = b"".join(chunks)
    rng = random.Random(0)
    for _ in range(5):
        part = _PartDecoder(lambda h: None)
        part.feed(blob[:100])
        part.reset()  # a retry from the first byte
        i = 0
        while i < len(blob):
            j = min(len(blob), i + rng.choice([1, 7, 300, 5000]))
            part.feed(blob[i:j])
            i = j
        n, h, dec = part.finish()
        assert n == len(blob) and h == xxhash.xxh3_64_hexdigest(blob) and len(dec) == len(chunks)
        for d, c in zip(dec, chunks, strict=True):
            ref = codec.decode_chunk(c)
            assert torch.equal(d.positions, ref.positions) and torch.equal(d.values, ref.values)
    part = _PartDecoder(lambda h: None)
    part.feed(blob[:-3])
    with pytest.raises(codec.ChunkError, match="truncated"):
        part.finish()
    bad = bytearray(blob)
    bad[len(chunks[0]):len(chunks[0]) + 4] = b"XXXX"
    with pytest.raises(codec.ChunkError):
        _PartDecoder(lambda h: None).feed(bytes(bad))
    flipped = bytearray(blob)
    flipped[len(chunks[0]) // 2] ^= 1
    with pytest.raises(codec.ChunkError, match="checksum"):
        _PartDecoder(lambda h: None).feed(bytes(flipped))


def test_an_idle_follower_of_a_polled_store_backs_off_and_still_sees_the_next_version(tmp_path):
    """A store that cannot long-poll (S3, file://) is polled, and each poll of S3 is a LIST
    request: an idle receiver listed it about 77 times a second. After IDLE_AFTER_S with
    nothing new the pause doubles up to idle_poll_s, and a version that then appears is still
    applied, bit-exact."""

    from nemo_dcr_callback.receiver.follow import IDLE_AFTER_S

    store = TimedListings(FileStore(tmp_path))
    states = [versions.model()]
    states.append({k: perturb(t, 0.05, torch.Generator().manual_seed(2)) for k, t in states[0].items()})
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, tensors, poll_s=0.005, idle_poll_s=0.2)
    th = threading.Thread(target=f.follow, kwargs={"until": 1, "timeout": 30})
    t0 = time.monotonic()
    th.start()
    time.sleep(IDLE_AFTER_S + 2.0)
    idle = [t for t in store.at if t > t0 + IDLE_AFTER_S + 1.0]  # the last second: backed off
    assert len(store.at) > 20 and len(idle) <= 8, (len(store.at), len(idle))  # at 5 ms it was ~100+
    versions.publish(store.store, 1, 0, states[0], states[1])
    th.join(10)
    assert not th.is_alive() and f.version == 1
    assert all(torch.equal(bits(tensors[k]), bits(states[1][k])) for k in tensors)


def test_a_streamed_version_collected_before_its_decision_is_dropped(tmp_path):
    """A receiver streams version 1 while it is written; before it sees the decision (it was
    stopped, or cut off), version 1 is aborted and gc collects its folder, and version 2 is
    published on version 0. Found by the chaos soak (seed 1): the receiver waited for version
    1's record or decision for ever. It drops the vanished version and applies 2."""
    store = FileStore(tmp_path / "store")
    states = [versions.model()]
    g = torch.Generator().manual_seed(5)
    states += [{k: perturb(t, 0.05, g) for k, t in states[0].items()} for _ in range(2)]
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, tensors)
    s = TensorSender(states[0], 0, 1)
    for n in s.tensors:
        s.tensors[n] = states[1][n]
    s.write(store, 1, 0, s.take())  # parts and manifest: no record, no decision yet
    assert f.poll() == [] and 1 in f._parts  # streaming version 1
    store.delete_prefix(commit.vdir(1))  # aborted and collected meanwhile
    versions.publish(store, 2, 0, states[0], states[2])
    assert [a.version for a in f.poll()] == [2]
    assert all(torch.equal(bits(tensors[k]), bits(states[2][k])) for k in tensors)


def test_a_follower_does_not_look_at_an_aborted_version_twice(tmp_path):
    """Found by the long chaos soak: after an abort, versions on its chain abort too, and each
    poll of a receiver looked at every one of them again (a listing and a decision apiece).
    Hundreds piled up between the version held and the next one on it; a poll took longer
    than the ack timeout, so that one aborted as well, and the storm fed itself. A version
    known to be aborted costs nothing on later polls."""
    store = CountingStore(tmp_path / "store")
    states = [versions.model()]
    g = torch.Generator().manual_seed(9)
    states.append({k: perturb(t, 0.05, g) for k, t in states[0].items()})
    for v in range(1, 21):  # aborted: the chain after a version that had no quorum
        s = TensorSender(states[0], 0, 1)
        for n in s.tensors:
            s.tensors[n] = states[1][n]
        s.write(store, v, v - 1, s.take())
        commit.decide(store, v, v - 1, "abort", [], [], "test")
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, tensors)
    assert f.poll() == []
    store.calls.clear()
    assert f.poll() == []
    assert len(store.calls) <= 3, store.calls  # the versions listed; nothing about 1-20 again
    versions.publish(store, 21, 0, states[0], states[1])
    assert [a.version for a in f.poll()] == [21] and same_tensors(tensors, states[1])


def same_tensors(a, b) -> bool:
    return all(torch.equal(bits(a[k]), bits(b[k])) for k in b)


class _RefusesRegistrations(FileStore):
    """A real file store whose registration writes fail while `down` (an S3 answering 500 to
    a put, as in the chaos soak): fault injection, everything else is the store's own."""

    down = True

    def put(self, key, data, *args, **kwargs):
        if self.down and key.startswith(RECEIVERS):
            raise StoreError(f"put {key}: injected HTTP 500")
        return super().put(key, data, *args, **kwargs)


def test_an_idle_receiver_stays_registered_and_a_refused_heartbeat_is_retried(tmp_path):
    """Found by the chaos soak: the registration was refreshed only after an apply, so a
    receiver idle past gc's live_s (the trainer down, versions aborting) lost its claim and gc
    collected the versions it needed; and a registration the store refused at start (a vLLM
    engine's attach) ended the receiver."""
    store = _RefusesRegistrations(tmp_path)
    states = versions.chain(store, steps=1)
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, tensors, receiver_id="rx", register_every_s=0.2)  # refused: no error
    assert commit.receivers(store) == {}
    store.down = False
    assert [a.version for a in f.poll()] == [1]  # the refused write is retried: registered
    first = commit.receivers(store)["rx"]
    for _ in range(2):
        time.sleep(0.3)
        assert f.poll() == []  # idle
        again = commit.receivers(store)["rx"]
        assert again["time"] > first["time"] and again["version"] == 1  # refreshed without an apply
        first = again
