"""The relay's watcher (transport/relay/watcher.py) in-process: how it lists its parent and
pulls what is new. Listings stay current while writes land through the relay, one listing
per prefix with or without its trailing slash, records pulled before queued parts, a child
pulling what its parent announces without listing it, the news feed, the dormant pace and
the back-off on an origin that cannot long-poll."""

from __future__ import annotations

import threading
import time

from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.transport.relay_store import FailoverStore, RelayStore
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.relay import (
    TOKEN,
    publish_version,
    relay_states,
    write_ranks,
)
from tests.helpers.stores import TimedListings
from tests.helpers.tensors import same_bits


def test_listing_keeps_a_key_written_through_while_it_was_on_its_way(tmp_path):
    """The parent lists slowly (S3 under load) and a sender's write through the relay lands in
    between: the listing the relay then holds and serves still has the key (before the fix
    a decision written this way could vanish from the listing for good and receivers hung).
    In-process: the Relay's listing coroutine and the bookkeeping its PUT handler does."""
    import asyncio
    import time

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = FileStore(tmp_path / "origin")
    origin.put("versions/0000000001/VERSION.json", b"{}")
    key = "versions/0000000001/DECISION.json"

    class SlowList:
        url = origin.url

        def list(self, prefix):
            out = origin.list(prefix)
            time.sleep(0.3)  # the answer is on its way while the write lands
            return out

        def __getattr__(self, name):
            return getattr(origin, name)

    async def main():
        relay = Relay(SlowList(), RelayConfig(prefetch=False))
        pending = asyncio.create_task(relay.listing("list", "versions/0000000001", fresh=True))
        await asyncio.sleep(0.1)
        origin.put(key, b"{}")  # what h_put does: the parent takes the write, then the relay notes it
        relay._listed(key)
        fetched = await pending
        return fetched, relay.lists[("list", "versions/0000000001")][1]

    fetched, held = asyncio.run(main())
    assert key in fetched and key in held


def test_a_write_through_in_flight_is_not_fetched_back_from_the_parent(tmp_path):
    """A sender's write through the relay reaches the parent before the relay holds it; a
    watcher round in between must not download the object the relay is being given (CI saw
    the root fetch a part back from the origin once). In-process relay; the parent answers
    the PUT late, after the object is already there."""
    import asyncio
    import time

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = FileStore(tmp_path / "origin")
    origin.put("versions/0000000001/VERSION.json", b"{}")  # a version folder the watcher lists
    key = "versions/0000000001/rank-00000.json"

    class SlowPut:
        url = origin.url

        def put(self, k, data, durable=True):
            origin.put(k, data, durable)
            time.sleep(0.4)  # stored; the answer is on its way while the watcher lists

        def __getattr__(self, name):
            return getattr(origin, name)

    async def main():
        relay = Relay(SlowPut(), RelayConfig(token=TOKEN, poll_s=0.005, idle_poll_s=0.01))
        await relay.start()
        try:
            await asyncio.sleep(0.1)  # the watcher has listed the folder once
            store = RelayStore(f"relay://127.0.0.1:{relay.port}", token=TOKEN)
            await asyncio.get_running_loop().run_in_executor(None, store.put, key, b'{"parts": []}')
            got = await asyncio.get_running_loop().run_in_executor(None, store.get, key)
            await asyncio.sleep(0.1)
            return dict(relay.stats), got
        finally:
            await relay.stop()

    st, got = asyncio.run(main())
    assert got == b'{"parts": []}'
    assert st["objects_in"] == 1 and st["puts"] == 1, st  # only VERSION.json came from the parent


