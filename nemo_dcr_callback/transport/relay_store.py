"""The store interface over a relay (relay://host:port, relays:// for TLS), and failover chains.

A receiver (or a relay below) uses a relay exactly like any other store, so the follower's
apply path is the same as with object storage. `FailoverStore` tries its stores in order
(nearest relay, its parent, ..., the origin store) and moves down the chain when one fails;
whatever the caller already fetched and verified stays with the caller (the follower's
staged parts, a relay's cache), so nothing verified is downloaded twice.
"""

from __future__ import annotations

import json
import os
import select
import socket
import ssl
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple
from urllib.parse import parse_qs, quote, urlencode, urlparse

import xxhash

from nemo_dcr_callback.protocol.records import RecordError
from nemo_dcr_callback.protocol.store import StoreError, long_polls, wait_news
from nemo_dcr_callback.safe_io import TooLarge
from nemo_dcr_callback.transport.relay.wire import CHECKSUM_HEADER, OBJECT_ROUTE, TOKEN_ENV


class _Response(NamedTuple):
    status: int
    data: bytes
    headers: dict[str, str]  # lower-case names


class _Conn:
    """One kept-alive HTTP/1.1 connection, speaking the subset a relay needs (bodies with a
    Content-Length, or chunked). http.client parsed every response's headers with the email
    package: about 0.1 ms of CPU a request, most of a small request's cost in the client, and
    a receiver makes about 28 per version (measured ad hoc: a small GET 0.135 -> 0.04 ms)."""

    def __init__(self, host: str, port: int, ctx: ssl.SSLContext | None, read_timeout: float, auth: str):
        sock = socket.create_connection((host, port), timeout=3.0)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ctx is not None:
                sock = ctx.wrap_socket(sock, server_hostname=host)
            sock.settimeout(read_timeout)  # 3 s to connect, then the read timeout
        except BaseException:
            sock.close()
            raise
        self.sock: socket.socket | None = sock
        self.rf = sock.makefile("rb")
        self.head = f"Host: {host}:{port}\r\n{auth}"

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.rf.close()
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def request(self, method: str, path: str, body: bytes | None, limit: int | None = None) -> tuple[_Response, bool]:
        """(response, the connection is done with: the relay said close). A body over `limit`
        bytes is refused by its Content-Length, unread (TooLarge: the caller drops the
        connection)."""
        n = len(body) if body else 0
        head = f"{method} {path} HTTP/1.1\r\n{self.head}Content-Length: {n}\r\n\r\n".encode("latin-1")
        if n and n <= 1 << 16:
            self.sock.sendall(head + body)
        else:
            self.sock.sendall(head)
            if n:
                self.sock.sendall(body)
        line = self.rf.readline(1 << 16)
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ConnectionError(f"not an HTTP response: {line[:60]!r}")
        status, headers = int(parts[1]), {}
        while True:
            h = self.rf.readline(1 << 16)
            if h in (b"\r\n", b"\n"):
                break
            if not h:
                raise ConnectionError("connection closed in the response headers")
            k, _, v = h.partition(b":")
            headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
        close = headers.get("connection", "").lower() == "close" or parts[0] == b"HTTP/1.0"
        if method == "HEAD" or status in (204, 304) or status < 200:
            data = b""
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            data = self._chunked(limit)
        elif "content-length" in headers:
            want = int(headers["content-length"])
            if limit is not None and want > limit and status == 200:
                raise TooLarge(path, want, limit)
            data = self.rf.read(want)
            if len(data) != want:
                raise ConnectionError(f"response body ended after {len(data)} of {want} bytes")
        else:
            data, close = self.rf.read(-1 if limit is None else limit + 1), True
            if limit is not None and len(data) > limit:
                raise TooLarge(path, len(data), limit)
        return _Response(status, data, headers), close

    def _chunked(self, limit: int | None = None) -> bytes:
        out, got = [], 0
        while True:
            size = int(self.rf.readline(1 << 16).split(b";")[0].strip() or b"x", 16)
            got += size
            if limit is not None and got > limit:
                raise TooLarge("a chunked body", got, limit)
            if size == 0:
                while self.rf.readline(1 << 16) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(out)
            out.append(self.rf.read(size))
            if len(out[-1]) != size or self.rf.readline(1 << 16) not in (b"\r\n", b"\n"):
                raise ConnectionError("chunked response body broke off")


