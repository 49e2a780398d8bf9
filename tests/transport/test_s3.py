"""The S3 transport (transport/s3.py, sigv4.py) against a real S3 server (SeaweedFS on
loopback, the `seaweed` fixture, with credentials it checks): basic and conditional writes,
checksums the server verifies, credential errors, AWS's published SigV4 example, and the
fast path (plain signed requests instead of boto3) with its fallbacks."""

from __future__ import annotations

import os
import threading

import pytest

from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.transport.s3 import S3Store
from tests.helpers.stores import race


def test_store_basics_and_conditional_write(s3_store):
    s3_store.put("a/x", b"hello")
    assert s3_store.get("a/x") == b"hello" and s3_store.exists("a/x") and not s3_store.exists("a/y")
    with pytest.raises(KeyError):
        s3_store.get("a/y")
    big = os.urandom(3 << 20) * 25  # 75 MB: a multipart upload
    s3_store.put("a/big", big)
    assert s3_store.get("a/big") == big
    assert s3_store.list("a") == ["a/big", "a/x"] and s3_store.children("") == ["a"]
    wins = race(lambda i: s3_store.put_if_absent("a/rec", str(i).encode()), 6)
    assert wins.count(True) == 1  # If-None-Match: exactly one writer wins
    s3_store.delete(["a/big", "a/x"])
    assert s3_store.list("a") == ["a/rec"]


def test_corrupted_body_refused_by_server(seaweed, s3_store):
    """The server checks the checksum we send: a body that does not match is rejected."""
    import base64
    import hashlib

    import botocore

    with pytest.raises(botocore.exceptions.ClientError, match="BadDigest|InvalidDigest|XAmzContentSHA256Mismatch"):
        s3_store.client.put_object(Bucket=s3_store.bucket, Key=s3_store._key("bad"), Body=b"payload",
                                ContentMD5=base64.b64encode(hashlib.md5(b"payloaX").digest()).decode())
    assert not s3_store.exists("bad")


def test_wrong_credentials_and_unreachable_endpoint(seaweed):
    bad = S3Store(seaweed.url(seaweed.bucket + "/x"), access_key=seaweed.access_key, secret_key="wrong-secret")
    with pytest.raises(StoreError, match="rejected the credentials") as e:
        bad.put("k", b"v")
    assert "wrong-secret" not in str(e.value)
    gone = S3Store("s3://b/x?endpoint=http://127.0.0.1:9", access_key="a", secret_key="b", max_attempts=1,
                   connect_timeout=1)
    with pytest.raises(StoreError, match="unreachable"):
        gone.get("k")


