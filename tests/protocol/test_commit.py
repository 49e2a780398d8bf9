"""The joint commit (protocol/commit.py) on a real file:// store: sealing waits for every
rank's manifest and sums and sums the ranks' slice digests into whole-tensor digests; the
committer reads the last missing acks by name and looks less and less often for a quiet
receiver; ranks off the refit path look for the decision less and less often."""

from __future__ import annotations

import json
import threading
import time

import pytest

from nemo_dcr_callback.protocol import commit, upload
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers import versions
from tests.helpers.stores import CountingStore


def test_seal_waits_for_every_rank(tmp_path):
    store = FileStore(tmp_path)
    upload.write_rank(store, 1, 0, 0, 2, [], 0, 0)
    with pytest.raises(TimeoutError, match="rank-00001"):
        commit.seal_version(store, 1, 0, 2, timeout=0.2)
    upload.write_rank(store, 1, 0, 1, 2, [], 0, 0)
    rec = commit.seal_version(store, 1, 0, 2, timeout=1)
    assert rec["ranks"] == [commit.rank_manifest(1, 0), commit.rank_manifest(1, 1)]
    assert json.loads(store.get(commit.version_record(1)))["base"] == 0


def test_record_digests_are_whole_tensor_digests(tmp_path):
    """The per-rank slice digests sum to the digest of each whole tensor (the oracle: the
    digest computed from the new tensors directly)."""
    from nemo_dcr_callback.codec import digest

    store = FileStore(tmp_path)
    states = versions.chain(store, steps=2)
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


def test_commit_reads_the_last_missing_acks_by_name(tmp_path):
    """With a few acks missing the committer reads them by name (one round trip on the refit's
    path), not a listing then a read; with more missing it lists."""
    store = CountingStore(tmp_path)
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
    store = CountingStore(tmp_path)
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


def test_quorum_holds_a_version_a_grace_not_the_timeout_for_a_stalled_receiver(tmp_path):
    """Found by the chaos soak: under the quorum policy one stalled receiver held every version
    for the whole ack timeout, decisions fell minutes behind a trainer publishing every step,
    and whatever queued behind an abort aborted too. Once the quorum acked the rest get the
    grace; a receiver the last decision marked lagging is not waited for at all; one that acks
    within the grace still counts."""
    store = FileStore(tmp_path)
    pol = commit.CommitPolicy("quorum", timeout=30, quorum=0.5, grace=0.5)
    expected = ["a", "b", "stalled"]
    for v in (1, 2):
        commit.write_ack(store, v, "a", v - 1)
        commit.write_ack(store, v, "b", v - 1)
    t0 = time.monotonic()
    d1 = commit.run_commit(store, {"version": 1, "base": 0}, pol, expected=expected)
    t1 = time.monotonic()
    assert d1["decision"] == "commit" and d1["lagging"] == ["stalled"]
    assert 0.5 <= t1 - t0 < 5  # the grace, not the 30 s timeout
    d2 = commit.run_commit(store, {"version": 2, "base": 1}, pol, expected=expected, behind=d1["lagging"])
    assert d2["decision"] == "commit" and time.monotonic() - t1 < 0.4  # not held for it again
    commit.write_ack(store, 3, "a", 2)
    commit.write_ack(store, 3, "b", 2)
    th = threading.Timer(0.2, lambda: commit.write_ack(store, 3, "stalled", 2))
    th.start()
    d3 = commit.run_commit(store, {"version": 3, "base": 2}, pol, expected=expected)
    th.join()
    assert d3["acked"] == ["a", "b", "stalled"] and d3["lagging"] == []  # it made the grace
    with pytest.raises(ValueError, match="grace"):
        commit.CommitPolicy("quorum", grace=-1)


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

        def get(self, key, limit=None):
            if key == commit.decision_key(1):
                self.n += 1
            return self.store.get(key, limit=limit)

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


def test_a_version_left_before_its_seal_is_aborted_with_a_readable_decision(tmp_path):
    """A sender that died after uploading parts of version 2 and before sealing it left no
    record: the restarted sender aborts it on the last committed version, and every reader
    (receivers, resume_point) reads that decision (it was written with base -1, which
    readers refuse as malformed)."""
    store = FileStore(tmp_path)
    states = versions.chain(store, 1)
    store.put(commit.part_key(2, 0, 0), b"x" * 64)  # a part, and nothing after it
    last, newest, dangling = commit.resume_point(store)
    assert (last, newest, dangling) == (1, 2, [2]) and commit.read_record(store, 2) is None
    commit.abort_dangling(store, dangling, "the senders restarted", base=last)
    d = commit.read_decision(store, 2)
    assert d["decision"] == "abort" and d["base"] == 1 and d["reason"] == "the senders restarted"
    assert commit.resume_point(store) == (1, 2, [])
    assert len(states) == 2  # (versions 0 and 1)