class RelayStore:
    """relay://host:port[?timeout=S&ca=PATH]: the token comes from NEMO_DCR_RELAY_TOKEN (or
    `token=`), never from the URL, so it is never logged with it.

    Requests go over one kept-alive connection per calling thread (_Conn): a fleet's followers
    make tens of small requests per version (waits, listings, records), and urllib3's pool cost
    about 0.27 ms of CPU per request, http.client about 0.13 ms, against about 0.04 ms here, on
    the same 2 cores the relays and the receivers share in the relay bench."""

    long_polls = True  # GET /wait (protocol.store.wait_news)

    def __init__(self, url: str, token: str | None = None, timeout: float | None = None):
        u = urlparse(url)
        if u.scheme not in ("relay", "relays") or not u.hostname or not u.port:
            raise StoreError(f"bad relay URL {url!r} (relay://host:port)")
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        self.url = f"{u.scheme}://{u.hostname}:{u.port}"
        self.host, self.port = u.hostname, u.port
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.read_timeout = float(q.get("timeout", timeout or 30.0))
        self.ssl = None
        if u.scheme == "relays":
            self.ssl = ssl.create_default_context(cafile=q.get("ca"))
        self._auth = f"Authorization: Bearer {self.token}\r\n" if self.token else ""
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._boot: str | None = None  # the relay process whose generations the wait tokens count

    def _conn(self) -> _Conn:
        """This thread's connection; a kept-alive one the relay closed meanwhile (its socket
        reads as ready while idle) is replaced before the request, never retried after it."""
        c = getattr(self._local, "conn", None)
        if c is not None and (c.sock is None or select.select([c.sock], [], [], 0)[0]):
            c.close()
            c = None
        if c is None:
            c = self._local.conn = _Conn(self.host, self.port, self.ssl, self.read_timeout, self._auth)
        return c

    def _send(self, method: str, path: str, body: bytes | None, limit: int | None = None) -> _Response:
        c = self._conn()
        try:
            r, close = c.request(method, path, body, limit)
        except BaseException:
            c.close()
            self._local.conn = None
            raise
        if close:
            c.close()
            self._local.conn = None
        return r

    def _req(self, method: str, path: str, body: bytes | None = None, fields: dict | None = None,
             limit: int | None = None) -> _Response:
        if fields:
            path += "?" + urlencode(fields)
        try:
            r = self._send(method, path, body, limit)
        except TooLarge:
            raise
        except (OSError, ValueError) as exc:  # ValueError: a malformed response
            why = type(exc).__name__
            if isinstance(exc, ConnectionError) and exc.args:  # (ours name what was wrong)
                why += f": {exc}"
            raise StoreError(f"relay at {self.url} unreachable ({why})") from None
        if r.status == 401:
            raise StoreError(f"relay at {self.url} refused the token (HTTP 401: "
                             f"{'wrong token' if self.token else f'no token; set {TOKEN_ENV}'})")
        if r.status >= 500:
            raise StoreError(f"relay at {self.url} failed (HTTP {r.status}): {_error(r)}")
        return r

    def get(self, key: str, limit: int | None = None) -> bytes:
        """The object's bytes; KeyError if absent; TooLarge (by its length, unread) over
        `limit` bytes; RecordError where the relay refuses a receiver's record it holds as bad
        (422): a bad record, not a failing store, so a failover chain does not move on."""
        r = self._req("GET", OBJECT_ROUTE + quote(key), limit=limit)
        if r.status == 404:
            raise KeyError(key)
        if r.status in (413, 422):
            if r.status == 413:
                raise TooLarge(f"{key} (refused by the relay at {self.url}: {_error(r)})", -1, limit or 0)
            raise RecordError(f"{key}: refused by the relay at {self.url} as a bad record: {_error(r)}")
        data = r.data
        want = r.headers.get(CHECKSUM_HEADER.lower())
        if want is None or xxhash.xxh3_64_hexdigest(data) != want:
            raise StoreError(f"relay at {self.url}: {key} arrived corrupt or truncated ({len(data)} bytes)")
        return data

    def exists(self, key: str) -> bool:
        return self._req("HEAD", OBJECT_ROUTE + quote(key)).status == 200

    def list(self, prefix: str) -> list[str]:
        return json.loads(self._req("GET", "/list", fields={"prefix": prefix}).data)

    def children(self, prefix: str) -> list[str]:
        return json.loads(self._req("GET", "/children", fields={"prefix": prefix}).data)

    def put(self, key: str, data: bytes, durable: bool = True) -> None:
        r = self._req("PUT", OBJECT_ROUTE + quote(key), body=data)
        _refused(r, key, self.url)
        if r.status != 200:
            raise StoreError(f"relay at {self.url} refused PUT {key} (HTTP {r.status}): {_error(r)}")

    def put_if_absent(self, key: str, data: bytes) -> bool:
        r = self._req("PUT", OBJECT_ROUTE + quote(key) + "?if_absent=1", body=data)
        _refused(r, key, self.url)
        if r.status not in (200, 412):
            raise StoreError(f"relay at {self.url} refused PUT {key} (HTTP {r.status}): {_error(r)}")
        return r.status == 200

    def delete(self, keys: list[str]) -> None:
        raise StoreError("relays do not delete: run gc against the origin store")

    def delete_prefix(self, prefix: str) -> list[str]:
        raise StoreError("relays do not delete: run gc against the origin store")

    def _wait(self, token: int, limit: float, data_only: bool, keys: bool) -> dict:
        fields = {"gen": str(token), "timeout": f"{limit:.3f}"}
        if data_only:
            fields["data"] = "1"
        if keys:
            fields["keys"] = "1"
        boot = self._boot
        if token and boot:  # the relay process that issued the token: another one answers at once
            fields["boot"] = boot
        got = json.loads(self._req("GET", "/wait", fields=fields).data)
        if token and got.get("boot") != boot:
            got["keys"] = None  # restarted since: what is new cannot be named from that token
        self._boot = got.get("boot")
        return got

    def wait(self, token: int, limit: float, data_only: bool = False) -> int:
        """Long-poll: return once the relay holds something newer than `token` (data_only: a
        new immutable object, not an ack or a registration), or after limit s."""
        return int(self._wait(token, limit, data_only, False)["gen"])

    def wait_keys(self, token: int, limit: float, data_only: bool = False) -> tuple[int, list[str] | None]:
        """wait(), also naming the keys new since `token` (None: the relay cannot say; list)."""
        got = self._wait(token, limit, data_only, True)
        return int(got["gen"]), got.get("keys")

    def health(self) -> dict:
        return json.loads(self._req("GET", "/health").data)

    def stats(self) -> dict:
        return json.loads(self._req("GET", "/stats").data)

    def executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(8, thread_name_prefix="relay-get")
        return self._pool