def test_missing_credentials_clear_error(seaweed, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s = S3Store(seaweed.url(seaweed.bucket + "/x"), max_attempts=1)
    with pytest.raises(StoreError, match="no AWS credentials"):
        s.get("k")


# ---------------------------------------------------------------- plain signed requests (transport.sigv4)
def test_sigv4_signature_matches_the_aws_example():
    """AWS's published SigV4 example for S3 (GET /test.txt with a Range header, in the S3 API
    reference's 'Signature Calculations for the Authorization Header' page): our signature
    must be theirs, byte for byte."""
    import datetime

    from nemo_dcr_callback.transport.sigv4 import SigV4Client

    c = SigV4Client("https://examplebucket.s3.amazonaws.com", "us-east-1",
                    lambda: ("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", None))
    h = c.signed_headers("GET", "/test.txt", {}, {"Range": "bytes=0-9"},
                         "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
                         now=datetime.datetime(2013, 5, 24, tzinfo=datetime.UTC))
    assert h["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


def test_fast_path_does_puts_and_listings_without_boto3(seaweed, s3_store, monkeypatch):
    """Puts, conditional puts and listings succeed as plain signed requests (boto3's calls
    are made to fail here, so a silent fallback would show) and read back the same through
    boto3 (a s3_store with fast=False) on the same server; listings follow continuation tokens."""
    assert s3_store.fast is not None
    plain = S3Store(s3_store.url, access_key=seaweed.access_key, secret_key=seaweed.secret_key, fast=False)

    def no_boto(*a, **k):
        raise AssertionError("went through boto3")

    monkeypatch.setattr(s3_store.client, "put_object", no_boto)
    monkeypatch.setattr(s3_store.client, "get_paginator", no_boto)
    names = [f"v/{i:03d}/k{j}" for i in range(5) for j in range(3)] + ["v/top", "w/x y+z=~"]
    for n in names:
        s3_store.put(n, n.encode() * 100)
    assert s3_store.put_if_absent("v/rec", b"first") and not s3_store.put_if_absent("v/rec", b"second")
    assert plain.get("v/rec") == b"first" and all(plain.get(n) == n.encode() * 100 for n in names)
    assert s3_store.list("v") == plain.list("v") == sorted([*names[:-1], "v/rec"])
    assert s3_store.children("v") == plain.children("v") == ["000", "001", "002", "003", "004", "rec", "top"]
    assert s3_store.children("") == plain.children("") == ["v", "w"]
    keys, token = [], None
    while True:  # pages of 4: the continuation tokens are followed to the same listing
        page = s3_store.fast.list_page(s3_store.bucket, s3_store._key("v") + "/", token=token, max_keys=4)
        assert page is not None and len(page.keys) <= 4
        keys += page.keys
        if page.next_token is None:
            break
        token = page.next_token
    assert [k[len(s3_store.prefix) + 1:] for k in keys] == plain.list("v")


def test_fast_put_whose_body_does_not_match_its_signature_is_refused(s3_store):
    """The payload hash and CRC32 are signed: a body changed after signing is refused by the
    server and nothing is stored."""
    import base64
    import hashlib
    import http.client
    import zlib

    body = b"the payload that was signed"
    f = s3_store.fast
    crc = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
    h = f.signed_headers("PUT", f"/{s3_store.bucket}/{s3_store._key('tampered')}", {},
                         {"x-amz-checksum-crc32": crc}, hashlib.sha256(body).hexdigest())
    c = http.client.HTTPConnection(f.host, f.port, timeout=10)
    c.request("PUT", f"/{s3_store.bucket}/{s3_store._key('tampered')}", body=b"the payload that was changed",
              headers={**h, "content-length": "28"})
    r = c.getresponse()
    assert r.status in (400, 403), r.status
    assert not s3_store.exists("tampered")


def test_fast_path_errors_read_as_before(seaweed):
    """Refused credentials: the plain request fails and the call is redone through boto3,
    whose error names the problem (as without the fast path)."""
    bad = S3Store(seaweed.url(seaweed.bucket + "/x"), access_key=seaweed.access_key, secret_key="wrong-secret")
    assert bad.fast is not None
    for call in (lambda: bad.put("k", b"v"), lambda: bad.put_if_absent("k", b"v"), lambda: bad.list("")):
        with pytest.raises(StoreError, match="rejected the credentials"):
            call()


def test_fast_path_gives_up_within_the_timeouts():
    """An endpoint that accepts connections and never answers: the plain request gives up
    after the read timeout, boto3 (one attempt here) after its own, and the error names the
    endpoint as unreachable; nothing waits for the 60 s default."""
    import socket
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])  # kept open, never answered
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        s = S3Store(f"s3://b/x?endpoint=http://127.0.0.1:{srv.getsockname()[1]}", access_key="a", secret_key="b",
                    max_attempts=1, connect_timeout=1, read_timeout=1)
        assert s.fast is not None
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="unreachable"):
            s.put("k", b"v")
        assert time.monotonic() - t0 < 10
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()


def test_fast_path_steps_aside_where_it_fails_and_boto3_does_not(seaweed, s3_store, monkeypatch, capsys):
    """A plain request that gets no answer (here: the plain client pointed at a closed port)
    while boto3 then succeeds: boto3 alone for FAST_BACKOFF_S. One refused with a client
    error (here: signed with a wrong secret) while boto3 succeeds: this endpoint does not take
    our requests, boto3 alone from then on, said once. Every call succeeds either way."""
    import socket

    calls = []
    real = s3_store.fast.request
    monkeypatch.setattr(s3_store.fast, "request", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    port = s3_store.fast.port
    s3_store.fast.port = closed
    s3_store.put("a", b"1")
    assert calls == ["PUT"] and s3_store._fast_off_until > 0
    s3_store.put("b", b"2")
    assert s3_store.list("") == ["a", "b"] and calls == ["PUT"]  # boto3 alone meanwhile
    s3_store.fast.port, s3_store._fast_off_until = port, 0.0
    monkeypatch.setattr(s3_store.fast, "credentials", lambda: (seaweed.access_key, "wrong-secret", None))
    s3_store.put("c", b"3")
    assert calls == ["PUT", "PUT"] and s3_store.fast is None and s3_store.get("c") == b"3"
    assert "using boto3 only" in capsys.readouterr().err
