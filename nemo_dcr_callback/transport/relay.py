"""`nemo-dcr relay`: one node of the relay tree (docs/RELAY.md).

A relay serves the store's key space (the commit protocol's objects, docs/PROTOCOL.md) to
its children (relays below it, receivers in its region) over HTTP, and fetches each object
from its parent (the origin store, or the relay above it) once:

- Prefetch: a watcher lists the parent's newest versions every `poll_s` and pulls every new
  part, manifest, record and decision as soon as it appears, so parts flow down the tree
  while the senders are still writing later parts (the unit is one part, a few MB: nothing
  waits for a whole version).
- Dedupe: concurrent requests for one key share one upstream fetch; immutable objects are
  cached (memory, LRU, spilling to disk), so each byte crosses the link above a relay once
  whatever the number of children.
- Verify before forwarding: every chunk of a part is checked (codec checksums, and the part
  against its rank manifest when that is known), JSON must parse; an object that fails is
  counted, never cached and never served (the child gets 502 and re-attaches elsewhere).
- Writes (receiver registrations, acks) are passed up to the parent, so acks reach the
  joint commit at the origin; conditional writes keep their If-None-Match meaning.
- Senders may write through the root relay (store URL `relay://root,s3://...`): each object
  is verified, passed up to the origin, then held and announced at once, so it flows down
  the tree without waiting for the watcher to find it in the origin; a committer reading
  acks through the relay long-polls instead of polling the origin.
- The watcher lists the parent every `poll_s` while rounds find objects it did not hold
  already, and backs off (up to `idle_poll_s`) otherwise, and once nothing new has turned
  up for `dormant_after_s` only lists every `dormant_poll_s`, so an idle tree does not keep
  the origin busy. Writes through this relay are held and listed as they come: they are no
  reason to list the parent. While senders write through it, the parent is listed only every
  `write_through_poll_s`, for writes that went around the relay (a sender's failover): on
  SeaweedFS a listing costs the relay 1.5-5 ms of CPU (boto3) and the server about 1 ms.
- News: a long-poll with `keys=1` is answered with the keys new since the caller's
  generation (or null: list), so a child relay, a receiver or a committer below learns what
  to fetch without listing (Relay.changed_since).
- Peers authenticate with a shared token (Authorization: Bearer); TLS is optional.

The parent is any store (transport.store.open_store): a comma-separated list of URLs makes
a failover chain (parent, grandparent, ..., origin), which is how a relay re-attaches when
its parent dies.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import xxhash
from aiohttp import web

from nemo_dcr_callback import codec
from nemo_dcr_callback.transport.store import backoff, long_polls

CHECKSUM_HEADER = "X-DCR-XXH3"
# A relay that held a sender's write within this long counts as written through (its watcher
# then lists the parent only every write_through_poll_s): a trainer's steps, and so its
# versions, come seconds apart, and between them the relay polled the origin 25 times a second.
WRITE_THROUGH_S = 30.0


def _peer(request) -> str | None:
    """host:port of the client (the port tells apart receivers that share a host)."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"{peer[0]}:{peer[1]}"
    return request.remote


