"""A fault-injecting HTTP proxy in front of the real S3 server (SeaweedFS).

Clients (boto3 through S3Store) talk to the proxy as if it were the server; requests pass
through unchanged (the Host header too, so SigV4 signatures still verify) unless a rule
matches, in which case the proxy answers 5xx or SlowDown, delays, truncates the response
body or resets the connection. Rules fire a bounded number of times and count their hits,
so a test can say exactly which requests failed and how many bytes had to be sent again.

No fake stands in for S3 here: every request that is not failed reaches SeaweedFS.
"""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class Rule:
    """Fire on requests whose method matches and whose path matches `path` (a regex)."""

    method: str = "*"
    path: str = ""
    action: str = "status"  # status | delay | reset | truncate | lose (a PUT answered 200, never stored)
    status: int = 503
    code: str = "ServiceUnavailable"  # S3 error code in the body (SlowDown = throttling)
    delay_s: float = 0.0
    times: int = 1  # how many matching requests it fires on (-1: every one)
    after: int = 0  # let this many matching requests through first
    seen: int = 0
    hits: int = 0
    hit_bytes: int = 0  # bytes sent for nothing: bodies of failed uploads, responses cut off or too late

    def matches(self, method: str, path: str) -> bool:
        if self.method not in ("*", method) or not re.search(self.path, path):
            return False
        self.seen += 1
        if self.seen <= self.after or (self.times >= 0 and self.hits >= self.times):
            return False
        self.hits += 1
        return True


@dataclass
class FaultProxy:
    upstream: str  # http://host:port of the S3 server
    host: str = "127.0.0.1"
    rules: list[Rule] = field(default_factory=list)
    port: int = 0
    requests: int = 0
    log: list[tuple[str, str]] = field(default_factory=list)  # (method, path) of every request

    def add(self, **kw) -> Rule:
        r = Rule(**kw)
        self.rules.append(r)
        return r

    def clear(self) -> None:
        self.rules.clear()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.read()
        path = request.path_qs
        self.log.append((request.method, path))
        truncate = False
        fired = None
        for rule in self.rules:
            if not rule.matches(request.method, path):
                continue
            rule.hit_bytes += len(body)
            fired = rule
            if rule.action == "delay":
                await asyncio.sleep(rule.delay_s)
            elif rule.action == "reset":
                request.transport.close()
                return web.Response(status=500)
            elif rule.action == "status":
                xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{rule.code}</Code>'
                       f"<Message>injected by the fault proxy</Message></Error>")
                return web.Response(status=rule.status, text=xml, content_type="application/xml")
            elif rule.action == "truncate":
                truncate = True
            elif rule.action == "lose":  # a write acknowledged and then lost, as by a killed server
                return web.Response(status=200, headers={"ETag": '"lost"'})
            break
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("content-length", "transfer-encoding")}
        async with self._session.request(request.method, self.upstream + path, data=body if body else None,
                                          headers=headers, allow_redirects=False, auto_decompress=False) as up:
            data = await up.read()
            out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
        gone = request.transport is None or request.transport.is_closing()  # the client gave up (timed out)
        if fired is not None and request.method == "GET" and (truncate or gone):
            fired.hit_bytes += len(data) // 2 if truncate else len(data)
        if truncate and data:  # the body cut short: a connection that died mid-response
            resp = web.StreamResponse(status=up.status, headers=out_headers)
            resp.content_length = len(data)
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            request.transport.close()
            return resp
        return web.Response(status=up.status, body=data, headers=out_headers)

    def start(self) -> FaultProxy:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)

            async def main() -> None:
                self._session = aiohttp.ClientSession(auto_decompress=False,
                                                      connector=aiohttp.TCPConnector(limit=64))
                app = web.Application(client_max_size=1 << 31)
                app.router.add_route("*", "/{tail:.*}", self._handle)
                self._runner = web.AppRunner(app, access_log=None)
                await self._runner.setup()
                site = web.TCPSite(self._runner, self.host, self.port)
                await site.start()
                self.port = self._runner.addresses[0][1]
                ready.set()

            self._loop.run_until_complete(main())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True, name="fault-proxy")
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        async def down() -> None:
            await self._session.close()
            await self._runner.cleanup()

        fut = asyncio.run_coroutine_threadsafe(down(), self._loop)
        fut.result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