class RefusedError(ValueError):
    """A relay refused an object as corrupt (HTTP 400): the writer's fault, so a failover chain
    does not pass it on to the next store."""


def _refused(r, key: str, url: str) -> None:
    if r.status == 400:
        raise RefusedError(f"relay at {url} refused {key}: {_error(r)}")


def _error(r) -> str:
    try:
        return json.loads(r.data).get("error", "")
    except ValueError:
        return r.data[:200].decode(errors="replace")


class FailoverStore:
    """Stores tried in order; a failure (StoreError, not a missing key) moves to the next one
    for good, printing one line. All failing raises the last error."""

    def __init__(self, stores: list, quiet: bool = False):
        if not stores:
            raise ValueError("FailoverStore needs at least one store")
        self.stores, self.i, self.quiet = stores, 0, quiet
        self.url = ",".join(getattr(s, "url", "?") for s in stores)
        self._lock = threading.Lock()
        self.failovers = 0
        self.failed_at: float | None = None  # when it last moved down the chain (time.monotonic)

    @property
    def current(self):
        return self.stores[self.i]

    @property
    def long_polls(self) -> bool:
        """While on a relay; once fallen back to the origin (S3), polled like it: a follower
        or relay below then backs off when idle instead of listing S3 every few ms."""
        return long_polls(self.current)

    def _call(self, op: str, *args):
        while True:
            i = self.i
            try:
                return getattr(self.stores[i], op)(*args)
            except StoreError as exc:
                self._advance(i, exc)

    def _advance(self, i: int, exc: StoreError) -> None:
        """Store i failed: move to the next one (once, whoever saw it first), or re-raise at the end."""
        with self._lock:
            if self.i == i:
                if i + 1 >= len(self.stores):
                    raise exc
                self.i = i + 1
                self.failovers += 1
                self.failed_at = time.monotonic()
                if not self.quiet:
                    print(f"nemo-dcr: {exc}; re-attaching to {getattr(self.stores[i + 1], 'url', '?')}",
                          file=sys.stderr, flush=True)

    def get(self, key, limit=None):
        return self._call("get", key, limit)

    def exists(self, key):
        return self._call("exists", key)

    def list(self, prefix):
        return self._call("list", prefix)

    def children(self, prefix):
        return self._call("children", prefix)

    def put(self, key, data, durable=True):
        return self._call("put", key, data, durable)

    def put_if_absent(self, key, data):
        return self._call("put_if_absent", key, data)

    def wait(self, token: int, limit: float, data_only: bool = False) -> int:
        return self.wait_keys(token, limit, data_only)[0]

    def wait_keys(self, token: int, limit: float, data_only: bool = False) -> tuple[int, list[str] | None]:
        """The current store's wait, with tokens tagged by the store that issued them. A token
        from the store before a failover (another call, a part's fetch, moved the chain on) told
        the next one "nothing new since" a generation it never counted: a follower then missed
        the version record the new store already held, and waited for ever."""
        n = len(self.stores) + 1
        i = self.i
        gen = token // n if token % n == i + 1 else 0
        try:
            got, news = wait_news(self.stores[i], gen, 0.005, limit, data_only)  # the origin (polled): no news
        except StoreError as exc:
            self._advance(i, exc)
            return 0, None  # nothing known of the store now in use
        return got * n + i + 1, news if gen or not token else None

    def delete(self, keys):
        return self.stores[-1].delete(keys)

    def delete_prefix(self, prefix):
        return self.stores[-1].delete_prefix(prefix)

    def executor(self):
        ex = getattr(self.current, "executor", None)
        if ex is not None:
            return ex()
        if not hasattr(self, "_pool"):
            self._pool = ThreadPoolExecutor(8, thread_name_prefix="failover-get")
        return self._pool
