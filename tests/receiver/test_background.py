"""BackgroundFollower: everything but the apply runs on its own thread; the apply runs on the
thread that calls apply_ready (a serving engine's step boundary). Oracle: the published
states themselves (the dense tensors each version was made from)."""

from __future__ import annotations

import threading
import time

import torch

from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.receiver.background import BackgroundFollower
from nemo_dcr_callback.receiver.targets import StateDictTarget
from nemo_dcr_callback.testing.tensor_sender import TensorSender
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers import versions
from tests.helpers.tensors import perturb


class _Threads(StateDictTarget):
    """Records the thread of every apply."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.threads: list[int] = []

    def apply_with_terms(self, decoded):
        self.threads.append(threading.get_ident())
        return super().apply_with_terms(decoded)


def _states(n=3, seed=1):
    states = [versions.model()]
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        states.append({k: perturb(t, 0.05, g) for k, t in states[-1].items()})
    return states


def _same(tensors, state) -> bool:
    return all(torch.equal(bits(tensors[k]), bits(state[k])) for k in state)


def _until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_versions_are_readied_in_the_background_and_applied_by_the_caller(tmp_path):
    store = FileStore(tmp_path)
    states = _states()
    tensors = {k: t.clone() for k, t in states[0].items()}
    target = _Threads(tensors)
    bf = BackgroundFollower(store, target, 0, poll_s=0.01)
    try:
        for v in (1, 2):
            versions.publish(store, v, v - 1, states[v - 1], states[v])
        _until(lambda: bf._jobs.qsize() == 1)  # version 1 fetched, checked, decoded meanwhile...
        time.sleep(0.1)
        assert _same(tensors, states[0]) and bf.version == 0  # ...and nothing applied off the caller's thread
        up = bf.apply_ready(until=1)  # only up to 1, though 2 is sealed (and readied next)
        assert up.applied == [1] and up.version == 1 and _same(tensors, states[1])
        _until(lambda: bf._jobs.qsize() == 1)
        time.sleep(0.1)
        assert bf.version == 1
        up = bf.apply_ready()  # everything sealed now: 2
        assert up.applied == [2] and up.version == 2 and up.refused is None
        assert _same(tensors, states[2])
        assert set(target.threads) == {threading.get_ident()}
        assert up.changed == set(states[0])
        versions.publish(store, 3, 2, states[2], states[3])
        assert bf.apply_ready(until=3).applied == [3] and _same(tensors, states[3])
        assert bf.apply_ready(wait=False).applied == []  # nothing new
    finally:
        bf.stop()
    assert bf.error is None


def test_a_corrupt_version_is_refused_with_the_weights_untouched(tmp_path):
    store = FileStore(tmp_path)
    states = _states(2)
    tensors = {k: t.clone() for k, t in states[0].items()}
    bf = BackgroundFollower(store, tensors, 0, poll_s=0.01)
    try:
        versions.publish(store, 1, 0, states[0], states[1])
        assert bf.apply_ready().applied == [1]
        # written elsewhere and copied in damaged (versions.copy_damaged says why)
        stage = FileStore(tmp_path / "staging")
        for r in range(2):
            s = TensorSender(states[1], r, 2)
            s.tensors = {n: states[2][n] for n in s.tensors}
            s.write(stage, 2, 1, s.take())
        versions.copy_damaged(stage, store, 2, commit.part_key(2, 1, 0))
        commit.run_commit(store, commit.seal_version(store, 2, 1, 2, timeout=5), commit.CommitPolicy())
        up = bf.apply_ready(timeout=10)
        assert up.applied == [] and up.version == 1 and "version 2" in up.refused, up
        assert _same(tensors, states[1])
    finally:
        bf.stop()


def test_the_ack_and_the_decision_do_not_wait_for_the_caller(tmp_path):
    """With a receiver id the follower acks from the background: the joint commit is decided
    while the serving thread has not called apply_ready yet."""
    store = FileStore(tmp_path)
    states = _states(1)
    tensors = {k: t.clone() for k, t in states[0].items()}
    bf = BackgroundFollower(store, tensors, 0, poll_s=0.01, receiver_id="rx-0")
    try:
        s = TensorSender(states[0], 0, 1)
        s.tensors = dict(states[1])
        s.write(store, 1, 0, s.take())
        rec = commit.seal_version(store, 1, 0, 1, timeout=10)
        d = commit.run_commit(store, rec, commit.CommitPolicy("wait", 20), expected=["rx-0"])
        assert d["decision"] == "commit" and d["acked"] == ["rx-0"]
        assert _same(tensors, states[0])  # decided, not yet applied
        assert bf.apply_ready().applied == [1] and _same(tensors, states[1])
    finally:
        bf.stop()


def test_stop_ends_the_thread(tmp_path):
    bf = BackgroundFollower(FileStore(tmp_path), {k: t.clone() for k, t in versions.model().items()}, 0)
    bf.stop()
    assert not bf._thread.is_alive()


def test_an_aborted_version_before_the_goal_is_skipped_not_the_end_of_the_wait(tmp_path):
    """apply_ready(until=2) with version 1 aborted waits for 2 (based on 0) and applies it; it
    stopped at once before, holding 0, when called before the background had read 2."""
    store = FileStore(tmp_path)
    states = _states(2)
    tensors = {k: t.clone() for k, t in states[0].items()}
    s = TensorSender(states[0], 0, 1)
    s.tensors = dict(states[1])
    s.write(store, 1, 0, s.take())
    commit.seal_version(store, 1, 0, 1, timeout=10)
    commit.decide(store, 1, 0, "abort", [], [], "test")
    bf = BackgroundFollower(store, tensors, 0, poll_s=0.2)
    try:
        # (2 is published after the follower started and before its next poll)
        versions.publish(store, 2, 0, states[0], states[2])
        up = bf.apply_ready(until=2, timeout=10)
        assert up.applied == [2] and up.version == 2 and _same(tensors, states[2]), up
        assert bf.apply_ready(until=2).applied == []  # everything up to the goal is aborted or held
    finally:
        bf.stop()
