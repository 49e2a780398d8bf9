"""One relay node: its state, its lifecycle, and `serve` (the `nemo-dcr relay` process)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import secrets
import signal
import ssl
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from nemo_dcr_callback import faults
from nemo_dcr_callback.bounded import Bounded
from nemo_dcr_callback.transport.relay.cache import Cache, StoreSide
from nemo_dcr_callback.transport.relay.config import RelayConfig
from nemo_dcr_callback.transport.relay.handlers import HttpSide, UploadBudget
from nemo_dcr_callback.transport.relay.watcher import Watcher
from nemo_dcr_callback.transport.relay.wire import TOKEN_ENV
from nemo_dcr_callback.transport.store import freeze_long_lived, open_store

# Entries of each table a peer's requests can grow (missing keys, listings, keys and records
# written through): a version's keys and a fleet's records fit many times over.
TABLE_ENTRIES = 4096
MANIFEST_PARTS = 1 << 16  # parts learnt from rank manifests (checked against on arrival)


class Relay(HttpSide, StoreSide):
    """A relay node over a parent store (docs/RELAY.md, and the package's docstring)."""

    def __init__(self, parent, cfg: RelayConfig):
        self.parent, self.cfg = parent, cfg
        self.cache = Cache(cfg.cache_mb << 20, cfg.spill_dir, cfg.spill_mb << 20)
        self.pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="relay-up")
        self.inflight: dict[str, asyncio.Future] = {}
        # immutable objects being written through this relay (passed up, not yet held): the
        # watcher must not pull them from the parent in between, nor a GET fetch them there
        self.writing: dict[str, asyncio.Event] = {}
        # Tables keyed by what peers ask for or write are Bounded (docs/SECURITY.md): made-up
        # keys and prefixes only push out the oldest entries, which are refetched if needed.
        self.missing: Bounded[str, float] = Bounded(TABLE_ENTRIES)  # key -> when last seen absent upstream
        self.lists: Bounded[tuple[str, str], tuple[float, list[str]]] = Bounded(TABLE_ENTRIES)
        self.list_inflight: dict[tuple[str, str], asyncio.Future] = {}
        self.put_at: Bounded[str, float] = Bounded(TABLE_ENTRIES)  # keys written through this relay -> when
        # mutable objects (acks, registrations) written through this relay: (when, bytes, xxh3)
        self.passed: Bounded[str, tuple[float, bytes, str]] = Bounded(TABLE_ENTRIES)
        self.immutable_put_at = -1e9  # when a sender last wrote through this relay
        self.new_at = time.monotonic()  # when a listing of the parent last showed something new
        self.manifest_parts: Bounded[str, dict] = Bounded(MANIFEST_PARTS)
        self.done_versions: set[str] = set()
        self.watched_dirs: set[str] = set()
        self.watch_alive = 0.0
        self._uploads = UploadBudget(cfg.upload_mb << 20, cfg.max_uploads)  # the publisher's
        self._record_uploads = UploadBudget(cfg.max_record_uploads * cfg.max_record_bytes, cfg.max_record_uploads)
        self._peer_uploads: dict[str, int] = {}  # receivers' record uploads under way, by address
        self.stats = {"name": cfg.name, "bytes_in": 0, "bytes_out": 0, "objects_in": 0, "objects_out": 0,
                      "part_bytes_in": 0, "part_bytes_out": 0,
                      "hits": 0, "rejected": 0, "upstream_errors": 0, "unauthorized": 0, "puts": 0,
                      "refused_connections": 0,
                      "requests": {},  # served, by kind: GET, HEAD, PUT (objects), wait, list, children, stats
                      "upstream": {},  # asked of the parent, by call: get, list, children, put, wait, ...
                      "started": time.time()}
        self._fault = faults.RelayFault(cfg.fault)
        self.gen = 1  # bumped whenever this relay holds something new (long-polls wake on it)
        # this process's generations: a restarted relay counts from 1 again, and a waiter's
        # token from the process before (often higher) would read as "nothing new" for good
        self.boot = secrets.token_hex(8)
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

    async def watch(self) -> None:
        """Pull every new object of the newest versions as soon as the parent has it (watcher.py)."""
        await Watcher(self).run()

    async def start(self) -> None:
        ssl_ctx = None
        if self.cfg.tls_cert:
            ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_ctx.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
        # keepalive_timeout also bounds a connection that never completes its first request
        # (aiohttp arms it at connection start): the slow-headers guard
        self.runner = web.AppRunner(self.app(), access_log=None, keepalive_timeout=self.cfg.header_timeout_s)
        await self.runner.setup()
        _quiet_loop_errors(asyncio.get_running_loop())
        room, backlog = _connection_room(self.cfg.max_connections)
        _limit_connections(self.runner.server, self.cfg, self.stats, room)
        site = web.TCPSite(self.runner, self.cfg.host, self.cfg.port, ssl_context=ssl_ctx, backlog=backlog)
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


