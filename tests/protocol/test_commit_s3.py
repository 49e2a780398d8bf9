"""The joint commit on a real S3 server (SeaweedFS, the `seaweed` fixture): several sender
ranks and acking receivers, one decision however many committers race, the commit policies
(wait, abort, quorum), catching up by chained deltas or from a keyframe, and gc. Senders are
TensorSender ranks (the sender path over canonical tensors held whole, without Megatron
placement); the oracle is the new tensors themselves."""

from __future__ import annotations

import threading

import pytest

from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.rebuild import latest_keyframe
from nemo_dcr_callback.receiver import Follower
from tests.helpers.s3 import commit_version, s3_states, write_version
from tests.helpers.stores import race
from tests.helpers.tensors import same_bits


def test_multi_rank_round_trip_with_acks(s3_store):
    """Four sender ranks, two registered receivers acking: the version commits with both
    acks, and both end bit-exact with the new tensors, digests checked."""
    states = s3_states(1)
    recv = {i: {k: t.clone() for k, t in states[0].items()} for i in range(2)}
    fs = [Follower(s3_store, recv[i], receiver_id=f"worker-{i}", register_every_s=0) for i in range(2)]
    write_version(s3_store, 1, 0, states[0], states[1], world=4)
    rec = commit.seal_version(s3_store, 1, 0, 4, timeout=10)
    assert len(rec["ranks"]) == 4 and rec["digests"]
    done = []
    ths = [threading.Thread(target=lambda f=f: done.append(f.follow(until=1, timeout=30))) for f in fs]
    for t in ths:
        t.start()
    d = commit.run_commit(s3_store, rec, commit.CommitPolicy("wait", timeout=30))
    for t in ths:
        t.join()
    assert d["decision"] == "commit" and d["acked"] == ["worker-0", "worker-1"]
    assert all(same_bits(recv[i], states[1]) for i in range(2))
    assert {r["version"] for r in commit.receivers(s3_store).values()} == {1}


def test_second_committer_refused(s3_store):
    states = s3_states(1)
    write_version(s3_store, 1, 0, states[0], states[1])
    rec = commit.seal_version(s3_store, 1, 0, 2)
    out = race(lambda i: commit.decide(s3_store, 1, 0, ("commit", "abort")[i % 2], [], [], "racer"), 4)
    assert len({o["decision"] for o in out}) == 1  # every writer sees the one decision that stands
    assert commit.read_decision(s3_store, 1)["decision"] == out[0]["decision"]
    assert rec["version"] == 1


def test_policies_abort_and_quorum(s3_store):
    states = s3_states(2)
    commit.register(s3_store, "ok", 0)
    commit.register(s3_store, "ghost", 0)  # never acks
    write_version(s3_store, 1, 0, states[0], states[1])
    rec = commit.seal_version(s3_store, 1, 0, 2)
    commit.write_ack(s3_store, 1, "ok", 0)
    with pytest.raises(commit.CommitTimeout, match="ghost"):
        commit.run_commit(s3_store, rec, commit.CommitPolicy("wait", timeout=0.3))
    assert commit.read_decision(s3_store, 1) is None  # wait: nothing decided, the trainer sees the error
    d = commit.run_commit(s3_store, rec, commit.CommitPolicy("abort", timeout=0.3))
    assert d["decision"] == "abort" and d["lagging"] == ["ghost"]
    write_version(s3_store, 2, 0, states[0], states[2])
    rec2 = commit.seal_version(s3_store, 2, 0, 2)
    commit.write_ack(s3_store, 2, "ok", 0)
    d2 = commit.run_commit(s3_store, rec2, commit.CommitPolicy("quorum", timeout=0.3, quorum=0.5))
    assert d2["decision"] == "commit" and d2["lagging"] == ["ghost"]
    # the lagging receiver catches up later: version 2 builds on 0, which it holds
    tensors = {k: t.clone() for k, t in states[0].items()}
    Follower(s3_store, tensors).poll()
    assert same_bits(tensors, states[2])


def test_catch_up_by_chain_and_new_receiver_by_keyframe(s3_store):
    states = s3_states(5)
    commit.write_keyframe(s3_store, 0, states[0])
    behind = {k: t.clone() for k, t in states[0].items()}
    for v in range(1, 6):
        commit_version(s3_store, v, v - 1, states[v - 1], states[v])
        if v == 2:
            commit.write_keyframe(s3_store, 2, states[2])
    # 5 versions behind (holding 0): chains 1..5
    f = Follower(s3_store, behind)
    applied = f.poll()
    assert [a.version for a in applied] == [1, 2, 3, 4, 5] and same_bits(behind, states[5])
    assert all(a.digest_checked for a in applied)
    # a new receiver: the newest committed keyframe, then deltas
    k = latest_keyframe(s3_store)
    assert k == 2
    from safetensors.torch import load

    fresh = load(s3_store.get(f"{commit.keyframe_dir(k)}/model.safetensors"))
    f2 = Follower(s3_store, fresh, version=k)  # checks the keyframe's digests first
    assert [a.version for a in f2.poll()] == [3, 4, 5] and same_bits(fresh, states[5])


def test_gc_removes_what_nobody_needs(s3_store):
    states = s3_states(4)
    commit.write_keyframe(s3_store, 0, states[0])
    for v in range(1, 4):
        commit_version(s3_store, v, v - 1, states[v - 1], states[v])
    commit.register(s3_store, "slow", 1)
    commit.write_keyframe(s3_store, 3, states[3])
    write_version(s3_store, 4, 3, states[3], states[4])  # sealed but aborted
    commit.decide(s3_store, 4, 3, "abort", [], [], "test")
    from nemo_dcr_callback.tools.status import collect  # `nemo-dcr status` reads the same from S3

    st = collect(s3_store)
    assert [r["state"] for r in st["rows"]] == ["commit", "commit", "commit", "abort"]  # versions 1-4
    assert st["keyframes"] == [0, 3] and [r["receiver"] for r in st["receivers"]] == ["slow"] and st["gc"] > 0
    deleted = commit.gc(s3_store)
    left = commit.list_versions(s3_store)
    # 1 is held by "slow" (it needs 2 and 3); 4 was aborted: only its decision stays (the
    # newest number taken, while no later version committed)
    assert left == [2, 3, 4] and s3_store.list("versions/0000000004") == [commit.decision_key(4)]
    assert commit.keyframes(s3_store) == [3] and any("keyframe/0000000000" in k for k in deleted)
    tensors = {k: t.clone() for k, t in states[1].items()}
    Follower(s3_store, tensors, version=1).poll()  # the slow receiver still catches up
    assert same_bits(tensors, states[3])
