"""Gaps in a relay's news. A long-poll's token counts one relay process's generations: a
token carried to another relay (the next one of a failover chain) or to a restarted relay at
the same address must not be read as that relay's own, or it says "nothing new since" a
generation the new one never counted. And a follower that is told the news has a gap must not
go on extending the listing it kept from before it. Either way, news the relay already held (a
version's record) was never named, and a follower waited for ever: CI saw it under load, in
test_relay_killed_mid_version_receivers_finish_without_refetching. These tests make the
cases deterministic. Real relay processes; the follower's store is the real RelayStore with
its part fetches held at a gate (the test's hand on the timing, not a fake)."""

from __future__ import annotations

import socket
import threading
import time

from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.transport.relay_store import FailoverStore, RelayStore
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.relay import TOKEN, ack_body, relay_states, version_folder, write_ranks
from tests.helpers.tensors import same_bits


def _run_ahead(store: RelayStore, n: int = 60) -> None:
    """Raise the relay's generation by n (acks written through it: each one is news)."""
    for i in range(n):
        store.put(commit.ack_key(7, f"rx-{i}"), ack_body(7, f"rx-{i}"))


def _holds_parts(url: str, origin: FileStore, v: int) -> None:
    """Wait until the relay's watcher has pulled version v, written to the origin around it."""
    want = set(origin.list(commit.vdir(v)))
    st, deadline = RelayStore(url, token=TOKEN), time.monotonic() + 20
    while not want <= {k for k in want if st.exists(k)}:
        assert time.monotonic() < deadline, "the relay never pulled the objects written to the origin"
        time.sleep(0.02)


def test_a_token_of_the_relay_before_a_failover_means_nothing_after_it(tmp_path, relays):
    origin = FileStore(tmp_path / "origin")
    version_folder(origin, 7)
    a, b = relays(origin.url, "a"), relays(origin.url, "b")
    chain = FailoverStore([RelayStore(a.url, token=TOKEN), RelayStore(b.url, token=TOKEN)], quiet=True)
    _run_ahead(RelayStore(a.url, token=TOKEN))
    token, _ = chain.wait_keys(0, 0.1, True)
    a.stop()
    states = relay_states(1, n=2, shape=(64, 33))
    write_ranks(origin, 1, states[0], states[1], world=1)  # around the relays: b pulls it
    _holds_parts(b.url, origin, 1)
    assert chain.list(commit.vdir(1)) and chain.i == 1  # a call other than the wait moved the chain on
    t0 = time.monotonic()
    _, news = chain.wait_keys(token, 5.0, True)
    # b's news (the version's parts) is named, or the caller is told to list: not "nothing"
    assert news is None or any(k.endswith(".dcr") for k in news), news
    assert time.monotonic() - t0 < 3.0, "the wait ran out: b took a's token for its own"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_token_of_a_relay_restarted_at_the_same_address_is_not_trusted(tmp_path, relays):
    origin = FileStore(tmp_path / "origin")
    version_folder(origin, 7)
    port = str(_free_port())
    first = relays(origin.url, "r", extra=("--listen", f"127.0.0.1:{port}"))
    st = RelayStore(first.url, token=TOKEN)
    _run_ahead(st)
    token, _ = st.wait_keys(0, 0.1, True)
    first.stop()
    second = relays(origin.url, "r", extra=("--listen", f"127.0.0.1:{port}"))
    assert second.url == first.url
    states = relay_states(1, n=2, shape=(64, 33))
    write_ranks(origin, 1, states[0], states[1], world=1)
    _holds_parts(second.url, origin, 1)
    t0 = time.monotonic()
    gen, news = st.wait_keys(token, 5.0, True)
    assert news is None and time.monotonic() - t0 < 3.0, (news, time.monotonic() - t0)
    # and the store now holds the new process's id: its tokens are that process's own again
    fresh = RelayStore(second.url, token=TOKEN)._wait(0, 0.0, False, False)["boot"]
    assert fresh and st._boot == fresh and gen >= 1


class _Gated:
    """A RelayStore whose part fetches wait at a gate (parts stay queued behind the first)."""

    def __init__(self, store: RelayStore):
        self.store, self.gate = store, threading.Event()

    def get(self, key, limit=None):
        if key.endswith(".dcr"):
            assert self.gate.wait(60)
        return self.store.get(key, limit=limit)

    def __getattr__(self, name):
        if name == "get_pieces":  # (fetch_part streams where it can: keep it on get, at the gate)
            raise AttributeError(name)
        return getattr(self.store, name)


def test_a_relay_restarted_under_a_follower_mid_version_loses_it_nothing(tmp_path, relays):
    """The follower lists a version's first parts and queues them (one lane, held at the
    gate); the relay restarts, and the version is sealed and its record written meanwhile.
    The next long-poll says the news has a gap (a token of the process before): a poll with
    parts still queued does not list, and the next news is empty, so the follower must list
    afresh rather than extend the listing that lacks the record."""
    origin = FileStore(tmp_path / "origin")
    port = str(_free_port())
    relay = relays(origin.url, "r", extra=("--listen", f"127.0.0.1:{port}"))
    states = relay_states(1, n=4, shape=(64, 33))
    held = {k: t.clone() for k, t in states[0].items()}
    store = _Gated(RelayStore(relay.url, token=TOKEN))
    f = Follower(store, held, receiver_id="rx-0", poll_s=0.005, fetch_lanes=1)
    errs: list[BaseException] = []

    def run():
        try:
            f.follow(until=1, timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errs.append(exc)

    th = threading.Thread(target=run)
    th.start()
    write_ranks(origin, 1, states[0], states[1], world=1, part_bytes=1)  # one part per tensor
    deadline = time.monotonic() + 20
    while not (1 in f._parts and f._parts[1].queued):
        assert time.monotonic() < deadline and not errs, errs
        time.sleep(0.01)
    relay.stop()
    rec = commit.seal_version(origin, 1, 0, 1, timeout=30)
    relay = relays(origin.url, "r", extra=("--listen", f"127.0.0.1:{port}"))
    _holds_parts(relay.url, origin, 1)
    time.sleep(3)  # the follower's long-polls: the gap, then news with nothing in it
    store.gate.set()
    d = commit.run_commit(origin, rec, commit.CommitPolicy("wait", timeout=30), expected=["rx-0"])
    th.join(30)
    assert not errs and d["decision"] == "commit", (errs, d)
    assert f.version == 1 and same_bits(held, states[1])