def test_a_listing_asked_with_or_without_a_trailing_slash_is_one_listing(tmp_path):
    """`children("versions")` (a receiver's list of versions) and `children("versions/")` (the
    watcher's) are the same listing in every store; a relay kept them apart, and the one the
    watcher did not keep current went up the tree to the origin on every ask (on S3: about 50
    listings a run at the root relay of the relay bench). In-process relay, watcher off, a
    parent that counts what it is asked."""
    import asyncio

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = FileStore(tmp_path / "origin")
    origin.put("versions/0000000001/VERSION.json", b"{}")
    asked: list[tuple[str, str]] = []

    class Counting:
        url = origin.url

        def children(self, prefix):
            asked.append(("children", prefix))
            return origin.children(prefix)

        def list(self, prefix):
            asked.append(("list", prefix))
            return origin.list(prefix)

        def __getattr__(self, name):
            return getattr(origin, name)

    async def main():
        relay = Relay(Counting(), RelayConfig(token=TOKEN, poll_s=5.0, prefetch=False))
        await relay.start()
        try:
            store = RelayStore(f"relay://127.0.0.1:{relay.port}", token=TOKEN)
            run = asyncio.get_running_loop().run_in_executor
            return [await run(None, f, p) for f, p in ((store.children, "versions/"), (store.children, "versions"),
                                                       (store.list, "versions/0000000001"),
                                                       (store.list, "versions/0000000001/"))]
        finally:
            await relay.stop()

    got = asyncio.run(main())
    assert got[0] == got[1] == ["0000000001"] and got[2] == got[3] == ["versions/0000000001/VERSION.json"]
    assert asked == [("children", "versions"), ("list", "versions/0000000001")], asked


def test_a_record_is_pulled_at_once_not_queued_behind_the_parts(tmp_path):
    """The watcher pulls parts a few at a time; a version's record (small) written while they
    cross a slow link must be pulled at once: receivers apply nothing of a version until they
    see its record. It used to wait until every part listed before it had arrived (in the
    relay bench, about 100 ms per version). In-process relay, a parent whose part downloads
    take 0.4 s each (a slow link)."""
    import asyncio

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = FileStore(tmp_path / "origin")
    states = relay_states(1, n=8)
    write_ranks(origin, 1, states[0], states[1], part_bytes=1)  # one part per chunk
    parts = [k for k in origin.list("versions") if k.endswith(".dcr")]
    assert len(parts) >= 6
    asked: list[str] = []

    class SlowParts:
        url = origin.url

        def get(self, key, limit=None):
            if key.endswith(".dcr"):
                asked.append(key)
                time.sleep(0.4)
            return origin.get(key, limit=limit)

        def __getattr__(self, name):
            return getattr(origin, name)

    record = commit.version_record(1)

    async def main():
        relay = Relay(SlowParts(), RelayConfig(token=TOKEN, poll_s=0.005))
        await relay.start()
        try:
            while not asked:  # the parts are on their way
                await asyncio.sleep(0.005)
            commit.seal_version(origin, 1, 0, 2, timeout=5)
            t0 = time.monotonic()
            while record not in relay.cache and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.005)
            return time.monotonic() - t0, sum(p not in relay.cache for p in parts)
        finally:
            await relay.stop()

    held_after, parts_missing = asyncio.run(main())
    assert held_after < 0.3 and parts_missing >= 4, (held_after, parts_missing)


def test_a_child_relay_pulls_what_its_parent_announces_without_listing_it(tmp_path, relays):
    """Under a relay, the long-poll's answer names the new objects and the watcher pulls them
    at once: it used to list the parent (children, then the version folder) after every
    wake-up first, and on a shaped link those listings queued behind the part bytes on it
    (20-45 ms per part in the relay bench, with the link idle meanwhile). A root relay
    process over a file:// origin; an in-process child whose parent counts its listings."""
    import asyncio

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = FileStore(tmp_path / "origin")
    root = relays(origin.url, "root")
    states = relay_states(1, n=6)
    sender = FileStore(tmp_path / "staging")  # the parts, written first here, then through the root
    write_ranks(sender, 1, states[0], states[1], world=1, part_bytes=1)
    keys = sorted(k for k in sender.list("versions") if k.endswith(".dcr"))
    assert len(keys) >= 4
    up = RelayStore(root.url, token=TOKEN)
    up.put(keys[0], sender.get(keys[0]))  # version 1 exists before the child starts
    listed: list[str] = []

    class Counting:
        url = root.url

        def list(self, prefix):
            listed.append(prefix)
            return up.list(prefix)

        def __getattr__(self, name):
            return getattr(up, name)

    async def main():
        child = Relay(Counting(), RelayConfig(token=TOKEN, poll_s=0.005, write_through_poll_s=30.0))
        await child.start()
        try:
            t0 = time.monotonic()
            while keys[0] not in child.cache and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.005)
            assert keys[0] in child.cache
            await asyncio.sleep(0.3)  # settled: version 1 watched
            before, lags = len(listed), []
            for k in keys[1:]:
                await asyncio.get_running_loop().run_in_executor(None, up.put, k, sender.get(k))
                t0 = time.monotonic()
                while k not in child.cache and time.monotonic() - t0 < 10:
                    await asyncio.sleep(0.002)
                lags.append(time.monotonic() - t0)
                assert k in await child.listing("list", "versions/0000000001")  # listed to its children
            return listed[before:], lags
        finally:
            await child.stop()

    lists, lags = asyncio.run(main())
    assert max(lags) < 1.0, lags
    assert lists == [], f"the child listed the parent {len(lists)} times for {len(keys) - 1} announced parts"