def test_gc_keeps_the_newest_keyframe_usable(tmp_path):
    """gc collects committed versions up to the newest keyframe, but the keyframe's own version
    keeps its folder: a keyframe counts only while its version's decision says commit. Found by
    the chaos soak: collected, it left no usable keyframe, and the restarted trainer failed with
    'no keyframe at or before version 67 to rebuild it from'. A keyframe of an aborted version
    goes (they piled up, one per trainer restart)."""
    import torch

    from nemo_dcr_callback.protocol.rebuild import latest_keyframe, reconstruct
    from nemo_dcr_callback.testing.tensor_sender import TensorSender
    from tests.helpers.tensors import perturb, same_bits

    store = FileStore(tmp_path / "store")
    states = [versions.model()]
    commit.write_keyframe(store, 0, states[0])
    g = torch.Generator().manual_seed(3)
    for v in range(1, 6):
        states.append({k: perturb(t, 0.05, g) for k, t in states[-1].items()})
        versions.publish(store, v, v - 1, states[-2], states[-1])
        if v == 3:
            commit.write_keyframe(store, 3, states[3])
    states.append({k: perturb(t, 0.05, g) for k, t in states[-1].items()})
    s = TensorSender(states[5], 0, 1)
    for n in s.tensors:
        s.tensors[n] = states[6][n]
    s.write(store, 6, 5, s.take())
    commit.write_keyframe(store, 6, states[6])  # the trainer's keyframe of a version then aborted
    commit.decide(store, 6, 5, "abort", [], [], "test")
    commit.register(store, "rx", 5)
    commit.gc(store)
    commit.gc(store)  # (a second round changes nothing)
    assert commit.list_versions(store) == [3, 4, 5, 6] and commit.keyframes(store) == [3]
    assert store.list("versions/0000000006") == [commit.decision_key(6)]  # (the next number's tombstone)
    assert latest_keyframe(store) == 3
    assert same_bits(reconstruct(store, 5), states[5])  # what a restarted trainer rebuilds


def test_gc_keeps_the_newest_number_taken(tmp_path):
    """An aborted version that is the newest keeps its decision through gc until a later one
    commits: a restarted trainer numbers its versions after it. Found by the chaos soak: a job
    stopped cleanly wrote version 9's abort, gc collected the folder, and the restarted job
    published another version 9 (receivers applied "version 9, which was aborted")."""
    import torch

    from nemo_dcr_callback.testing.tensor_sender import TensorSender
    from tests.helpers.tensors import perturb

    store = FileStore(tmp_path / "store")
    g = torch.Generator().manual_seed(5)
    states = [versions.model()]
    commit.write_keyframe(store, 0, states[0])
    states.append({k: perturb(t, 0.05, g) for k, t in states[0].items()})
    versions.publish(store, 1, 0, states[0], states[1])
    for v in (2, 3):  # aborted: each written on version 1, as after a rollback
        s = TensorSender(states[1], 0, 1)
        for n in s.tensors:
            s.tensors[n] = perturb(states[1][n], 0.05, g)
        s.write(store, v, 1, s.take())
        commit.decide(store, v, 1, "abort", [], [], "test")
    commit.gc(store)
    assert commit.resume_point(store) == (1, 3, [])  # the next version is 4, not 2
    assert commit.list_versions(store) == [1, 3] and store.list("versions/0000000003") == [commit.decision_key(3)]
    states.append({k: perturb(t, 0.05, g) for k, t in states[1].items()})
    versions.publish(store, 4, 1, states[1], states[2])
    commit.gc(store)
    assert 3 not in commit.list_versions(store)  # a later commit: the tombstone goes


def test_a_receiver_still_starting_is_not_counted_in_the_quorum(tmp_path):
    """A serving engine registers while it starts (gc must keep what it holds) but cannot ack
    for minutes. Counted, it made the quorum unreachable whenever two others were under a fault
    (the long soak: a vLLM receiver restarted by kills aborted version after version). Its
    registration says starting; once following, it counts again."""
    from nemo_dcr_callback.config import CommitPolicy

    store = FileStore(tmp_path / "store")
    states = versions.chain(store, 1)
    for name in ("a", "b"):
        commit.register(store, name, 1)
    commit.register(store, "engine", 1, starting=True)
    rec = commit.read_record(store, 1) | {"version": 2, "base": 1}
    for name in ("a", "b"):
        commit.write_ack(store, 2, name, 1)
    policy = CommitPolicy("quorum", timeout=1.0, quorum=1.0)
    d = commit.run_commit(store, rec, policy)
    assert d["decision"] == "commit" and d["acked"] == ["a", "b"], d
    assert set(commit.receivers(store)) == {"a", "b", "engine"}  # (gc still sees it)
    commit.register(store, "engine", 1)  # following now: counted again, and silent
    rec3 = commit.read_record(store, 1) | {"version": 3, "base": 2}
    for name in ("a", "b"):
        commit.write_ack(store, 3, name, 2)
    assert commit.run_commit(store, rec3, policy)["decision"] == "abort"
    assert states  # (the chain the record came from)