@dataclass
class RelayConfig:
    """How one relay node runs; every field is a `nemo-dcr relay` flag."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port (printed on start)
    token: str | None = None  # shared token peers must present; None: no authentication (loopback trials)
    name: str = "relay"
    cache_mb: int = 1024  # memory for cached objects; beyond it, LRU objects spill to disk
    spill_dir: str | None = None  # None: evicted objects are dropped (and refetched if asked again)
    spill_mb: int = 8192
    poll_s: float = 0.005  # how often the watcher lists the parent; also the TTL of cached listings
    idle_poll_s: float = 0.04  # the watcher's longest pause after rounds that found nothing new
    # ... while senders write through this relay (an immutable object within the last
    # WRITE_THROUGH_S): their objects arrive here directly, and listing the parent only catches
    # writes that went around the relay (a sender's failover), so it is listed this rarely. On
    # S3 a listing costs the relay 1.5-5 ms of CPU (boto3 parses XML); at 0.25 s the bench's
    # root relay listed S3 5-6 times per version.
    write_through_poll_s: float = 1.0
    # ... and once nothing new has turned up in the parent or been written through this relay
    # for dormant_after_s (no training running, or steps minutes apart): an idle root relay
    # listed S3 25 times a second (3.5% of a core here, 6% in SeaweedFS; on AWS, LIST requests
    # are billed). A version that then starts around the relay is seen up to this much later.
    dormant_after_s: float = 60.0
    dormant_poll_s: float = 1.0
    # a mutable object (an ack, a registration) written through this relay is served from here
    # for this long: the committer reads each ack right after it is written and every
    # registration at each version, and those reads then need no round trip to the origin (on
    # S3: 24 GETs per version at the root relay of the relay bench). What the relay passed up is
    # what the origin holds unless the same key was written around the relay since (a
    # failover), which shows after at most this: acks are written once per receiver and
    # version, and registrations, rewritten by their receiver every 30 s, are read for
    # membership and liveness (600 s), which a copy this old does not change.
    passed_ttl_s: float = 60.0
    prefetch: bool = True  # pull new versions ahead of requests
    threads: int = 16  # concurrent upstream requests
    lanes: int = 2  # parts pulled at once by the watcher (in order: the first ones arrive first)
    tls_cert: str | None = None
    tls_key: str | None = None
    fault: str | None = field(default_factory=lambda: os.environ.get("NEMO_DCR_RELAY_FAULT"))  # tests only
    # a file getting one JSON line per request served and per call to the parent (None: off):
    # what was asked, answered and fetched, and when, to trace a refusal back to its cause
    access_log: str | None = None


def mutable(key: str) -> bool:
    """Objects that may change or appear at any time: never cached as present."""
    return key.startswith("receivers/") or "/acks/" in key


class Cache:
    """Immutable objects by key: memory up to a budget, then LRU spill to a directory."""

    def __init__(self, mem_bytes: int, spill_dir: str | None, spill_bytes: int):
        self.mem: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self.mem_bytes, self.used = mem_bytes, 0
        self.spill = Path(spill_dir) if spill_dir else None
        self.spilled: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self.spill_bytes, self.spill_used = spill_bytes, 0
        if self.spill:
            self.spill.mkdir(parents=True, exist_ok=True)

    def _file(self, key: str) -> Path:
        return self.spill / xxhash.xxh3_128_hexdigest(key.encode())

    def put(self, key: str, data: bytes, digest: str) -> None:
        if key in self.mem:
            return
        self.mem[key] = (data, digest)
        self.used += len(data)
        while self.used > self.mem_bytes and len(self.mem) > 1:
            k, (d, h) = self.mem.popitem(last=False)
            self.used -= len(d)
            if self.spill and len(d) <= self.spill_bytes:
                self._file(k).write_bytes(d)
                self.spilled[k] = (len(d), h)
                self.spill_used += len(d)
                while self.spill_used > self.spill_bytes:
                    old, (n, _) = self.spilled.popitem(last=False)
                    self._file(old).unlink(missing_ok=True)
                    self.spill_used -= n

    def drop(self, key: str) -> None:
        d = self.mem.pop(key, None)
        if d is not None:
            self.used -= len(d[0])
        if self.spill and self.spilled.pop(key, None) is not None:
            self._file(key).unlink(missing_ok=True)

    def get(self, key: str) -> tuple[bytes, str] | None:
        hit = self.mem.get(key)
        if hit is not None:
            self.mem.move_to_end(key)
            return hit
        if key in self.spilled:
            n, h = self.spilled[key]
            try:
                return self._file(key).read_bytes(), h
            except FileNotFoundError:
                self.spilled.pop(key)
        return None

    def __contains__(self, key: str) -> bool:
        return key in self.mem or key in self.spilled


class VerifyError(Exception):
    pass


def verify_object(key: str, data: bytes, manifest_parts: dict[str, dict]) -> None:
    """Check an object before it is cached or forwarded; raise VerifyError naming the problem."""
    if key.endswith(".dcr"):
        try:
            for c in codec.split_chunks(data):
                codec.parse_header(c)  # verifies the chunk checksum and header fields
        except codec.ChunkError as exc:
            raise VerifyError(f"{key}: {exc}") from None
        ref = manifest_parts.get(key)
        if ref is not None and (len(data) != ref["bytes"] or xxhash.xxh3_64_hexdigest(data) != ref["checksum"]):
            raise VerifyError(f"{key}: does not match its rank manifest")
    elif key.endswith(".json"):
        try:
            json.loads(data)
        except ValueError as exc:
            raise VerifyError(f"{key}: not valid JSON ({exc})") from None


class Relay:
    """A relay node over a parent store (see the module docstring)."""

    def __init__(self, parent, cfg: RelayConfig):
        self.parent, self.cfg = parent, cfg
        self.cache = Cache(cfg.cache_mb << 20, cfg.spill_dir, cfg.spill_mb << 20)
        self.pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="relay-up")
        self.inflight: dict[str, asyncio.Future] = {}
        # immutable objects being written through this relay (passed up, not yet held): the
        # watcher must not pull them from the parent in between, nor a GET fetch them there
        self.writing: dict[str, asyncio.Event] = {}
        self.missing: dict[str, float] = {}  # key -> time it was last seen absent upstream
        self.lists: dict[tuple[str, str], tuple[float, list[str]]] = {}
        self.list_inflight: dict[tuple[str, str], asyncio.Future] = {}
        self.put_at: dict[str, float] = {}  # keys written through this relay -> when
        # mutable objects (acks, registrations) written through this relay: (when, bytes, xxh3)
        self.passed: dict[str, tuple[float, bytes, str]] = {}
        self.immutable_put_at = -1e9  # when a sender last wrote through this relay
        self.new_at = time.monotonic()  # when a listing of the parent last showed something new
        self.manifest_parts: dict[str, dict] = {}
        self.done_versions: set[str] = set()
        self.watched_dirs: set[str] = set()
        self.watch_alive = 0.0
        self.stats = {"name": cfg.name, "bytes_in": 0, "bytes_out": 0, "objects_in": 0, "objects_out": 0,
                      "part_bytes_in": 0, "part_bytes_out": 0,
                      "hits": 0, "rejected": 0, "upstream_errors": 0, "unauthorized": 0, "puts": 0,
                      "requests": {},  # served, by kind: GET, HEAD, PUT (objects), wait, list, children, stats
                      "upstream": {},  # asked of the parent, by call: get, list, children, put, wait, ...
                      "started": time.time()}
        self._fault = _Fault(cfg.fault)
        self.gen = 1  # bumped whenever this relay holds something new (long-polls wake on it)
        self.changes: deque[tuple[int, str | None]] = deque(maxlen=4096)  # (gen, key; None: unknown)
        self._log_floor = self.gen  # the log holds every change after this generation
        self._changed = asyncio.Event()
        self._upstream_news = False  # a parent listing showed keys not written through this relay
        self.runner: web.AppRunner | None = None
        self.port: int | None = None
        self._watcher: asyncio.Task | None = None
        self._pulls: set[asyncio.Task] = set()  # the watcher's pulls under way
        try:
            self._log = open(cfg.access_log, "a", buffering=1) if cfg.access_log else None  # line-buffered
        except OSError as exc:
            raise ValueError(f"relay access log {cfg.access_log}: {exc.strerror}") from None

    def _trace(self, rec: dict) -> None:
        """One access-log line (the token is never in it: headers are not logged)."""
        if self._log is not None:  # (closed by stop() while a request was still under way)
            self._log.write(json.dumps({"t": round(time.time(), 6), "relay": self.cfg.name, **rec},
                                       separators=(",", ":")) + "\n")

    def _bump(self, *keys: str) -> None:
        """Something new is here: the keys that changed (none: not known which)."""
        self.gen += 1
        for k in keys or (None,):
            if len(self.changes) == self.changes.maxlen:
                self._log_floor = self.changes[0][0]  # (dropped next: its generation is incomplete now)
            self.changes.append((self.gen, k))
        self._changed.set()
        self._changed = asyncio.Event()

    def _news(self, known: int, data_only: bool) -> bool:
        """Has anything changed since generation `known` (data_only: any immutable object:
        parts, manifests, records, decisions; not acks or registrations)?"""
        if self.gen <= known:
            return False
        if not data_only:
            return True
        for g, key in reversed(self.changes):
            if g <= known:
                return False
            if key is None or not mutable(key):
                return True
        return known < self._log_floor  # the log does not reach back that far: say yes

    def changed_since(self, known: int, data_only: bool) -> list[str] | None:
        """The keys that appeared here after generation `known`, oldest first (data_only:
        immutable ones only); None when the log cannot say (it does not reach back that far,
        or a change was of unknown keys, or something disappeared): then list."""
        if known < self._log_floor:
            return None
        out = []
        for g, key in reversed(self.changes):
            if g <= known:
                break
            if key is None:
                return None
            if not (data_only and mutable(key)):
                out.append(key)
        return out[::-1]

    # ------------------------------------------------------------ upstream
    async def _up(self, fn, *args):
        name = getattr(fn, "__name__", "call")
        up = getattr(fn, "__self__", None) is self.parent
        if up:
            self.stats["upstream"][name] = self.stats["upstream"].get(name, 0) + 1
        if not (up and self._log):
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        t0, rec = time.perf_counter(), {"up": name, "arg": args[0] if args and isinstance(args[0], str) else
                                        (list(args[:1]) or None)}
        try:
            out = await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
            rec["result"] = "ok" if out is not False else "exists"  # (put_if_absent: another write stands)
            if isinstance(out, (bytes, list)):
                rec["n"] = len(out)  # bytes fetched, names listed
            return out
        except KeyError:
            rec["result"] = "missing"
            raise
        except BaseException as exc:
            rec["result"] = f"{type(exc).__name__}: {exc}"[:300]
            raise
        finally:
            self._trace({**rec, "ms": round(1e3 * (time.perf_counter() - t0), 3)})

    async def fetch(self, key: str) -> tuple[bytes, str] | None:
        """The verified object (bytes, xxh3), from the cache or fetched once; None if absent."""
        hit = self.cache.get(key)
        if hit is not None:
            self.stats["hits"] += 1
            return hit
        if mutable(key):
            p = self.passed.get(key)
            if p is not None and time.monotonic() - p[0] < self.cfg.passed_ttl_s:
                self.stats["hits"] += 1
                return p[1], p[2]
        else:
            w = self.writing.get(key)
            if w is not None:  # being written through: held in a moment (unless the write fails)
                await w.wait()
                hit = self.cache.get(key)
                if hit is not None:
                    return hit
            if self._known_absent(key):
                return None
            seen = self.missing.get(key)
            if seen is not None and time.monotonic() - seen < self.cfg.poll_s:
                return None
        return await _single_flight(self.inflight, key, lambda: self._fetch_upstream(key))

    async def _fetch_upstream(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = await self._up(self.parent.get, key)
        except KeyError:
            self.missing[key] = time.monotonic()
            return None
        except OSError:
            self.stats["upstream_errors"] += 1
            raise
        self.stats["bytes_in"] += len(data)
        self.stats["objects_in"] += 1
        if key.endswith(".dcr"):
            self.stats["part_bytes_in"] += len(data)
        try:
            await self._up(verify_object, key, data, self.manifest_parts)
        except VerifyError:
            self.stats["rejected"] += 1
            raise
        h = xxhash.xxh3_64_hexdigest(data)
        self.missing.pop(key, None)
        if not mutable(key):
            self._hold(key, data, h)
            if not self._announced(key):  # listed already: its waiters woke then (a GET joins this fetch)
                self._bump(key)
        return data, h

    def _watched(self, k: tuple[str, str]) -> bool:
        """Listings the watcher keeps current (and wakes long-polls on): served as they are."""
        return (self.cfg.prefetch and time.monotonic() - self.watch_alive < 2.0
                and (k == ("children", "versions") or (k[0] == "list" and k[1] in self.watched_dirs)))

    async def listing(self, op: str, prefix: str, fresh: bool = False) -> list[str]:
        """The parent's list/children of prefix: what the watcher last saw for the versions it
        follows, else shared by every asker within poll_s (a child's poll never crosses the
        link above on its own). "versions" and "versions/" are one listing (every store lists
        them alike): asked both ways, they were two, and the one the watcher did not keep went
        up the tree to the origin every time (on S3, a receiver's list of versions)."""
        prefix = prefix.rstrip("/")
        k = (op, prefix)
        hit = self.lists.get(k)
        if hit is not None and not fresh and (time.monotonic() - hit[0] < self.cfg.poll_s or self._watched(k)):
            return hit[1]

        async def fetch_list() -> list[str]:
            t = time.monotonic()
            try:
                out = await self._up(getattr(self.parent, op), prefix)
            except BaseException:
                self.stats["upstream_errors"] += 1
                raise
            # keys written through this relay while the listing was on its way may be missing
            # from it (the parent listed first): keep them, or children would never see them
            late = {n for key, at in self.put_at.items() if at >= t and (n := _name_in(op, prefix, key))}
            if late - set(out):
                out = sorted(set(out) | late)
            if hit is None or hit[1] != out:
                old = set(hit[1] if hit else ())
                diff = [n if op == "list" else f"{prefix}/{n}" if prefix else n for n in set(out) - old]
                if diff:
                    self._bump(*diff)
                    self.new_at = time.monotonic()
                if old - set(out):  # something went (a collected version): the news feed says "list"
                    self._bump()
                if not all(self._written_here(k) for k in diff) or old - set(out):
                    self._upstream_news = True
            self.lists[k] = (t, out)
            return out

        return await _single_flight(self.list_inflight, k, fetch_list)

    def _written_here(self, key: str) -> bool:
        """Was key (or, for a folder, something in it) written through this relay?"""
        return key in self.put_at or any(k.startswith(key + "/") for k in self.put_at)

    def _watched_listing(self, key: str) -> list[str] | None:
        """The watcher's current listing of the version folder that holds key, if it keeps one."""
        d = key.rsplit("/", 2)[0] if key.count("/") >= 2 else ""
        for vd in (d, key.rsplit("/", 1)[0]):
            hit = self.lists.get(("list", vd))
            if hit is not None and self._watched(("list", vd)):
                return hit[1]
        return None

    def _known_absent(self, key: str) -> bool:
        """A record or decision of a watched version that the watcher's current listing does
        not have: receivers ask for those before they exist, and the answer needs no trip up.
        Not parts or manifests: nobody asks for one before seeing it listed here or named by a
        manifest, so a listing without it is older than the asker's news (a listing's answer
        can cross a shaped link behind queued part bytes and replace one the news had already
        extended). Those go to the parent; a receiver told "missing" refuses the version."""
        if not key.endswith(("/VERSION.json", "/DECISION.json")):
            return False
        names = self._watched_listing(key)
        return names is not None and key not in names

    async def watch(self) -> None:
        """Pull every new object of the newest versions as soon as the parent has it, parts in
        order and a few at a time (so the first parts arrive, and flow on, first). The pulls
        run as tasks: the watcher goes on listing the parent meanwhile, and a manifest, record
        or decision (small) is pulled at once, not queued behind the parts on the link (a
        version's record waited there for the last parts, and receivers applied nothing until
        it came).

        Under a relay, the long-poll's answer names the new keys (Relay.changed_since): a new
        object of a version being pulled is pulled at once, without listing the parent first.
        Those listings crossed the link behind the part bytes queued on it, and cost 20-45 ms
        per part on the relay bench's shaped links while the link sat idle. The parent is still
        listed when the answer cannot name the keys, when a new version appears, and at least
        every `write_through_poll_s`."""
        self._parent_gen = 0
        lanes = asyncio.Semaphore(self.cfg.lanes)
        pulling: set[str] = set()

        async def pull(k: str) -> None:
            try:
                if k.endswith(".json"):
                    await self.fetch(k)
                else:
                    async with lanes:  # FIFO: parts in the order they were listed
                        await self.fetch(k)
            except Exception:  # noqa: BLE001 - counted by fetch; asked again next round, or by a child
                pass  # (which then gets the error); also the pool shut down under a stopping relay
            finally:
                pulling.discard(k)

        def start(keys: list[str]) -> None:
            todo = [k for k in keys if k not in self.cache and k not in self.inflight
                    and k not in self.writing and k not in pulling]
            # manifests and records first: parts are then checked against them too
            todo.sort(key=lambda k: (not k.endswith(".json"), k))
            for k in todo:
                pulling.add(k)
                t = asyncio.create_task(pull(k))
                self._pulls.add(t)  # (held: the loop keeps only weak references to tasks)
                t.add_done_callback(self._pulls.discard)

        def take_news(keys: list[str]) -> bool:
            """Start pulling the new objects of followed versions; False if a listing is due."""
            new = []
            for k in keys:
                path = k.split("/")
                if len(path) < 3 or path[0] != "versions":
                    return False  # a new version, or something outside the versions: list
                vd = f"versions/{path[1]}"
                if vd in self.done_versions or mutable(k):
                    continue
                names = self._watched_listing(k)
                if vd not in self.watched_dirs or names is None:
                    return False
                if k not in names:
                    self._add_listed(k)
                    self._bump(k)  # children see it listed now (the pull's hold then wakes nobody)
                new.append(k)
            start(new)
            self.watch_alive = time.monotonic()
            return True

        pause = self.cfg.poll_s
        listed_at = -1e9
        news: list[str] | None = None
        while True:
            if news is None or not take_news(news) or time.monotonic() - listed_at > self.cfg.write_through_poll_s:
                self._upstream_news = False
                listed_at = time.monotonic()
                try:
                    versions = [v for v in await self.listing("children", "versions", fresh=True) if v.isdigit()]
                    for v in versions[-3:]:
                        vd = f"versions/{v}"
                        if vd in self.done_versions:
                            continue
                        keys = [k for k in await self.listing("list", vd, fresh=True) if not mutable(k)]
                        self.watched_dirs.add(vd)
                        start(keys)
                        if f"{vd}/DECISION.json" in self.cache:
                            self.done_versions.add(vd)
                    self.watch_alive = time.monotonic()
                except (OSError, KeyError):
                    pass  # the parent chain re-attaches; try again next round
            news = None
            # a relay above: long-poll it instead of polling (a failover chain that fell back to
            # the origin is polled, with the back-off below: it listed the origin 180 times a
            # second when idle)
            waiter = self.parent.wait_keys if long_polls(self.parent) else None
            if waiter is not None:
                try:
                    self._parent_gen, news = await self._up(waiter, self._parent_gen, 1.0, True)
                    continue
                except OSError:
                    pass
            # nothing new from the parent: back off (up to idle_poll_s, or write_through_poll_s)
            cap = self.cfg.idle_poll_s
            now = time.monotonic()
            if now - self.immutable_put_at < WRITE_THROUGH_S:
                cap = max(cap, self.cfg.write_through_poll_s)
            elif now - max(self.new_at, self.immutable_put_at) > self.cfg.dormant_after_s:
                cap = max(cap, self.cfg.dormant_poll_s)
            pause = self.cfg.poll_s if self._upstream_news else backoff(pause, self.cfg.poll_s, cap)
            await asyncio.sleep(pause)

    # ------------------------------------------------------------ HTTP
    def _authorized(self, request: web.Request) -> bool:
        if self.cfg.token is None:
            return True
        got = request.headers.get("Authorization", "")
        ok = hmac.compare_digest(got.encode(), f"Bearer {self.cfg.token}".encode())
        if not ok:
            self.stats["unauthorized"] += 1
        return ok

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self._log is None:
            return await self._serve(request, handler)
        t0, status, size = time.perf_counter(), None, None
        try:
            resp = await self._serve(request, handler)
            status, size = resp.status, getattr(resp, "content_length", None)
            return resp
        except web.HTTPException as exc:  # (aiohttp's own answers: no such route, bad method)
            status = exc.status
            raise
        except BaseException:  # aiohttp answers 500
            status = 500
            raise
        finally:
            self._trace({"peer": _peer(request), "method": request.method, "path": request.path_qs,
                         "status": status, "bytes": size, "ms": round(1e3 * (time.perf_counter() - t0), 3)})

    async def _serve(self, request: web.Request, handler):
        if request.path != "/health" and not self._authorized(request):
            return web.json_response({"error": "missing or wrong relay token"}, status=401)
        kind = request.method if request.path.startswith("/o/") else request.path.lstrip("/")
        self.stats["requests"][kind] = self.stats["requests"].get(kind, 0) + 1
        try:
            return await handler(request)
        except VerifyError as exc:
            return web.json_response({"error": f"corrupt object from upstream, not forwarded: {exc}"}, status=502)
        except OSError as exc:
            return web.json_response({"error": f"upstream unavailable: {exc}"}, status=503)

    async def h_get(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        got = await self.fetch(key)
        if got is None:
            return web.json_response({"error": f"no such key {key}"}, status=404)
        data, h = got
        if request.method == "HEAD":
            return web.Response(status=200, headers={CHECKSUM_HEADER: h, "X-DCR-Length": str(len(data))})
        if xxhash.xxh3_64_hexdigest(data) != h:  # corrupted at rest here (memory, spill file): never forwarded
            self.stats["rejected"] += 1
            self.cache.drop(key)
            got = await self.fetch(key)
            if got is None:
                return web.json_response({"error": f"no such key {key}"}, status=404)
            data, h = got
        self._fault.served(key)
        self.stats["bytes_out"] += len(data)
        self.stats["objects_out"] += 1
        if key.endswith(".dcr"):
            self.stats["part_bytes_out"] += len(data)
        return web.Response(body=data, content_type="application/octet-stream", headers={CHECKSUM_HEADER: h})

    async def h_put(self, request: web.Request) -> web.Response:
        """A write from below, passed up. Immutable objects (a sender writing through this relay)
        are verified first, then held here and announced, as if fetched from the parent.

        An ack is announced (and served from here) while it is passed up, not after: the
        committer reading acks through this relay then decides without waiting for the
        origin's write (10-35 ms per ack on the relay bench's SeaweedFS). The writer's request
        still returns only once the origin holds it; if that fails, the ack is taken back here
        and the writer, told so, writes it again (on another store of its chain). An ack only
        reports what its receiver did: the decision, written through here only once the origin
        took it, is what stands."""
        key = request.match_info["key"]
        data = await request.read()
        self.stats["puts"] += 1
        keep = not mutable(key)
        early = "/acks/" in key and request.query.get("if_absent") != "1"
        if early:
            self._listed(key)
            self._passed(key, data)
            self._bump(key)
        if keep:
            try:
                await self._up(verify_object, key, data, self.manifest_parts)
            except VerifyError as exc:
                self.stats["rejected"] += 1
                return web.json_response({"error": f"refused: {exc}"}, status=400)
        w = self.writing.setdefault(key, asyncio.Event()) if keep else None
        try:
            if request.query.get("if_absent") == "1":
                created = await self._up(self.parent.put_if_absent, key, data)
                if not created:  # another writer's object stands: fetched from the parent when asked
                    return web.json_response({"created": False}, status=412)
            else:
                try:
                    await self._up(self.parent.put, key, data)
                except BaseException:
                    if early:
                        self._unlisted(key)
                    raise
            if early:
                return web.json_response({"created": True, "ok": True})
            self._listed(key)
            if keep:
                self._hold(key, data, xxhash.xxh3_64_hexdigest(data))
                self.immutable_put_at = time.monotonic()
            else:
                self._passed(key, data)
        finally:
            if w is not None and self.writing.get(key) is w:
                del self.writing[key]
                w.set()
        self._bump(key)
        return web.json_response({"created": True, "ok": True})

    def _unlisted(self, key: str) -> None:
        """Take back a write announced before the parent had it (its write failed)."""
        self.passed.pop(key, None)
        self.put_at.pop(key, None)
        for (op, prefix), (t, names) in list(self.lists.items()):
            name = _name_in(op, prefix, key)
            if name and name in names and op == "list":
                self.lists[(op, prefix)] = (t, [n for n in names if n != name])
        self._bump()  # something went: news feeds say "list"

    def _hold(self, key: str, data: bytes, h: str) -> None:
        """Cache a verified immutable object and learn a manifest's parts (the caller wakes the
        long-polls if the key is news to them)."""
        self.missing.pop(key, None)
        self.cache.put(key, self._fault.at_rest(key, data), h)
        if "/rank-" in key and key.endswith(".json"):
            for p in json.loads(data).get("parts", []):
                self.manifest_parts[p["key"]] = p

    def _passed(self, key: str, data: bytes) -> None:
        """Keep a mutable object just written through this relay (served for passed_ttl_s)."""
        now = time.monotonic()
        if len(self.passed) > 4096:
            self.passed = {k: p for k, p in self.passed.items() if now - p[0] < self.cfg.passed_ttl_s}
        self.passed[key] = (now, data, xxhash.xxh3_64_hexdigest(data))

    def _announced(self, key: str) -> bool:
        """Is the key in a listing the watcher keeps (whose change woke the long-polls)? Then
        holding it is no news: waiters saw it listed, and a GET waits for the fetch under way.
        Waking them again cost every receiver a wait and a listing per part."""
        names = self._watched_listing(key)
        return names is not None and key in names

    def _listed(self, key: str) -> None:
        """Add a key written through this relay to the cached listings that cover it (and note
        when, for listings still on their way from the parent)."""
        now = time.monotonic()
        self.put_at[key] = now
        if len(self.put_at) > 4096:  # only the last seconds matter
            self.put_at = {k: at for k, at in self.put_at.items() if now - at < 60.0}
        self._add_listed(key)

    def _add_listed(self, key: str) -> None:
        """Add key to the cached listings that cover it."""
        for (op, prefix), (t, names) in list(self.lists.items()):
            name = _name_in(op, prefix, key)
            if name and name not in names:
                self.lists[(op, prefix)] = (t, sorted([*names, name]))

    async def h_list(self, request: web.Request) -> web.Response:
        op = "children" if request.path == "/children" else "list"
        return web.json_response(await self.listing(op, request.query.get("prefix", "")))

    async def h_wait(self, request: web.Request) -> web.Response:
        """Long-poll: answer once gen > the caller's (something new is here) or at the timeout.
        With data=1 only new immutable objects count: receivers and relays below wait for parts,
        manifests, records and decisions, and a fleet's acks and registrations (each one a
        change) would otherwise wake every receiver once per receiver per version."""
        known = int(request.query.get("gen", "0"))
        limit = min(float(request.query.get("timeout", "1")), 30.0)
        data_only = request.query.get("data") == "1"
        deadline = time.monotonic() + limit
        while not self._news(known, data_only):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                break
        if request.query.get("keys") == "1":
            return web.json_response({"gen": self.gen, "keys": self.changed_since(known, data_only)})
        return web.json_response({"gen": self.gen})

    async def h_stats(self, request: web.Request) -> web.Response:
        return web.json_response({**self.stats, "cached_objects": len(self.cache.mem) + len(self.cache.spilled),
                                  "cached_bytes": self.cache.used, "spilled_bytes": self.cache.spill_used})

    async def h_health(self, request: web.Request) -> web.Response:
        return web.json_response({"name": self.cfg.name, "ok": True})

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=1 << 30)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/stats", self.h_stats)
        app.router.add_get("/wait", self.h_wait)
        app.router.add_get("/list", self.h_list)
        app.router.add_get("/children", self.h_list)
        app.router.add_route("GET", "/o/{key:.+}", self.h_get)
        app.router.add_route("HEAD", "/o/{key:.+}", self.h_get)
        app.router.add_put("/o/{key:.+}", self.h_put)
        return app

    async def start(self) -> None:
        ssl_ctx = None
        if self.cfg.tls_cert:
            import ssl

            ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_ctx.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.cfg.host, self.cfg.port, ssl_context=ssl_ctx, backlog=1024)
        await site.start()
        self.port = self.runner.addresses[0][1]
        if self.cfg.prefetch:
            self._watcher = asyncio.create_task(self.watch())

    async def stop(self) -> None:
        tasks = [t for t in (self._watcher, *self._pulls) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.runner:
            await self.runner.cleanup()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self._log is not None:
            self._log.close()
            self._log = None


def _name_in(op: str, prefix: str, key: str) -> str | None:
    """What a listing (op: list | children) of prefix shows for key, or None if not covered."""
    base = prefix.rstrip("/")
    if base and not key.startswith(base + "/"):
        return None
    return key if op == "list" else key[len(base) + 1 if base else 0:].split("/", 1)[0]


async def _single_flight(inflight: dict, key, make):
    """Run make() once for concurrent askers of one key: the first runs it, the others await
    its result (or its exception)."""
    fut = inflight.get(key)
    if fut is not None:
        return await asyncio.shield(fut)
    fut = asyncio.get_running_loop().create_future()
    inflight[key] = fut
    try:
        res = await make()
        fut.set_result(res)
        return res
    except BaseException as exc:
        fut.set_exception(exc)
        fut.exception()  # retrieved: waiters re-raise it
        raise
    finally:
        inflight.pop(key, None)


class _Fault:
    """Fault injection for tests (NEMO_DCR_RELAY_FAULT): 'corrupt:N' flips a byte in the cached
    copy of the first N parts, after they were verified (corruption at rest in this relay);
    'die:N' kills the relay (SIGKILL) when it is asked for a part after serving N."""

    def __init__(self, spec: str | None):
        self.kind, self.n = None, 0
        if spec:
            kind, _, n = spec.partition(":")
            if kind not in ("corrupt", "die"):
                raise ValueError(f"unknown relay fault {spec!r} (corrupt:N or die:N)")
            self.kind, self.n = kind, int(n or 1)
        self.count = 0

    def at_rest(self, key: str, data: bytes) -> bytes:
        if self.kind != "corrupt" or not key.endswith(".dcr") or self.count >= self.n or not data:
            return data
        self.count += 1
        b = bytearray(data)
        b[len(b) // 2] ^= 0x40
        return bytes(b)

    def served(self, key: str) -> None:
        if self.kind == "die" and key.endswith(".dcr"):
            if self.count >= self.n:
                os.kill(os.getpid(), signal.SIGKILL)
            self.count += 1


def serve(parent_url: str, cfg: RelayConfig, ready=None) -> None:
    """Run a relay until SIGINT/SIGTERM; prints one line with its address when it listens."""
    from nemo_dcr_callback.transport.store import freeze_long_lived, open_store

    parent = open_store(parent_url)
    relay = Relay(parent, cfg)
    freeze_long_lived()

    async def main() -> None:
        await relay.start()
        scheme = "relays" if cfg.tls_cert else "relay"
        print(f"nemo-dcr relay {cfg.name}: listening on {scheme}://{cfg.host}:{relay.port} "
              f"(parent {_redact(parent_url)}, cache {cfg.cache_mb} MB"
              f"{', spill ' + cfg.spill_dir if cfg.spill_dir else ''}"
              f"{', token required' if cfg.token else ', NO token: anyone can connect'})", flush=True)
        if ready is not None:
            ready(relay)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        relay._stop = stop
        await stop.wait()
        await relay.stop()

    asyncio.run(main())


def _redact(url: str) -> str:
    return url.split("?")[0] + ("?..." if "?" in url else "")


def main(argv: list[str] | None = None) -> int:  # python -m nemo_dcr_callback.transport.relay PARENT
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("parent")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args(argv)
    serve(a.parent, RelayConfig(port=a.port, token=os.environ.get("NEMO_DCR_RELAY_TOKEN")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
