"""S3 object storage (AWS, or any server that speaks the API: SeaweedFS in the tests).

URL: ``s3://bucket/prefix``, with optional query parameters ``endpoint=http://host:port`` and
``region=...``. Credentials come from the standard AWS chain (environment, shared files,
instance roles) and are never logged; ``AWS_ENDPOINT_URL`` works as usual.

What the commit protocol needs from S3, and how this store gets it:
- atomic objects: S3 never shows a partial PUT (or an incomplete multipart upload);
- corrupted bodies refused: every PUT carries a CRC32 checksum the server verifies;
- exactly one writer wins: ``put_if_absent`` is a PUT with ``If-None-Match: *``;
- transient failures retried: botocore's standard retry mode (backoff on 5xx, throttling and
  connection errors), with bounded connect/read timeouts so no call hangs for ever;
- large objects in parts: multipart above ``multipart_bytes``, parts uploaded concurrently.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qs, urlparse

import boto3
import botocore
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from nemo_dcr_callback.protocol.keys import is_history
from nemo_dcr_callback.protocol.store import StoreError, put_once, redact
from nemo_dcr_callback.safe_io import TooLarge
from nemo_dcr_callback.transport.sigv4 import SigV4Client

# After a plain signed request got no answer or a server error (and boto3 then succeeded),
# boto3 alone for this long: a TLS setup or proxy the plain client cannot use must not cost
# a failed attempt on every call.
FAST_BACKOFF_S = 30.0


class S3Store:
    """One bucket and key prefix. Thread-safe (boto3 clients are); `executor()` runs requests
    concurrently (part uploads, part fetches)."""

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None,
                 max_attempts: int = 5, connect_timeout: float = 5.0, read_timeout: float = 60.0,
                 multipart_bytes: int = 64 << 20, concurrency: int = 8, fast: bool = True):
        u = urlparse(url)
        if u.scheme != "s3" or not u.netloc:
            raise StoreError(f"not an s3://bucket/prefix URL: {redact(url)!r}")
        if "@" in u.netloc:
            raise StoreError(f"credentials inside the store URL are not accepted ({redact(url)!r}): use "
                             "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role")
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        self.bucket = u.netloc
        self.prefix = u.path.strip("/")
        self.endpoint_url = endpoint_url or q.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") \
            or os.environ.get("AWS_ENDPOINT_URL")
        region = region or q.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") \
            or "us-east-1"
        # What is shown of the endpoint: user info in it is a secret (botocore still gets the URL).
        self.endpoint_shown = redact(self.endpoint_url) if self.endpoint_url else None
        shown = f"?endpoint={self.endpoint_shown}" if self.endpoint_url else ""
        self.url = f"s3://{self.bucket}/{self.prefix}{shown}"
        self.multipart_bytes = multipart_bytes
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self._errors = botocore.exceptions
        cfg = Config(retries={"max_attempts": max_attempts, "mode": "standard"}, connect_timeout=connect_timeout,
                     read_timeout=read_timeout, max_pool_connections=max(10, 2 * concurrency),
                     request_checksum_calculation="when_supported", response_checksum_validation="when_supported",
                     s3={"addressing_style": "path"})
        # Explicit keys (tests, an embedded server) or, when None, the standard AWS chain.
        session = boto3.session.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key)
        self.client = session.client("s3", endpoint_url=self.endpoint_url, region_name=region, config=cfg)
        self._pool = None
        self._pool_lock = threading.Lock()
        # Puts and listings that succeed go out as plain signed requests (transport.sigv4), at
        # about a tenth of boto3's client CPU; anything else is redone through boto3. Needs an
        # explicit endpoint (S3-compatible servers, or AWS named by one). fast=False: boto3 only.
        self.fast = None
        self._fast_off_until = 0.0
        if fast and self.endpoint_url:
            def creds():
                c = session.get_credentials()
                if c is None:
                    return None
                f = c.get_frozen_credentials()
                return f.access_key, f.secret_key, f.token

            self.fast = SigV4Client(self.endpoint_url, region, creds, timeout=read_timeout,
                                    connect_timeout=connect_timeout)

    # -------------------------------------------------------------- helpers
    def _key(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad key {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, op: str, key: str, exc: Exception) -> StoreError:
        """A clear error naming what went wrong (never the credentials)."""
        e = self._errors
        where = f"s3://{self.bucket}/{self._key(key) if key else self.prefix}"
        ep = f" at {self.endpoint_shown}" if self.endpoint_url else ""
        if isinstance(exc, e.NoCredentialsError):
            return StoreError(f"{op} {where}: no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                              "AWS_PROFILE or an instance role)")
        if isinstance(exc, (e.EndpointConnectionError, e.ConnectTimeoutError, e.ReadTimeoutError,
                            e.ConnectionClosedError)):
            return StoreError(f"{op} {where}: S3 endpoint{ep} unreachable ({type(exc).__name__})")
        if isinstance(exc, e.ClientError):
            code = exc.response.get("Error", {}).get("Code", "?")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                        "ExpiredToken"):
                return StoreError(f"{op} {where}: S3{ep} rejected the credentials ({code}, HTTP {status})")
            if code == "NoSuchBucket":
                return StoreError(f"{op} {where}: bucket {self.bucket!r} does not exist{ep}")
            return StoreError(f"{op} {where}: S3{ep} answered {code} (HTTP {status})")
        return StoreError(f"{op} {where}: {type(exc).__name__}: {exc}")

    @staticmethod
    def _code(exc: Exception) -> str:
        return getattr(exc, "response", {}).get("Error", {}).get("Code", "")

    # -------------------------------------------------------------- interface
    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (tests and `nemo-dcr s3-server`)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except self._errors.ClientError as exc:
            if self._code(exc) not in ("404", "NoSuchBucket", "NotFound"):
                raise self._fail("head bucket", "", exc) from None
            try:
                self.client.create_bucket(Bucket=self.bucket)
            except self._errors.ClientError as exc2:
                if self._code(exc2) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise self._fail("create bucket", "", exc2) from None
        except self._errors.BotoCoreError as exc:
            raise self._fail("head bucket", "", exc) from None

    def put(self, key: str, data: bytes, durable: bool = True) -> None:
        """Atomic, checksummed put (S3 objects are durable once acknowledged). History objects
        are created once: a conditional PUT (If-None-Match), and above the multipart size, where
        not every S3 server takes a conditional complete, a check for the object first (a race
        of two publishers on one large part is then not caught: there is one publisher)."""
        if is_history(key):
            if len(data) <= self.multipart_bytes:
                return put_once(self, key, data)
            if self.exists(key):
                return put_once(self, key, data)  # (compares: same bytes stand, others are refused)
        try:
            if len(data) > self.multipart_bytes:
                tc = TransferConfig(multipart_threshold=self.multipart_bytes, multipart_chunksize=self.multipart_bytes,
                                    max_concurrency=self.concurrency, use_threads=True)
                self.client.upload_fileobj(io.BytesIO(data), self.bucket, self._key(key), Config=tc,
                                           ExtraArgs={"ChecksumAlgorithm": "CRC32"})
            else:
                st = self._fast_put(key, data)
                if st == 200:
                    return
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, ChecksumAlgorithm="CRC32")
                self._fast_failed(st)
        except (self._errors.ClientError, self._errors.BotoCoreError) as exc:
            raise self._fail("put", key, exc) from None
        except Exception as exc:  # s3transfer wraps failures of multipart uploads
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, (self._errors.ClientError, self._errors.BotoCoreError)):
                raise self._fail("put", key, cause) from None
            raise

    def executor(self):
        """A shared thread pool for concurrent requests."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="nemo-dcr-s3")
            return self._pool

    def _fast(self):
        """The plain-request client, unless it is off (failed lately, or for good)."""
        if self.fast is None or time.monotonic() < self._fast_off_until:
            return None
        return self.fast

    def _fast_failed(self, status: int | None) -> None:
        """A plain request did not succeed where boto3 then did (status: its HTTP status, -1
        for no answer). A client error means this endpoint does not take our requests
        (signing, addressing): boto3 only from now on. No answer or a server error: boto3
        only for FAST_BACKOFF_S."""
        if self.fast is None or status is None:  # (None: no plain request was made)
            return
        if 400 <= status < 500:
            print(f"nemo-dcr: {self.endpoint_shown} refused a plain signed request (HTTP {status}) that boto3 then "
                  "made: using boto3 only", file=sys.stderr, flush=True)
            self.fast = None
        else:
            self._fast_off_until = time.monotonic() + FAST_BACKOFF_S

    def _fast_put(self, key: str, data: bytes, headers: dict[str, str] | None = None) -> int | None:
        """The status of a plain signed PUT: None if none was made (the plain path is off), -1 if
        it got no answer."""
        f = self._fast()
        if f is None:
            return None
        r = f.request("PUT", f"/{self.bucket}/{self._key(key)}", body=data, headers=headers)
        return -1 if r is None else r.status

    def put_if_absent(self, key: str, data: bytes, durable: bool = True) -> bool:
        """PUT with If-None-Match: * — True if this call created the object, False if it existed."""
        st = self._fast_put(key, data, {"If-None-Match": "*"})
        if st == 200:
            return True
        if st in (409, 412):  # another writer's object stands (409: a concurrent conditional write)
            return False
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, ChecksumAlgorithm="CRC32",
                                   IfNoneMatch="*")
            self._fast_failed(st)
            return True
        except self._errors.ClientError as exc:
            if self._code(exc) in ("PreconditionFailed", "ConditionalRequestConflict") or \
                    exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
                self._fast_failed(st)
                return False
            raise self._fail("conditional put", key, exc) from None
        except self._errors.BotoCoreError as exc:
            raise self._fail("conditional put", key, exc) from None

    def get(self, key: str, limit: int | None = None) -> bytes:
        """The object's bytes; safe_io.TooLarge, by its Content-Length and unread, for one over
        `limit` bytes. botocore retries failed requests; a body that breaks off or fails its
        checksum after the response began is fetched again here (with backoff)."""
        return self._read(key, lambda body: body.read(), limit)

    def get_pieces(self, key: str, sink, piece_bytes: int = 1 << 16, limit: int | None = None) -> None:
        """The object's bytes handed to sink.feed() as they arrive (a receiver decodes a part's
        chunks while the rest is on the link); a body that breaks off or fails its checksum is
        fetched again from the start after sink.reset() (with backoff)."""

        def consume(body) -> None:
            sink.reset()
            for piece in body.iter_chunks(piece_bytes):
                sink.feed(piece)

        self._read(key, consume, limit)

    def _read(self, key: str, consume, limit: int | None = None):
        e = self._errors
        broken = (e.IncompleteReadError, e.ResponseStreamingError, e.FlexibleChecksumError, e.ReadTimeoutError,
                  e.ConnectionClosedError)
        for attempt in range(self.max_attempts):
            try:
                got = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
                size = got.get("ContentLength")
                if limit is not None and (size is None or size > limit):
                    got["Body"].close()  # (the connection goes, the body unread)
                    raise TooLarge(key, -1 if size is None else size, limit)
                return consume(got["Body"])
            except e.ClientError as exc:
                if self._code(exc) in ("NoSuchKey", "404", "NotFound"):
                    raise KeyError(key) from None
                raise self._fail("get", key, exc) from None
            except broken as exc:
                if attempt + 1 == self.max_attempts:
                    raise self._fail("get", key, exc) from None
                time.sleep(min(2.0, 0.05 * 2 ** attempt))
            except e.BotoCoreError as exc:
                raise self._fail("get", key, exc) from None
        raise AssertionError("unreachable")

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except self._errors.ClientError as exc:
            if self._code(exc) in ("NoSuchKey", "404", "NotFound"):
                return False
            raise self._fail("head", key, exc) from None
        except self._errors.BotoCoreError as exc:
            raise self._fail("head", key, exc) from None

    def _base(self, prefix: str) -> str:
        """The full key prefix a listing of `prefix` asks for (ends with "/", or is empty)."""
        return self._key(prefix.rstrip("/")) + "/" if prefix else (self.prefix + "/" if self.prefix else "")

    def _list_objects(self, prefix: str, delimiter: str | None) -> tuple[list[str], list[str]]:
        """Every page of a listing: (full keys, common prefixes). Plain signed requests first;
        if any page of those fails, the whole listing through boto3."""
        base = self._base(prefix)
        f = self._fast()
        if f is not None:
            keys: list[str] = []
            prefixes: list[str] = []
            token = None
            while (page := f.list_page(self.bucket, base, delimiter, token)) is not None:
                keys += page.keys
                prefixes += page.prefixes
                if page.next_token is None:
                    return keys, prefixes
                token = page.next_token
        keys, prefixes = [], []
        args = {"Bucket": self.bucket, "Prefix": base, **({"Delimiter": delimiter} if delimiter else {})}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(**args):
                keys += [o["Key"] for o in page.get("Contents", [])]
                prefixes += [c["Prefix"] for c in page.get("CommonPrefixes", [])]
        except (self._errors.ClientError, self._errors.BotoCoreError) as exc:
            raise self._fail("list", prefix, exc) from None
        if f is not None:
            self._fast_failed(-1)
        return keys, prefixes

    def list(self, prefix: str) -> list[str]:
        cut = len(self.prefix) + 1 if self.prefix else 0
        return sorted(k[cut:] for k in self._list_objects(prefix, None)[0])

    def delete_prefix(self, prefix: str) -> list[str]:
        """Delete every object under prefix and the folder entries a filer-backed server
        (SeaweedFS) keeps for them, deepest first. Returns the deleted object keys."""
        keys = self.list(prefix)
        self.delete(keys)
        dirs = {prefix.rstrip("/")}
        for k in keys:
            parts = k.split("/")[:-1]
            dirs.update("/".join(parts[:i]) for i in range(len(prefix.rstrip("/").split("/")), len(parts) + 1))
        for d in sorted(dirs, key=lambda x: -x.count("/")):
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self._key(d) + "/")
            except (self._errors.ClientError, self._errors.BotoCoreError):
                pass  # plain S3 has no folder entries
        return keys

    def children(self, prefix: str) -> list[str]:
        """Names directly under prefix (a listing with Delimiter='/')."""
        n = len(self._base(prefix))
        keys, prefixes = self._list_objects(prefix, "/")
        return sorted({p[n:].rstrip("/") for p in prefixes} | {k[n:] for k in keys})

    def delete(self, keys: list[str]) -> None:
        """Delete objects (missing ones are fine), 1000 per request."""
        try:
            for i in range(0, len(keys), 1000):
                objs = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
                r = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objs, "Quiet": True})
                if r.get("Errors"):
                    e = r["Errors"][0]
                    raise StoreError(f"delete s3://{self.bucket}/{e.get('Key')}: {e.get('Code')} {e.get('Message')}")
        except (self._errors.ClientError, self._errors.BotoCoreError) as exc:
            raise self._fail("delete", keys[0] if keys else "", exc) from None