def test_the_news_feed_names_keys_or_says_list(tmp_path):
    """Relay.changed_since: the keys after a generation, oldest first (acks left out for a
    data-only waiter); None (list instead) where the log cannot say: before its start, after a
    change of unknown keys, after something disappeared from a listing."""
    import asyncio

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = FileStore(tmp_path / "origin")
    a, b = "versions/0000000001/rank-00000/part-000000.dcr", "versions/0000000001/rank-00000/part-000001.dcr"
    ack = commit.ack_key(1, "w1")

    async def main():
        relay = Relay(origin, RelayConfig(prefetch=False))
        g0 = relay.gen
        relay._bump(a)
        relay._bump(ack)
        relay._bump(b)
        out = [relay.changed_since(g0, True), relay.changed_since(g0, False), relay.changed_since(relay.gen, True),
               relay.changed_since(g0 - 1, True)]
        origin.put(a, b"x")
        await relay.listing("list", "versions/0000000001", fresh=True)
        g1 = relay.gen
        origin.delete([a])
        await relay.listing("list", "versions/0000000001", fresh=True)  # a is gone
        out.append(relay.changed_since(g1, True))
        g2 = relay.gen
        relay._bump()  # something changed, not known what
        out.append(relay.changed_since(g2, True))
        return out

    data, every, none_new, before_start, gone, unknown = asyncio.run(main())
    assert data == [a, b] and every == [a, ack, b] and none_new == []
    assert before_start is None and gone is None and unknown is None


def test_a_dormant_relay_lists_its_parent_rarely_and_still_finds_a_new_version(tmp_path):
    """Nothing new in the parent and nothing written through for dormant_after_s: the watcher
    lists the parent only every dormant_poll_s (an idle root relay listed S3 25 times a
    second), and an object that then appears upstream is still found and announced."""
    import asyncio

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = TimedListings(FileStore(tmp_path / "origin"))

    async def main():
        relay = Relay(origin, RelayConfig(token=TOKEN, poll_s=0.005, idle_poll_s=0.04, dormant_after_s=0.5,
                                          dormant_poll_s=0.8))
        watcher = asyncio.create_task(relay.watch())
        await asyncio.sleep(1.5)  # awake 0.5 s (listing every 40 ms at most), then dormant
        n0 = len(origin.at)
        await asyncio.sleep(2.0)
        dormant = len(origin.at) - n0
        gen = relay.gen
        key = "versions/0000000001/rank-00000.json"
        origin.store.put(key, b'{"parts": []}')
        t0 = time.monotonic()
        # until the object itself is announced: the new version's folder is announced first,
        # and stopping the watcher at that first change raced the object's pull
        while key not in (relay.changed_since(gen, True) or []) and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        found = time.monotonic() - t0
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        return n0, dormant, found, relay.changed_since(gen, True)

    awake, dormant, found, news = asyncio.run(main())
    assert awake >= 10 and dormant <= 4, (awake, dormant)  # at 40 ms: about 50 in 2 s
    assert found < 2.0 and news is not None and "versions/0000000001/rank-00000.json" in news


