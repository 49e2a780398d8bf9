"""Mid-refit failures of the store and of receivers, on real parts: SeaweedFS behind a
fault-injecting proxy (tests/faults/faultproxy.py), senders (TensorSender ranks + the commit
protocol), followers as receivers. Store errors are retried, a store down for good aborts the
version and restores the baselines, damaged chunks are refused and resent, and wrong, slow
or silent receivers are handled by the commit policy. Each test proves: every receiver ends
bit-exact with the dense weights of the last committed version (the oracle: the sender's
BF16 tensors), nothing unverified is ever applied, and no wait is unbounded. Each adds a row
to the fault table (docs/FAULTS.md)."""

from __future__ import annotations

import time

import pytest
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.testing.tensor_sender import TensorSender
from tests.helpers.faults import Fleet, clone_state, fault_states, send_version, version_bytes
from tests.helpers.tensors import same_bits


# ------------------------------------------------------------------ the store misbehaves
@pytest.mark.parametrize("fault", ["5xx", "throttle", "timeout", "reset", "truncated-body"])
def test_store_faults_are_retried(stores, proxy, table, fault):
    """Transient store failures on uploads and downloads: retried with backoff, nothing lost."""
    via, direct = stores
    states = fault_states(1)
    part = r"/rank-\d+/part-\d+\.dcr"
    if fault == "5xx":
        rules = [proxy.add(method="PUT", path=part, times=3), proxy.add(method="GET", path=part, times=3)]
    elif fault == "throttle":
        rules = [proxy.add(method="PUT", path=part, code="SlowDown", times=3),
                 proxy.add(method="GET", path=part, code="SlowDown", times=3)]
    elif fault == "timeout":
        rules = [proxy.add(method="GET", path=part, action="delay", delay_s=3.0, times=2)]
    elif fault == "reset":
        rules = [proxy.add(method="PUT", path=part, action="reset", times=2),
                 proxy.add(method="GET", path=part, action="reset", times=2)]
    else:
        rules = [proxy.add(method="GET", path=part, action="truncate", times=2)]
    fleet = Fleet(via, states[0])
    fleet.run(until=1)
    t0 = time.perf_counter()
    senders = send_version(via, 1, 0, states[0], states[1])
    d = commit.run_commit(via, commit.seal_version(via, 1, 0, 2, timeout=30), commit.CommitPolicy("wait", 60))
    fleet.join()
    assert not fleet.errors, fleet.errors
    assert d["decision"] == "commit" and all(same_bits(t, states[1]) for t in fleet.tensors)
    for s in senders:
        s.settle()
    assert all(r.hits == r.times for r in rules), [(r.method, r.hits) for r in rules]
    resent = sum(r.hit_bytes for r in rules)
    table(f"store: {fault} on part uploads/downloads ({sum(r.hits for r in rules)} requests)",
          "retried with backoff; version committed; receivers bit-exact", time.perf_counter() - t0, resent)


def test_store_down_aborts_and_restores_then_recovers(stores, proxy, table):
    """The store refuses every part upload: the sender's upload fails with a clear error after
    bounded retries, the version is aborted and the baseline restored bit-exact; once the store
    is back, the next version carries every change and receivers end bit-exact."""
    via, direct = stores
    states = fault_states(2)
    fleet = Fleet(via, states[0])
    fleet.run(until=2)
    proxy.add(method="PUT", path=r"/rank-00000/part-", times=-1)
    s0 = TensorSender(states[0], 0, 2)
    s1 = TensorSender(states[0], 1, 2)
    for s in (s0, s1):
        for n in s.tensors:
            s.tensors[n] = states[1][n]
    t0 = time.perf_counter()
    s1.stream(via, 1, 0, part_bytes=16 << 10)
    with pytest.raises(StoreError, match="503|ServiceUnavailable"):
        s0.stream(via, 1, 0, part_bytes=16 << 10)
    for s in (s0, s1):
        s.roll_back()  # the trainer's undo: baselines back to version 0
    for s in (s0, s1):
        assert all(torch.equal(bits(s.baselines[n].view(states[0][n].shape)), bits(states[0][n])) for n in s.tensors)
    commit.decide(direct, 1, 0, "abort", [], [], "rank 0 upload failed")
    proxy.clear()
    senders = send_version(via, 2, 0, states[0], states[2])
    d = commit.run_commit(via, commit.seal_version(via, 2, 0, 2, timeout=30), commit.CommitPolicy("wait", 60))
    fleet.join()
    assert not fleet.errors, fleet.errors
    assert d["decision"] == "commit" and all(same_bits(t, states[2]) for t in fleet.tensors)
    for f in fleet.followers:
        assert f.version == 2
    del senders
    table("store: down for every part upload of one rank",
          "clear StoreError after bounded retries; version aborted, baselines restored bit-exact; next version "
          "carries all changes; receivers bit-exact", time.perf_counter() - t0, version_bytes(direct, 2))


