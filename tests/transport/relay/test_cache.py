"""What a relay serves from what it holds (transport/relay/cache.py, handlers.py), in-process:
an ack written through it is read back without asking the parent and announced while it is
passed up (and taken back when the parent refuses it); a part a stale listing lacks is still
fetched and served."""

from __future__ import annotations

import time

import pytest
import torch

from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.testing.tensor_sender import TensorSender
from nemo_dcr_callback.transport.relay_store import RelayStore
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.relay import (
    TOKEN,
    ack_body,
    version_folder,
)
from tests.helpers.tensors import perturb, random_tensor


def test_an_ack_written_through_a_relay_is_read_back_without_asking_the_parent(tmp_path):
    """The committer reads each ack right after a receiver wrote it through the relay: the
    relay serves what it passed up (for passed_ttl_s) instead of a GET of the origin (on S3,
    16 per version at the bench's root relay). A write of the same key that went around the
    relay shows once that time is up. In-process relay; the parent counts its GETs."""
    import asyncio
    import time

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = FileStore(tmp_path / "origin")
    version_folder(origin, 1)
    key = "versions/0000000001/acks/rx-0.json"
    TTL = 5.0
    gets: list[str] = []

    class Counting:
        url = origin.url

        def get(self, k, limit=None):
            gets.append(k)
            return origin.get(k, limit=limit)

        def __getattr__(self, name):
            return getattr(origin, name)

    async def main():
        # a TTL no host takes to go from the put to the second get (the assertion on `within`
        # used to be dropped on a slow host), and then a wait past it
        relay = Relay(Counting(), RelayConfig(token=TOKEN, prefetch=False, passed_ttl_s=TTL))
        await relay.start()
        try:
            store = RelayStore(f"relay://127.0.0.1:{relay.port}", token=TOKEN)
            run = asyncio.get_running_loop().run_in_executor
            await run(None, store.put, key, ack_body(1, "rx-0"))
            t_put = time.monotonic()
            first = await run(None, store.get, key)
            n_first = len(gets)
            origin.put(key, ack_body(1, "rx-0", ok=False))  # around the relay (a receiver that failed over)
            within = await run(None, store.get, key)
            dt = time.monotonic() - t_put
            await asyncio.sleep(TTL + 0.2 - (time.monotonic() - t_put))
            after = await run(None, store.get, key)
            return first, n_first, within, dt, after
        finally:
            await relay.stop()

    first, n_first, within, dt, after = asyncio.run(main())
    assert first == ack_body(1, "rx-0") and n_first == 0, gets  # served from the relay: the parent was not asked
    assert dt < TTL and within == ack_body(1, "rx-0"), dt  # the relay's copy, not the origin's newer one
    assert after == ack_body(1, "rx-0", ok=False) and gets[-1:] == [key]


def test_an_ack_is_announced_while_passed_up_and_taken_back_if_that_fails(tmp_path):
    """The committer waiting on a relay sees an ack (news, and a GET served from the relay)
    while the relay is still passing it up, not after the origin's write (10-35 ms per ack
    on the bench's SeaweedFS). The writer's PUT returns only once the origin holds it; when
    the origin refuses it, the writer gets the error and the relay serves and lists the ack
    no more. In-process relay over a file:// origin whose writes of acks take 1 s, and fail
    for one receiver's."""
    import asyncio

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = FileStore(tmp_path / "origin")
    version_folder(origin, 1)
    good, bad = commit.ack_key(1, "rx-0"), commit.ack_key(1, "rx-1")

    class SlowAcks:
        url = origin.url

        def put(self, k, data, durable=True):
            time.sleep(1.0)
            if k == bad:
                raise StoreError("origin: disk full")
            return origin.put(k, data, durable)

        def __getattr__(self, name):
            return getattr(origin, name)

    async def main():
        relay = Relay(SlowAcks(), RelayConfig(token=TOKEN, prefetch=False))
        await relay.start()
        try:
            url = f"relay://127.0.0.1:{relay.port}"
            committer, writer = RelayStore(url, token=TOKEN), RelayStore(url, token=TOKEN)
            run = asyncio.get_running_loop().run_in_executor
            await run(None, committer.children, "versions")  # (the version is known here before its acks)
            gen = await run(None, committer.wait, 0, 0.01)
            t0 = time.monotonic()
            put = run(None, writer.put, good, ack_body(1, "rx-0"))
            gen2, news = await run(None, committer.wait_keys, gen, 5.0, False)
            seen = await run(None, committer.get, good)
            seen_after, in_origin = time.monotonic() - t0, origin.exists(good)
            await put
            put_s = time.monotonic() - t0
            with pytest.raises(StoreError, match="disk full|500|502"):
                await run(None, writer.put, bad, ack_body(1, "rx-1"))
            with pytest.raises(KeyError):
                await run(None, committer.get, bad)
            listed = await run(None, committer.list, "versions/0000000001/acks")
            return news, seen, seen_after, in_origin, put_s, listed
        finally:
            await relay.stop()

    news, seen, seen_after, in_origin, put_s, listed = asyncio.run(main())
    assert news == [good] and seen == ack_body(1, "rx-0")
    assert seen_after < 0.8 and not in_origin, (seen_after, in_origin)  # seen before the origin had it
    assert put_s >= 1.0  # the writer's PUT waited for the origin
    assert bad not in listed and good in listed


def test_a_part_missing_from_a_stale_listing_is_still_served(tmp_path):
    """A version's part that the relay's watched listing lacks (a listing answered before the
    part existed, which crossed the shaped link behind queued part bytes and replaced a
    listing the news had already extended) is fetched from the parent, not refused: a
    receiver asks for a part only after seeing it listed or in a manifest. Seen once in the
    relay bench on a slow host: a receiver refused a version ("part missing from the store")
    and it was aborted (how that run's listing went stale was not traced). Records and
    decisions, which receivers ask for before they exist, are still answered from the listing.
    In-process: the watcher's state set as a stale listing leaves it."""
    import asyncio

    from nemo_dcr_callback.transport.relay import Relay, RelayConfig

    origin = FileStore(tmp_path / "origin")
    g = torch.Generator().manual_seed(3)
    cur = {f"w{i}": random_tensor((256, 256), torch.bfloat16, g, specials=False) for i in range(4)}
    sender = TensorSender(cur)
    for k in cur:
        cur[k].copy_(perturb(cur[k], 0.05, g))
    sender.stream(origin, 1, 0, part_bytes=1024)
    vd = commit.vdir(1)
    parts = [k for k in origin.list(vd) if k.endswith(".dcr")]
    assert len(parts) >= 2
    stale = [k for k in origin.list(vd) if k != parts[-1]]  # the last part not in it

    async def main():
        relay = Relay(origin, RelayConfig(token=TOKEN, poll_s=0.005))  # prefetch on: a watched listing
        relay.watched_dirs.add(vd)
        relay.lists[("list", vd)] = (time.monotonic(), stale)
        relay.watch_alive = time.monotonic()
        got = await relay.fetch(parts[-1])
        record = await relay.fetch(commit.decision_key(1))  # not listed, not there: no upstream call
        return got, record, dict(relay.stats["upstream"])

    got, record, upstream = asyncio.run(main())
    assert got is not None and got[0] == origin.get(parts[-1])
    assert record is None and upstream.get("get", 0) == 1