FD_RESERVE = 256  # descriptors kept for what is not a client: the parent, spill and log files
ACCEPT_BATCH = 1024  # the listen backlog, which is also how many connections asyncio accepts at once


def _connection_room(want: int) -> tuple[int, int]:
    """(client connections this process can hold, listen backlog). The soft descriptor limit is
    raised toward the hard one to fit `want`; what it then allows, less FD_RESERVE and one
    accept batch (connections refused in a batch still hold their descriptors until the loop
    closes them), is the cap. With a cap above the limit a flood ended in failed accepts,
    "Too many open files"."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = want + FD_RESERVE + ACCEPT_BATCH
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return want, ACCEPT_BATCH
    batch = max(16, min(ACCEPT_BATCH, soft // 4))
    return max(1, min(want, soft - FD_RESERVE - batch)), batch


def _quiet_loop_errors(loop, every_s: float = 10.0) -> None:
    """Errors asyncio reports on its own (a failed accept, a connection torn down mid-write)
    print one line per kind every every_s at most, with a count: under a flood they were a
    traceback each, 274 MB of stderr in 30 s."""
    last: dict = {}
    count: Counter = Counter()

    def handler(loop, ctx: dict) -> None:
        exc = ctx.get("exception")
        kind = (ctx.get("message", ""), type(exc).__name__)
        count[kind] += 1
        now = time.monotonic()
        if now - last.get(kind, -every_s) < every_s:
            return
        last[kind] = now
        n = count.pop(kind)
        print(f"nemo-dcr relay: {kind[0]}{': ' + repr(exc) if exc else ''}"
              f"{f' ({n} times in {every_s:.0f} s)' if n > 1 else ''}", file=sys.stderr, flush=True)

    loop.set_exception_handler(handler)


def _limit_connections(server, cfg: RelayConfig, stats: dict, max_connections: int) -> None:
    """Close connections beyond cfg's per-peer limit and max_connections in all as they are
    accepted, so one peer cannot take every file descriptor (and with them /health and every
    other client)."""
    made, lost = server.connection_made, server.connection_lost
    # one peer never takes more than a quarter of the room, so others are served (a flood
    # from many addresses can still fill it: that is the network's to stop, docs/SECURITY.md)
    per_peer_max = min(cfg.max_connections_per_peer, max(1, max_connections // 4))
    peer_of: dict = {}
    per_peer: Counter = Counter()

    def connection_made(handler, transport) -> None:
        made(handler, transport)
        peer = (transport.get_extra_info("peername") or ("?",))[0]
        peer_of[handler] = peer
        per_peer[peer] += 1
        if per_peer[peer] > per_peer_max or len(peer_of) > max_connections:
            stats["refused_connections"] += 1
            release(handler)  # now: a burst of refused connections must not crowd out the next peer
            transport.close()

    def release(handler) -> None:
        peer = peer_of.pop(handler, None)
        if peer is not None:
            per_peer[peer] -= 1
            if not per_peer[peer]:
                del per_peer[peer]

    def connection_lost(handler, exc=None) -> None:
        release(handler)
        lost(handler, exc)

    server.connection_made, server.connection_lost = connection_made, connection_lost


def serve(parent_url: str, cfg: RelayConfig, ready=None) -> None:
    """Run a relay until SIGINT/SIGTERM; prints one line with its address when it listens."""
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
    ap = argparse.ArgumentParser()
    ap.add_argument("parent")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args(argv)
    serve(a.parent, RelayConfig(port=a.port, token=os.environ.get(TOKEN_ENV)))
    return 0