# ------------------------------------------------------------------ chunks damaged in the store
def _tamper(direct, v, how):
    """Damage at rest (bit rot, a broken copy): history objects are create-only through the
    store's API, so each damaged object is deleted and written anew."""
    parts = sorted(k for k in direct.list(commit.vdir(v)) if k.endswith(".dcr"))
    a, b = parts[0], parts[1]
    blob = direct.get(a)

    def rewrite(key, data):
        direct.delete([key])
        direct.put(key, data)

    if how == "corrupt":
        x = bytearray(blob)
        x[len(x) // 2] ^= 0x10
        rewrite(a, bytes(x))
    elif how == "truncated":
        rewrite(a, blob[: len(blob) - 100])
    elif how == "missing":
        direct.delete([a])
    elif how == "duplicated":  # a chunk repeated inside a part
        first = codec.split_chunks(blob)[0]
        rewrite(a, blob + bytes(first))
    elif how == "reordered":  # two parts' contents swapped
        rewrite(a, direct.get(b))
        rewrite(b, blob)


@pytest.mark.parametrize("how", ["corrupt", "truncated", "missing", "duplicated", "reordered"])
def test_damaged_chunks_refused_aborted_and_resent(stores, table, how):
    """A damaged version is refused by every receiver (ack with the reason), aborted by the
    committer, undone at the sender; receivers' weights are untouched; the next version
    resends the changes and everyone ends bit-exact."""
    via, direct = stores
    states = fault_states(2)
    fleet = Fleet(direct, states[0])
    senders = send_version(direct, 1, 0, states[0], states[1])
    _tamper(direct, 1, how)
    rec = commit.seal_version(direct, 1, 0, 2, timeout=30)
    fleet.run(until=2)
    t0 = time.perf_counter()
    d = commit.run_commit(direct, rec, commit.CommitPolicy("abort", timeout=30))
    assert d["decision"] == "abort", d
    acks = commit.read_acks(direct, 1)  # the first refusal aborts: a receiver that sees the abort
    assert acks and not any(a["ok"] for a in acks.values())  # first skips the version without an ack
    reason = next(iter(acks.values()))["error"]
    assert {"corrupt": "checksum", "truncated": "truncated", "missing": "missing", "duplicated": "manifest",
            "reordered": "manifest"}[how] in reason, reason
    assert all(same_bits(t, states[0]) for t in fleet.tensors)  # nothing of the damaged version applied
    for s in senders:
        s.roll_back()
    send_version(direct, 2, 0, states[0], states[2])
    d2 = commit.run_commit(direct, commit.seal_version(direct, 2, 0, 2, timeout=30), commit.CommitPolicy("wait", 60))
    fleet.join()
    assert not fleet.errors, fleet.errors
    assert d2["decision"] == "commit" and all(same_bits(t, states[2]) for t in fleet.tensors)
    table(f"chunk {how} in the store", f"refused by every receiver (ack: \"{reason.split('.dcr: ', 1)[-1][:64]}\"); "
          "aborted, sender undone, weights untouched; next version applied bit-exact",
          time.perf_counter() - t0, version_bytes(direct, 2))


def test_delayed_part_waits_bounded(stores, proxy, table):
    """A part that arrives late (a slow path to the store) delays the version, nothing else."""
    via, direct = stores
    states = fault_states(1)
    rule = proxy.add(method="GET", path=r"/rank-00001/part-000000\.dcr", action="delay", delay_s=1.5, times=2)
    fleet = Fleet(via, states[0])
    fleet.run(until=1)
    t0 = time.perf_counter()
    send_version(direct, 1, 0, states[0], states[1])
    d = commit.run_commit(direct, commit.seal_version(direct, 1, 0, 2, timeout=30), commit.CommitPolicy("wait", 30))
    fleet.join()
    took = time.perf_counter() - t0
    assert not fleet.errors and d["decision"] == "commit" and rule.hits == 2
    assert all(same_bits(t, states[1]) for t in fleet.tensors) and took >= 1.5
    table("chunk delayed 1.5 s (acks late)", "waited (bounded by the decision timeout); committed; bit-exact", took,
          rule.hit_bytes)


# ------------------------------------------------------------------ receivers that are wrong or slow
def test_wrong_baseline_or_wrong_model_refused(stores, table):
    via, direct = stores
    states = fault_states(2)
    send_version(direct, 1, 0, states[0], states[1])
    commit.run_commit(direct, commit.seal_version(direct, 1, 0, 2, timeout=30), commit.CommitPolicy("wait", 30))
    skipped = clone_state(states[2])  # holds something else but claims version 1
    with pytest.raises(codec.ChunkError, match="does not hold version 1"):
        Follower(direct, skipped, version=1)
    assert same_bits(skipped, states[2])
    wrong = {k.replace("layer", "block"): v for k, v in clone_state(states[0]).items()}
    with pytest.raises(codec.ChunkError, match="no tensor"):
        Follower(direct, wrong).apply_version(1)
    assert all(torch.equal(bits(wrong[k.replace("layer", "block")]), bits(states[0][k])) for k in states[0])
    table("receiver at the wrong baseline / with the wrong model",
          "refused at start-up (digests) / before any write (tensor names); weights untouched", None, None)


@pytest.mark.parametrize("policy", ["wait", "abort", "quorum"])
def test_acks_that_never_come(stores, table, policy):
    """One registered receiver never acks: wait -> a clear CommitTimeout (the trainer sees it,
    nothing committed); abort -> aborted and undone; quorum -> committed, the silent one marked
    lagging, and it catches up by chained deltas later, bit-exact."""
    via, direct = stores
    states = fault_states(2)
    commit.register(direct, "silent", 0)
    fleet = Fleet(direct, states[0], n=1, decision_timeout=4.0)
    fleet.run(until=1, timeout=4.0)  # rx-0 acks; under wait/abort it then sees no commit and times out
    senders = send_version(direct, 1, 0, states[0], states[1])
    rec = commit.seal_version(direct, 1, 0, 2, timeout=30)
    pol = commit.CommitPolicy(policy, timeout=1.0, quorum=0.5)
    t0 = time.perf_counter()
    if policy == "wait":
        with pytest.raises(commit.CommitTimeout, match="no ack from \\['silent'\\]"):
            commit.run_commit(direct, rec, pol)
        outcome = "CommitTimeout after the ack timeout, naming the receiver; nothing committed"
        assert commit.read_decision(direct, 1) is None
    else:
        d = commit.run_commit(direct, rec, pol)
        if policy == "abort":
            assert d["decision"] == "abort" and d["lagging"] == ["silent"]
            for s in senders:
                s.roll_back()
            outcome = "aborted after the ack timeout; sender undone"
        else:
            assert d["decision"] == "commit" and d["lagging"] == ["silent"] and d["acked"] == ["rx-0"]
            late = Follower(direct, clone_state(states[0]), receiver_id="silent")
            late.follow(until=1, timeout=30)
            assert same_bits(late.tensors, states[1])
            outcome = "committed by quorum; the silent receiver marked lagging, later caught up bit-exact"
    took = time.perf_counter() - t0
    assert took < 5.0  # bounded: the ack timeout, not forever
    fleet.join(30)
    if policy == "quorum":
        assert not fleet.errors and all(same_bits(t, states[1]) for t in fleet.tensors)
    else:  # the receiver that acked holds version 0, untouched, and says why it stopped
        assert all(same_bits(t, states[0]) for t in fleet.tensors)
        assert all(isinstance(e, TimeoutError) for e in fleet.errors), fleet.errors
    table(f"acks never come (policy {policy})", outcome, took, 0)
