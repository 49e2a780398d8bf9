"""A relay's HTTP side: the aiohttp request handlers and the app that routes to them."""

from __future__ import annotations

import asyncio
import hmac
import time

import xxhash
from aiohttp import web

from nemo_dcr_callback.protocol import keys
from nemo_dcr_callback.protocol.store import ImmutableError, put_once
from nemo_dcr_callback.safe_io import TooLarge
from nemo_dcr_callback.transport.relay.cache import BadRecord, VerifyError, receiver_record_error, verify_object
from nemo_dcr_callback.transport.relay.wire import CHECKSUM_HEADER, LENGTH_HEADER, OBJECT_ROUTE

OBJECT_PATH = OBJECT_ROUTE + "{key:.+}"
_ROUTES = {"GET", "HEAD", "PUT", "health", "stats", "wait", "list", "children"}


def _peer(request) -> str | None:
    """host:port of the client (the port tells apart receivers that share a host)."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"{peer[0]}:{peer[1]}"
    return request.remote


async def _read_body(request: web.Request, n: int | None, limit: int) -> bytearray | tuple[int, str]:
    """The body, read as it arrives into one buffer of its announced size (no chunk list, no
    joined copy: a 900 MB PUT takes 900 MB), or (HTTP status, why) it is refused."""
    buf = bytearray(n) if n is not None else bytearray()
    got = 0
    async for piece in request.content.iter_any():
        if n is None:
            if got + len(piece) > limit:
                return 413, f"larger than the {limit} bytes allowed"
            buf += piece
        else:
            buf[got:got + len(piece)] = piece
        got += len(piece)
    if n is not None and got != n:
        return 400, f"the body ended after {got} of its {n} bytes"
    return buf


class UploadBudget:
    """Request bodies being read at once: at most `count`, and `total` bytes in all; a body
    waits for room (under the body timeout) rather than taking memory the relay lacks."""

    def __init__(self, total: int, count: int):
        self.total, self.count = total, count
        self.used = self.active = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            # (a body larger than the whole budget goes alone)
            await self._cond.wait_for(lambda: self.active < self.count
                                      and (self.used + n <= self.total or not self.active))
            self.used += n
            self.active += 1

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self.active -= 1
            self._cond.notify_all()


class HttpSide:
    """The Relay's request handlers (a mixin of Relay: the state they use is set up in
    Relay.__init__, node.py; what they hold and fetch is StoreSide's, cache.py)."""

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=self.cfg.max_json_bytes)  # (PUT bodies: h_put)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/stats", self.h_stats)
        app.router.add_get("/wait", self.h_wait)
        app.router.add_get("/list", self.h_list)
        app.router.add_get("/children", self.h_list)
        app.router.add_route("GET", OBJECT_PATH, self.h_get)
        app.router.add_route("HEAD", OBJECT_PATH, self.h_get)
        app.router.add_put(OBJECT_PATH, self.h_put)
        return app

    # ------------------------------------------------------------ every request
    def _role(self, request: web.Request) -> str | None:
        """"publisher", "receiver" or None (no valid token). Without a configured token every
        peer is the publisher (loopback trials)."""
        if self.cfg.token is None:
            return "publisher"
        got = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(got, f"Bearer {self.cfg.token}".encode()):
            return "publisher"
        rt = self.cfg.receiver_token
        if rt and hmac.compare_digest(got, f"Bearer {rt}".encode()):
            return "receiver"
        self.stats["unauthorized"] += 1
        return None

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
        role = "publisher" if request.path == "/health" else self._role(request)
        if role is None:
            return web.json_response({"error": "missing or wrong relay token"}, status=401)
        request["role"] = role
        kind = request.method if request.path.startswith(OBJECT_ROUTE) else request.path.lstrip("/")
        if kind not in _ROUTES:
            kind = "other"  # (a made-up path must not add a counter of its own)
        self.stats["requests"][kind] = self.stats["requests"].get(kind, 0) + 1
        try:
            return await handler(request)
        except BadRecord as exc:  # a receiver's record gone bad in the parent: the reader's to skip
            return web.json_response({"error": f"bad record, not forwarded: {exc}"}, status=422)
        except TooLarge as exc:
            return web.json_response({"error": f"refused: {exc}"}, status=413)
        except VerifyError as exc:
            return web.json_response({"error": f"corrupt object from upstream, not forwarded: {exc}"}, status=502)
        except OSError as exc:
            return web.json_response({"error": f"upstream unavailable: {exc}"}, status=503)

    # ------------------------------------------------------------ objects
    async def h_get(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        got = await self.fetch(key)
        if got is None:
            return web.json_response({"error": f"no such key {key}"}, status=404)
        data, h = got
        if request.method == "HEAD":
            return web.Response(status=200, headers={CHECKSUM_HEADER: h, LENGTH_HEADER: str(len(data))})
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
        if keys.is_part(key):
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
        kind = keys.kind(key)
        if kind is None:  # nothing but the protocol's objects lands in the origin (no disk filling)
            return web.json_response({"error": f"refused {key}: not a key of the store's protocol"}, status=400)
        own = keys.receiver_record(key)
        if request["role"] != "publisher" and own is None:
            return web.json_response({"error": f"a receiver's token may write only registrations and acks, "
                                               f"not {key}"}, status=403)
        limit = self.cfg.max_bytes(kind)
        n = request.content_length
        if n is None:  # (chunked: the size shows only as it arrives; no large object comes so)
            limit = min(limit, self.cfg.max_json_bytes)
        if (n or 0) > limit:
            return web.json_response({"error": f"refused {key}: {n} bytes, larger than the {limit} "
                                               f"a {kind} may have"}, status=413)
        need = limit if n is None else n
        # receivers' records have their own slots and a short body timeout, and one address takes
        # a few at most: four trickled acks held every upload slot, the publisher's parts behind them
        record = request["role"] != "publisher"
        budget = self._record_uploads if record else self._uploads
        timeout = self.cfg.record_body_timeout_s if record else self.cfg.body_timeout_s
        peer = request.remote or "?"
        if record and self._peer_uploads.get(peer, 0) >= self.cfg.max_record_uploads_per_peer:
            return web.json_response({"error": f"refused {key}: {peer} has {self.cfg.max_record_uploads_per_peer} "
                                               "uploads under way already"}, status=429)
        try:
            async with asyncio.timeout(timeout):
                await budget.acquire(need)
        except TimeoutError:
            return web.json_response({"error": f"no room to take {key} within {timeout:.0f} s: "
                                               f"the relay is busy with other uploads"}, status=503)
        if record:
            self._peer_uploads[peer] = self._peer_uploads.get(peer, 0) + 1
        try:
            try:
                async with asyncio.timeout(timeout):
                    data = await _read_body(request, n, limit)
            except TimeoutError:
                return web.json_response({"error": f"body of {key} not complete in {timeout:.0f} s"}, status=408)
            if isinstance(data, tuple):
                return web.json_response({"error": f"refused {key}: {data[1]}"}, status=data[0])
            return await self._put(request, key, own, data)
        finally:
            await budget.release(need)
            if record:
                left = self._peer_uploads.pop(peer) - 1
                if left:
                    self._peer_uploads[peer] = left

    async def _put(self, request: web.Request, key: str, own, data: bytearray) -> web.Response:
        self.stats["puts"] += 1
        if own is not None:
            bad = receiver_record_error(own, key, data)
            if bad is None and own[0] == "ack" and not await self._version_exists(own[2]):
                # (an ack made its version's folder in the origin: a restarting publisher then
                # numbered its next version past the range)
                bad = f"version {own[2]} does not exist in the store"
            if bad:
                self.stats["rejected"] += 1
                return web.json_response({"error": f"refused {key}: {bad}"}, status=400)
        keep = not keys.is_mutable(key)
        early = keys.is_ack(key) and request.query.get("if_absent") != "1"
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
            elif keys.is_history(key):
                # history is create-only: the same bytes again (a retry) stand, others are refused
                try:
                    await self._up(put_once, self.parent, key, data)
                except ImmutableError:
                    self.stats["rejected"] += 1
                    return web.json_response({"error": f"{key} is history and immutable: not replaced"},
                                             status=409)
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

    async def _version_exists(self, v: int) -> bool:
        """Does the parent hold version v's folder (from the listing kept, else a fresh one)?"""
        name = keys.vdir(v).rsplit("/", 1)[1]
        if name in await self.listing("children", keys.VERSIONS):
            return True
        return name in await self.listing("children", keys.VERSIONS, fresh=True)

    # ------------------------------------------------------------ listings, news, state
    async def h_list(self, request: web.Request) -> web.Response:
        op = "children" if request.path == "/children" else "list"
        return web.json_response(await self.listing(op, request.query.get("prefix", "")))

    async def h_wait(self, request: web.Request) -> web.Response:
        """Long-poll: answer once gen > the caller's (something new is here) or at the timeout.
        With data=1 only new immutable objects count: receivers and relays below wait for parts,
        manifests, records and decisions, and a fleet's acks and registrations (each one a
        change) would otherwise wake every receiver once per receiver per version."""
        try:
            known = int(request.query.get("gen", "0"))
            limit = min(float(request.query.get("timeout", "1")), 30.0)
        except ValueError:
            return web.json_response({"error": "gen must be an integer and timeout a number"}, status=400)
        if not limit >= 0:  # (NaN too)
            return web.json_response({"error": "timeout must be a number >= 0"}, status=400)
        data_only = request.query.get("data") == "1"
        boot = request.query.get("boot")
        if boot is not None and boot != self.boot:  # a token from another process: it says nothing here
            return web.json_response({"gen": self.gen, "keys": None, "boot": self.boot})
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
            return web.json_response({"gen": self.gen, "keys": self.changed_since(known, data_only),
                                      "boot": self.boot})
        return web.json_response({"gen": self.gen, "boot": self.boot})

    async def h_stats(self, request: web.Request) -> web.Response:
        return web.json_response({**self.stats, "cached_objects": len(self.cache.mem) + len(self.cache.spilled),
                                  "cached_bytes": self.cache.used, "spilled_bytes": self.cache.spill_used})

    async def h_health(self, request: web.Request) -> web.Response:
        return web.json_response({"name": self.cfg.name, "ok": True})
