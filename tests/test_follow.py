"""Store, version records and the receiver's follow loop, on a real file:// store.

Senders are simulated with the codec directly (two "ranks" splitting the tensors); the oracle
is the new tensors themselves."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from conftest import TimedListings, perturb, race, random_tensor

from nemo_dcr_callback import codec
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol import commit, upload
from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.testing.tensor_sender import TensorSender, publish
from nemo_dcr_callback.transport.store import FileStore, open_store


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.w": random_tensor((64, 33), torch.bfloat16, g, specials=False) for i in range(4)}


def _publish(store, v, base, old, new, world=2):
    """Two sender ranks (TensorSender: the real sender path, without Megatron), seal, commit."""
    return publish(store, v, base, old, new, world=world, timeout=5)


def _chain(store, steps=3):
    states = [_model()]
    g = torch.Generator().manual_seed(1)
    for v in range(1, steps + 1):
        states.append({k: perturb(t, 0.05, g) for k, t in states[-1].items()})
        _publish(store, v, v - 1, states[-2], states[-1])
    return states


def test_follow_applies_chain_bit_exact(tmp_path):
    store = open_store(f"file://{tmp_path}")
    states = _chain(store)
    tensors = {k: t.clone() for k, t in states[0].items()}
    seen = []
    f = Follower(store, tensors)
    f.follow(until=3, timeout=5, on_apply=lambda a: seen.append(
        (a.version, all(torch.equal(bits(tensors[k]), bits(states[a.version][k])) for k in tensors))))
    assert seen == [(1, True), (2, True), (3, True)]  # checked right after each version


def test_follow_waits_for_versions(tmp_path):
    store = FileStore(tmp_path)
    states = [_model()]
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        states.append({k: perturb(t, 0.05, g) for k, t in states[-1].items()})
    tensors = {k: t.clone() for k, t in states[0].items()}

    def late():
        for v in (1, 2):
            _publish(store, v, v - 1, states[v - 1], states[v])

    th = threading.Timer(0.3, late)
    th.start()
    Follower(store, tensors).follow(until=2, timeout=10, poll_s=0.02)
    th.join()
    assert all(torch.equal(bits(tensors[k]), bits(states[2][k])) for k in tensors)


def test_corrupt_version_applies_nothing(tmp_path):
    store = FileStore(tmp_path)
    states = _chain(store, steps=1)
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
    states = _chain(store, steps=2)
    tensors = {k: t.clone() for k, t in states[0].items()}
    with pytest.raises(codec.ChunkError, match="builds on 1"):
        Follower(store, tensors).apply_version(2)
    other = {k.replace("layer", "blk"): t.clone() for k, t in states[0].items()}
    with pytest.raises(codec.ChunkError, match="no tensor"):
        Follower(store, other).apply_version(1)


def test_store_put_if_absent_one_winner(tmp_path):
    store = FileStore(tmp_path)
    wins = race(lambda i: store.put_if_absent("x/rec", str(i).encode()), 8)
    assert wins.count(True) == 1
    assert store.get("x/rec").decode() in {str(i) for i in range(8)}
    assert store.list("x") == ["x/rec"]
    with pytest.raises(ValueError):
        store.put("../escape", b"")
    with pytest.raises(KeyError):
        store.get("missing")
    with pytest.raises(StoreError, match="unsupported"):
        open_store("ftp://host/x")
    with pytest.raises(StoreError, match="s3://"):
        open_store("s3:///nobucket")
    with pytest.raises(StoreError, match="unsupported"):
        open_store("ftp://host/x")


def test_seal_waits_for_every_rank(tmp_path):
    store = FileStore(tmp_path)
    upload.write_rank(store, 1, 0, 0, 2, [], 0, 0)
    with pytest.raises(TimeoutError, match="rank-00001"):
        commit.seal_version(store, 1, 0, 2, timeout=0.2)
    upload.write_rank(store, 1, 0, 1, 2, [], 0, 0)
    rec = commit.seal_version(store, 1, 0, 2, timeout=1)
    assert rec["ranks"] == [commit.rank_manifest(1, 0), commit.rank_manifest(1, 1)]
    assert json.loads(store.get(commit.version_record(1)))["base"] == 0


def test_part_truncated_or_swapped_refused(tmp_path):
    """A part cut short, or replaced by another valid part, never reaches the weights."""
    store = FileStore(tmp_path)
    states = _chain(store, steps=1)
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
    states = _chain(store, steps=2)
    tensors = {k: t.clone() for k, t in states[1].items()}
    tensors["layer.2.w"].view(-1)[7] += 1
    with pytest.raises(codec.ChunkError, match="layer.2.w"):
        Follower(store, tensors, version=1)
    ok = {k: t.clone() for k, t in states[1].items()}
    f = Follower(store, ok, version=1)
    a = f.apply_version(2)
    assert a.digest_checked and all(torch.equal(bits(ok[k]), bits(states[2][k])) for k in ok)


def test_record_digests_are_whole_tensor_digests(tmp_path):
    """The per-rank slice digests sum to the digest of each whole tensor (the oracle: the
    digest computed from the new tensors directly)."""
    from nemo_dcr_callback.codec import digest

    store = FileStore(tmp_path)
    states = _chain(store, steps=2)
    rec = commit.read_record(store, 2)
    assert rec["digests"] == {k: digest.hexd(digest.sum64(t)) for k, t in sorted(states[2].items())}
    # Receivers download every rank manifest: the slice digests stay out of it (sealer only).
    for key in rec["ranks"]:
        assert "digests" not in json.loads(store.get(key))
    assert set(json.loads(store.get(commit.rank_sums(2, 0)))["digests"]) <= set(rec["digests"])


def test_seal_refuses_a_rank_without_its_sums(tmp_path):
    """A manifest whose sums object is missing (a writer that died between the two, or a
    foreign writer) cannot be sealed into a record with wrong digests."""
    store = FileStore(tmp_path)
    upload.RankWriter(store, 1, 0, 0, 1).finish(0, 0, {"w": 5})
    (tmp_path / commit.rank_sums(1, 0)).unlink()
    with pytest.raises(RuntimeError, match="sums-00000.json: missing"):
        commit.seal_version(store, 1, 0, 1, timeout=1)
    assert not store.exists(commit.version_record(1))


def test_bits_drifting_after_start_caught_by_the_apply_check(tmp_path):
    """The per-version check reads back every element it touches (fused into the apply): a
    receiver element that drifted since start-up, and that the version changes, is named."""
    store = FileStore(tmp_path)
    states = _chain(store, steps=2)
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, tensors)
    f.apply_version(1)
    changed = (bits(states[2]["layer.1.w"]) != bits(states[1]["layer.1.w"])).view(-1).nonzero()[0, 0]
    tensors["layer.1.w"].view(-1)[changed] += 1  # drift at a position version 2 touches
    with pytest.raises(codec.ChunkError, match="layer.1.w"):
        f.apply_version(2)
    assert f.version == 1


def test_parts_ramp_up_from_a_sixteenth(tmp_path):
    """Bytes start crossing the link after a sixteenth of a full part's encoding; each next
    part is twice the last, up to full size; the manifest names them all."""
    store = FileStore(tmp_path)
    w = upload.RankWriter(store, 1, 0, 0, 1, part_bytes=2 << 20)
    for _ in range(100):
        w.add(b"x" * (64 << 10))
    m = w.finish(0, 0, {})
    sizes = [p["bytes"] >> 10 for p in m["parts"]]
    assert sizes[:5] == [128, 256, 512, 1024, 2048] and all(s == 2048 for s in sizes[5:-1])
    assert sum(sizes) == 100 * 64
    assert [k for k in store.list(commit.vdir(1)) if k.endswith(".dcr")] == [p["key"] for p in m["parts"]]


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

    def get(self, key):
        if not key.endswith(".dcr"):
            return super().get(key)
        import time

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


class _CountingStore(FileStore):
    """A file store that records the requests made of it (no behaviour changed)."""

    def __init__(self, root):
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []

    def get(self, key):
        self.calls.append(("get", key))
        return super().get(key)

    def list(self, prefix):
        self.calls.append(("list", prefix))
        return super().list(prefix)

    def children(self, prefix):
        self.calls.append(("children", prefix))
        return super().children(prefix)


def test_commit_reads_the_last_missing_acks_by_name(tmp_path):
    """With a few acks missing the committer reads them by name (one round trip on the refit's
    path), not a listing then a read; with more missing it lists."""
    store = _CountingStore(tmp_path)
    for r in ("a", "b", "c"):
        commit.register(store, r, 0)
    commit.write_ack(store, 1, "a", 0)
    store.calls.clear()
    seen: dict = {}
    acks = commit.read_acks(store, 1, seen, expected=["a", "b", "c"])  # three missing: a listing
    assert set(acks) == {"a"} and ("children", "versions/0000000001/acks") in store.calls
    store.calls.clear()
    commit.write_ack(store, 1, "b", 0)
    acks = commit.read_acks(store, 1, seen, expected=["a", "b", "c"])  # two missing: by name
    assert set(acks) == {"a", "b"} and [c[0] for c in store.calls] == ["get", "get"]
    commit.write_ack(store, 1, "c", 0, ok=False, error="bad chunk")
    rec = {"version": 1, "base": 0}
    d = commit.run_commit(store, rec, commit.CommitPolicy("wait", timeout=5), expected=["a", "b", "c"])
    assert d["decision"] == "abort" and "bad chunk" in d["reason"]  # a refusal read by name still counts


def test_a_committer_waiting_for_a_quiet_receiver_looks_less_and_less_often(tmp_path, monkeypatch):
    """On a polled store the committer's pause grows with the time since the last new ack,
    after ACK_FAST_S (here 0.5 s; 2 s by default): a receiver that acks 3 s late is still seen
    within a few % of that, and the committer asked the store for it ~100 times, not ~300
    (every 10 ms; on S3 with a dead registered receiver that was ~6,000 requests per version
    over the 60 s timeout)."""
    monkeypatch.setattr(commit, "ACK_FAST_S", 0.5)
    store = _CountingStore(tmp_path)
    for r in ("a", "b"):
        commit.register(store, r, 0)
    commit.write_ack(store, 1, "a", 0)
    store.calls.clear()
    acked_at = []

    def late():
        time.sleep(3.0)
        acked_at.append(time.monotonic())
        commit.write_ack(store, 1, "b", 0)

    th = threading.Thread(target=late)
    th.start()
    d = commit.run_commit(store, {"version": 1, "base": 0}, commit.CommitPolicy("wait", timeout=20),
                          expected=["a", "b"])
    decided_at = time.monotonic()
    th.join()
    assert d["decision"] == "commit" and d["acked"] == ["a", "b"]
    assert decided_at - acked_at[0] < 0.5  # the pause 3 s after the last ack: 0.135 s
    looks = [c for c in store.calls if c[0] in ("get", "children") and "acks" in c[1]]
    assert 10 < len(looks) <= 170, len(looks)
    assert commit.ack_pause(0.01, 0.4) == 0.01 and commit.ack_pause(0.01, 600.0) == commit.ACK_POLL_MAX_S


def test_a_new_version_costs_one_listing_before_its_first_part(tmp_path):
    """A receiver waiting for the next version finds its first part with the version listing
    and one listing of its folder (no record or decision reads while neither exists), and
    still ends bit-exact."""
    states = [_model()]
    g = torch.Generator().manual_seed(3)
    states.append({k: perturb(v, 0.05, g) for k, v in states[0].items()})
    store = _CountingStore(tmp_path)
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

    old = _model()
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
    import time

    from nemo_dcr_callback.receiver.follow import IDLE_AFTER_S

    store = TimedListings(FileStore(tmp_path))
    states = [_model()]
    states.append({k: perturb(t, 0.05, torch.Generator().manual_seed(2)) for k, t in states[0].items()})
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, tensors, poll_s=0.005, idle_poll_s=0.2)
    th = threading.Thread(target=f.follow, kwargs={"until": 1, "timeout": 30})
    t0 = time.monotonic()
    th.start()
    time.sleep(IDLE_AFTER_S + 2.0)
    idle = [t for t in store.at if t > t0 + IDLE_AFTER_S + 1.0]  # the last second: backed off
    assert len(store.at) > 20 and len(idle) <= 8, (len(store.at), len(idle))  # at 5 ms it was ~100+
    _publish(store.store, 1, 0, states[0], states[1])
    th.join(10)
    assert not th.is_alive() and f.version == 1
    assert all(torch.equal(bits(tensors[k]), bits(states[1][k])) for k in tensors)


def test_ranks_off_the_refit_path_look_for_the_decision_less_and_less_often(tmp_path):
    """Ranks other than 0 only drop or undo their undo log on a version's decision, and on S3
    each look is a GET from every rank of the job: the pause doubles from 50 ms up to 1 s
    (publisher.DECISION_MAX_POLL_S) instead of 20 looks a second throughout. The decision is
    still found, at most a pause after it is written."""
    import time

    from nemo_dcr_callback.sender.publisher import DECISION_MAX_POLL_S, DECISION_POLL_S

    class Reads:  # the real store, its reads of the decision counted
        def __init__(self, store):
            self.store, self.n = store, 0

        def get(self, key):
            if key == commit.decision_key(1):
                self.n += 1
            return self.store.get(key)

        def __getattr__(self, name):
            return getattr(self.store, name)

    store = Reads(FileStore(tmp_path))
    written = []

    def decide():
        commit.decide(store.store, 1, 0, "commit", ["rx"], [], "")
        written.append(time.monotonic())

    threading.Timer(1.6, decide).start()
    d = commit.await_decision(store, 1, 30, poll=DECISION_POLL_S, max_poll=DECISION_MAX_POLL_S)
    lag = time.monotonic() - written[0]
    assert d["decision"] == "commit"
    assert 3 <= store.n <= 8, store.n  # 0, 0.05, 0.15, 0.35, 0.75, 1.55, 2.55 s; at 50 ms it was 33
    assert lag <= DECISION_MAX_POLL_S + 0.5, lag
