"""A relay's watcher: it pulls every new object of the newest versions from the parent as soon
as the parent has it (Relay.watch).

Parts are pulled in order and a few at a time (so the first parts arrive, and flow on, first).
The pulls run as tasks: the watcher goes on listing the parent meanwhile, and a manifest,
record or decision (small) is pulled at once, not queued behind the parts on the link (a
version's record waited there for the last parts, and receivers applied nothing until it
came).

Under a relay, the long-poll's answer names the new keys (Relay.changed_since): a new object
of a version being pulled is pulled at once, without listing the parent first. Those listings
crossed the link behind the part bytes queued on it, and cost 20-45 ms per part on the relay
bench's shaped links while the link sat idle. The parent is still listed when the answer
cannot name the keys, when a new version appears, and at least every `write_through_poll_s`.
"""

from __future__ import annotations

import asyncio
import time

from nemo_dcr_callback.protocol import keys
from nemo_dcr_callback.protocol.store import backoff, long_polls
from nemo_dcr_callback.transport.relay.config import WRITE_THROUGH_S

FOLLOWED_VERSIONS = 3  # the newest versions a listing round looks into


class Watcher:
    """One relay's watcher loop and what it keeps between rounds."""

    def __init__(self, relay):
        self.relay, self.cfg = relay, relay.cfg
        self.lanes = asyncio.Semaphore(self.cfg.lanes)  # parts pulled at once
        self.pulling: set[str] = set()  # keys whose pull is under way
        self.parent_gen = 0  # the parent relay's generation last seen (its long-poll)
        self.news: list[str] | None = None  # keys the parent's last long-poll named (None: list)
        self.pause = self.cfg.poll_s  # the current pause between polls of a parent that does not long-poll
        self.listed_at = -1e9  # when the parent was last listed

    async def run(self) -> None:
        while True:
            if self.news is None or not self.take_news(self.news) or self._listing_due():
                await self.list_parent()
            self.news = None
            if not await self.long_poll():
                await asyncio.sleep(self.idle_pause())

    def _listing_due(self) -> bool:
        return time.monotonic() - self.listed_at > self.cfg.write_through_poll_s

    # ------------------------------------------------------------ finding new objects
    async def list_parent(self) -> None:
        """List the parent's newest versions and pull what is new in them."""
        r = self.relay
        r._upstream_news = False
        self.listed_at = time.monotonic()
        try:
            listed = await r.listing("children", keys.VERSIONS, fresh=True)
            versions = [v for v in listed if keys.version_of(v) is not None]
            self._forget_collected({keys.vdir(v) for v in versions})
            # An older version followed before stays followed until its decision is here: one
            # that fell out of the newest few undecided (its commit waited on acks while the
            # trainer went on) was served as last listed, without its decision, for ever.
            older = [v for v in versions[:-FOLLOWED_VERSIONS]
                     if keys.vdir(v) in r.watched_dirs and keys.vdir(v) not in r.done_versions]
            for v in older + versions[-FOLLOWED_VERSIONS:]:
                await self._list_version(v)
            r.watch_alive = time.monotonic()
        except (OSError, KeyError):
            pass  # the parent chain re-attaches; try again next round

    def _forget_collected(self, present: set[str]) -> None:
        """Version folders the parent no longer lists (gc collected them) are no longer kept
        current here: a listing of one goes up to the parent (and finds it gone), and what
        was kept about it does not grow with every version of a long run."""
        r = self.relay
        gone = (r.watched_dirs | r.done_versions) - present
        for vd in gone:
            r.watched_dirs.discard(vd)
            r.done_versions.discard(vd)
            r.lists.pop(("list", vd), None)
        if gone:  # and their objects (and dense exports) leave the cache: nobody can ask for them now
            dirs = tuple(f"{d}/" for vd in gone for d in (vd, keys.verify_dir(vd.rsplit("/", 1)[1])))
            for k in [k for k in [*r.cache.mem, *r.cache.spilled] if k.startswith(dirs)]:
                r.cache.drop(k)

    async def _list_version(self, v: str) -> None:
        """Follow one version (its folder name, as listed) until its decision is held here."""
        r = self.relay
        vd = keys.vdir(v)
        if vd in r.done_versions:
            return
        found = [k for k in await r.listing("list", vd, fresh=True) if not keys.is_mutable(k)]
        r.watched_dirs.add(vd)
        self.start(found)
        if keys.decision_key(v) in r.cache:
            r.done_versions.add(vd)

    def take_news(self, news: list[str]) -> bool:
        """Start pulling the new objects of followed versions; False if a listing is due."""
        r = self.relay
        new = []
        for k in news:
            vd = keys.version_dir_of(k)
            if vd is None:
                return False  # a new version, or something outside the versions: list
            if vd in r.done_versions or keys.is_mutable(k):
                continue
            names = r._watched_listing(k)
            if vd not in r.watched_dirs or names is None:
                return False
            if k not in names:
                r._add_listed(k)
                r._bump(k)  # children see it listed now (the pull's hold then wakes nobody)
            new.append(k)
        self.start(new)
        r.watch_alive = time.monotonic()
        return True

    async def long_poll(self) -> bool:
        """With a relay above: wait for its news (self.news). False where the parent does not
        long-poll, or the long-poll failed: then the caller pauses before listing again (a
        failover chain that fell back to the origin listed it 180 times a second when idle)."""
        r = self.relay
        if not long_polls(r.parent):
            return False
        try:
            self.parent_gen, self.news = await r._up(r.parent.wait_keys, self.parent_gen, 1.0, True)
            return True
        except OSError:
            return False

    def idle_pause(self) -> float:
        """Nothing new from the parent: back off (up to idle_poll_s, or write_through_poll_s
        while senders write through this relay, or dormant_poll_s once dormant)."""
        r, cfg = self.relay, self.cfg
        cap = cfg.idle_poll_s
        now = time.monotonic()
        if now - r.immutable_put_at < WRITE_THROUGH_S:
            cap = max(cap, cfg.write_through_poll_s)
        elif now - max(r.new_at, r.immutable_put_at) > cfg.dormant_after_s:
            cap = max(cap, cfg.dormant_poll_s)
        self.pause = cfg.poll_s if r._upstream_news else backoff(self.pause, cfg.poll_s, cap)
        return self.pause

    # ------------------------------------------------------------ pulling them
    def start(self, found: list[str]) -> None:
        """Pull each key not held, fetched or pulled already, as a task."""
        r = self.relay
        todo = [k for k in found if k not in r.cache and k not in r.inflight
                and k not in r.writing and k not in self.pulling]
        # manifests and records first: parts are then checked against them too
        todo.sort(key=lambda k: (not k.endswith(".json"), k))
        for k in todo:
            self.pulling.add(k)
            t = asyncio.create_task(self._pull(k))
            r._pulls.add(t)  # (held: the loop keeps only weak references to tasks)
            t.add_done_callback(r._pulls.discard)

    async def _pull(self, k: str) -> None:
        try:
            if k.endswith(".json"):
                await self.relay.fetch(k)
            else:
                async with self.lanes:  # FIFO: parts in the order they were listed
                    await self.relay.fetch(k)
        except Exception:  # noqa: BLE001 - counted by fetch; asked again next round, or by a child
            pass  # (which then gets the error); also the pool shut down under a stopping relay
        finally:
            self.pulling.discard(k)
