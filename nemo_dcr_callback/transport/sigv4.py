"""Plain S3 requests signed with AWS Signature Version 4, for S3Store's frequent small calls.

boto3 costs about 2 ms of client CPU per request (its event hooks, parameter handling and
parsing), and more per MB sent: on the relay bench's 2 cores the root relay's write-through
to S3 (every part, manifest, ack and decision of a version, plus its listings) spent about
as much CPU in boto3 as the receivers spent applying. A request here is the signature (a
few HMACs), one kept-alive http.client connection per thread and, for listings, one XML
parse. Only the success path lives here: S3Store sends anything else (an error status, a
broken connection, no credentials) through boto3, which retries and names the problem, so
errors read exactly as before.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import http.client
import os
import ssl
import threading
import zlib
from typing import NamedTuple
from urllib.parse import quote, urlparse
from xml.etree import ElementTree

from nemo_dcr_callback.protocol.store import redact

_SAFE = "-_.~"
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


def _uri(path: str) -> str:
    return quote(path, safe="/" + _SAFE)


def _query(query: dict[str, str]) -> str:
    """The canonical query string (sorted, every name and value encoded): signed, and sent as is."""
    return "&".join(f"{quote(k, safe=_SAFE)}={quote(v, safe=_SAFE)}" for k, v in sorted(query.items()))


class Response(NamedTuple):
    status: int
    body: bytes


class Listing(NamedTuple):
    keys: list[str]
    prefixes: list[str]  # CommonPrefixes (with Delimiter)
    next_token: str | None  # set when the listing is truncated


class SigV4Client:
    """Signed requests to one S3 endpoint (path-style addressing). `credentials` returns
    (access key, secret key, session token or None) or None; it is asked on every request,
    so rotated credentials are picked up."""

    def __init__(self, endpoint_url: str, region: str, credentials, timeout: float = 60.0,
                 connect_timeout: float = 5.0):
        u = urlparse(endpoint_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) endpoint: {redact(endpoint_url)!r}")
        self.https = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.https else 80)
        default_port = self.port == (443 if self.https else 80)
        self.host_header = self.host if default_port else f"{self.host}:{self.port}"
        self.region = region
        self.credentials = credentials
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._local = threading.local()
        self._keys: dict[tuple[str, str], bytes] = {}  # (secret, date) -> signing key

    # ------------------------------------------------------------ signing
    def _signing_key(self, secret: str, date: str) -> bytes:
        k = self._keys.get((secret, date))
        if k is None:
            k = ("AWS4" + secret).encode()
            for part in (date, self.region, "s3", "aws4_request"):
                k = hmac.new(k, part.encode(), hashlib.sha256).digest()
            self._keys = {(secret, date): k}  # one day's key; the previous one is dropped
        return k

    def signed_headers(self, method: str, path: str, query: dict[str, str], headers: dict[str, str],
                       payload_hash: str, now: datetime.datetime | None = None) -> dict[str, str] | None:
        """Headers for the request, Authorization included; None without credentials."""
        creds = self.credentials()
        if creds is None:
            return None
        access, secret, token = creds
        now = now or datetime.datetime.now(datetime.UTC)
        amz_date, date = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        h = {k.lower(): str(v).strip() for k, v in headers.items()}
        h.update({"host": self.host_header, "x-amz-date": amz_date, "x-amz-content-sha256": payload_hash})
        if token:
            h["x-amz-security-token"] = token
        names = sorted(h)
        canonical = "\n".join([
            method, _uri(path), _query(query),
            "".join(f"{k}:{' '.join(h[k].split())}\n" for k in names), ";".join(names), payload_hash])
        scope = f"{date}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        sig = hmac.new(self._signing_key(secret, date), to_sign.encode(), hashlib.sha256).hexdigest()
        h["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access}/{scope}, SignedHeaders={';'.join(names)}, "
                              f"Signature={sig}")
        return h

    # ------------------------------------------------------------ requests
    def _conn(self) -> http.client.HTTPConnection:
        """This thread's connection: connected within connect_timeout (an endpoint that drops
        packets must not hold a call for the read timeout before boto3 takes over), then
        reading with the read timeout."""
        c = getattr(self._local, "conn", None)
        if c is None:
            if self.https:  # the CA bundle boto3 would use, if one is named
                ctx = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
                c = http.client.HTTPSConnection(self.host, self.port, timeout=self.connect_timeout, context=ctx)
            else:
                c = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout)
            c.connect()
            c.sock.settimeout(self.timeout)
            self._local.conn = c
        return c

    def _drop(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
            self._local.conn = None

    def request(self, method: str, path: str, query: dict[str, str] | None = None, body: bytes = b"",
                headers: dict[str, str] | None = None) -> Response | None:
        """One signed request; None if it could not be made or answered (no credentials, a
        connection error): the caller then goes through boto3."""
        query = query or {}
        h = dict(headers or {})
        if body:  # the server checks both: the signed payload hash and the CRC32
            h["x-amz-checksum-crc32"] = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
        signed = self.signed_headers(method, path, query, h, hashlib.sha256(body).hexdigest())
        if signed is None:
            return None
        signed["content-length"] = str(len(body))
        target = _uri(path) + (f"?{_query(query)}" if query else "")
        for _ in range(2):  # a kept-alive connection the server closed meanwhile: once more, fresh
            reused = getattr(self._local, "conn", None) is not None
            try:
                c = self._conn()
                c.request(method, target, body=body or None, headers=signed)
                r = c.getresponse()
                data = r.read()
            except (OSError, http.client.HTTPException):
                self._drop()
                if not reused:
                    return None
                continue
            if r.will_close:
                self._drop()
            return Response(r.status, data)
        return None

    def list_page(self, bucket: str, prefix: str, delimiter: str | None = None, token: str | None = None,
                  max_keys: int | None = None) -> Listing | None:
        """One ListObjectsV2 page; None if the request failed (the caller asks boto3)."""
        q = {"list-type": "2", "prefix": prefix}
        if max_keys:
            q["max-keys"] = str(max_keys)
        if delimiter:
            q["delimiter"] = delimiter
        if token:
            q["continuation-token"] = token
        r = self.request("GET", f"/{bucket}", q)
        if r is None or r.status != 200:
            return None
        try:
            root = ElementTree.fromstring(r.body)
        except ElementTree.ParseError:
            return None
        ns = _NS if root.tag.startswith(_NS) else ""
        keys = [e.text or "" for e in root.iterfind(f"{ns}Contents/{ns}Key")]
        prefixes = [e.text or "" for e in root.iterfind(f"{ns}CommonPrefixes/{ns}Prefix")]
        truncated = (root.findtext(f"{ns}IsTruncated") or "").lower() == "true"
        nxt = root.findtext(f"{ns}NextContinuationToken") if truncated else None
        if truncated and not nxt:
            return None
        return Listing(keys, prefixes, nxt)