def test_a_chain_fallen_back_to_the_origin_is_polled_with_back_off(tmp_path):
    """A failover chain whose relay is gone is on the origin, which cannot long-poll: a relay
    below it and a receiver on it poll it with their idle back-off. Before, the chain's wait
    slept 5 ms whatever the caller's pause: an idle relay listed the origin 180 times a
    second, and a receiver about as often. A version published then still arrives."""
    import asyncio

    from nemo_dcr_callback.receiver.follow import IDLE_AFTER_S
    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    def chain(origin):  # a relay that is not there (port 1), then the origin
        return FailoverStore([RelayStore("relay://127.0.0.1:1", token=TOKEN), origin], quiet=True)

    origin = TimedListings(FileStore(tmp_path / "origin"))

    async def relay_idle():
        relay = Relay(chain(origin), RelayConfig(token=TOKEN, poll_s=0.005, idle_poll_s=0.04))
        watcher = asyncio.create_task(relay.watch())
        await asyncio.sleep(3.0)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)

    t0 = time.monotonic()
    asyncio.run(relay_idle())
    per_s = len([t for t in origin.at if t > t0 + 1.0]) / 2.0
    assert per_s <= 40, per_s  # 25 at the 40 ms cap (180 before)

    origin.at.clear()
    states = relay_states(1)
    recv = {k: t.clone() for k, t in states[0].items()}
    f = Follower(chain(origin), recv, poll_s=0.005, idle_poll_s=0.2)
    th = threading.Thread(target=f.follow, kwargs={"until": 1, "timeout": 30})
    t0 = time.monotonic()
    th.start()
    time.sleep(IDLE_AFTER_S + 2.0)
    idle = [t for t in origin.at if t > t0 + IDLE_AFTER_S + 1.0]
    assert len(idle) <= 8, len(idle)  # the last second, backed off to 0.2 s
    publish_version(origin.store, 1, states[0], states[1])
    th.join(20)
    assert not th.is_alive() and f.version == 1 and same_bits(recv, states[1])


def test_an_undecided_version_stays_followed_and_a_collected_one_is_forgotten(tmp_path):
    """Found by the chaos soak (seed 1). Version 1's commit waits (acks missing) while versions
    2-5 are published: it falls out of the newest few the watcher lists, and its listing here
    used to stay as it was, without the decision, for ever (its receivers never saw it). It
    stays followed until its decision is here. Then gc collects it at the origin: the relay
    forgets it, its listing and its cached objects."""
    import asyncio

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = FileStore(tmp_path / "origin")
    states = relay_states(5, n=2, shape=(64, 33))
    write_ranks(origin, 1, states[0], states[1])
    rec = commit.seal_version(origin, 1, 0, 2, timeout=5)  # sealed, not decided
    vd1 = commit.vdir(1)

    async def until(cond, timeout=10.0):
        t0 = time.monotonic()
        while not cond() and time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.01)
        return cond()

    async def main():
        relay = Relay(origin, RelayConfig(token=TOKEN, poll_s=0.005))
        await relay.start()
        try:
            assert await until(lambda: commit.version_record(1) in relay.cache)
            for v in range(2, 6):  # the trainer goes on; 1 is still undecided
                publish_version(origin, v, states[v - 1], states[v])
            assert await until(lambda: commit.decision_key(5) in relay.cache)
            commit.run_commit(origin, rec, commit.CommitPolicy())  # 1 decided at last
            decided = await until(lambda: commit.decision_key(1) in relay.cache
                                  and commit.decision_key(1) in await_listing(relay, vd1))
            origin.delete_prefix(vd1)  # collected
            forgotten = await until(lambda: vd1 not in relay.watched_dirs and not any(
                k.startswith(vd1 + "/") for k in [*relay.cache.mem, *relay.cache.spilled]))
            return decided, forgotten, await relay.listing("list", vd1)
        finally:
            await relay.stop()

    def await_listing(relay, vd):
        hit = relay.lists.get(("list", vd))
        return hit[1] if hit else []

    decided, forgotten, listed = asyncio.run(main())
    assert decided and forgotten and listed == []
