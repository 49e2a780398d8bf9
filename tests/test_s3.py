"""The S3 transport and the commit protocol against a real S3 server (SeaweedFS, started on
loopback by the `seaweed` fixture, with credentials it checks). Senders are the real sender
path over canonical tensors (TensorSender) or real torchrun training (the Publisher); the
oracle is always the new tensors themselves or the dense export."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from conftest import perturb, race, random_tensor

from nemo_dcr_callback import codec
from nemo_dcr_callback.core.rawbits import OP_ULP, OP_XOR, bits
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.rebuild import latest_keyframe
from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.testing.tensor_sender import TensorSender
from nemo_dcr_callback.transport.s3 import S3Store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    from nemo_dcr_callback.transport.seaweed import SeaweedS3

    with SeaweedS3(tmp_path_factory.mktemp("seaweed")) as s3:
        yield s3


@pytest.fixture
def store(seaweed, request):
    return seaweed.store(request.node.name.replace("[", "-").replace("]", ""))


def _model(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.w": random_tensor((96, 65), torch.bfloat16, g, specials=False) for i in range(n)}


def _states(steps, seed=1):
    states = [_model()]
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        states.append({k: perturb(t, 0.03, g) for k, t in states[-1].items()})
    return states


def _same(a, b):
    return all(torch.equal(bits(a[k]), bits(b[k])) for k in b)


def _write(store, v, base, old, new, world=2, part_bytes=4 << 20):
    for r in range(world):
        s = TensorSender(old, r, world)
        for n in s.tensors:
            s.tensors[n] = new[n]
        s.write(store, v, base, s.take(), part_bytes=part_bytes)


def _publish(store, v, base, old, new, world=2, policy=None):
    _write(store, v, base, old, new, world)
    rec = commit.seal_version(store, v, base, world, timeout=10)
    return commit.run_commit(store, rec, policy or commit.CommitPolicy())


def test_store_basics_and_conditional_write(store):
    store.put("a/x", b"hello")
    assert store.get("a/x") == b"hello" and store.exists("a/x") and not store.exists("a/y")
    with pytest.raises(KeyError):
        store.get("a/y")
    big = os.urandom(3 << 20) * 25  # 75 MB: a multipart upload
    store.put("a/big", big)
    assert store.get("a/big") == big
    assert store.list("a") == ["a/big", "a/x"] and store.children("") == ["a"]
    wins = race(lambda i: store.put_if_absent("a/rec", str(i).encode()), 6)
    assert wins.count(True) == 1  # If-None-Match: exactly one writer wins
    store.delete(["a/big", "a/x"])
    assert store.list("a") == ["a/rec"]


def test_corrupted_body_refused_by_server(seaweed, store):
    """The server checks the checksum we send: a body that does not match is rejected."""
    import base64
    import hashlib

    import botocore

    with pytest.raises(botocore.exceptions.ClientError, match="BadDigest|InvalidDigest|XAmzContentSHA256Mismatch"):
        store.client.put_object(Bucket=store.bucket, Key=store._key("bad"), Body=b"payload",
                                ContentMD5=base64.b64encode(hashlib.md5(b"payloaX").digest()).decode())
    assert not store.exists("bad")


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


def test_multi_rank_round_trip_with_acks(store):
    """Four sender ranks, two registered receivers acking: the version commits with both
    acks, and both end bit-exact with the new tensors, digests checked."""
    states = _states(1)
    recv = {i: {k: t.clone() for k, t in states[0].items()} for i in range(2)}
    fs = [Follower(store, recv[i], receiver_id=f"worker-{i}", register_every_s=0) for i in range(2)]
    _write(store, 1, 0, states[0], states[1], world=4)
    rec = commit.seal_version(store, 1, 0, 4, timeout=10)
    assert len(rec["ranks"]) == 4 and rec["digests"]
    done = []
    ths = [threading.Thread(target=lambda f=f: done.append(f.follow(until=1, timeout=30))) for f in fs]
    for t in ths:
        t.start()
    d = commit.run_commit(store, rec, commit.CommitPolicy("wait", timeout=30))
    for t in ths:
        t.join()
    assert d["decision"] == "commit" and d["acked"] == ["worker-0", "worker-1"]
    assert all(_same(recv[i], states[1]) for i in range(2))
    assert {r["version"] for r in commit.receivers(store).values()} == {1}


@pytest.mark.parametrize("early", [True, False, "sealed"])
def test_receiver_streams_a_version_while_it_is_written(store, early):
    """Parts are fetched and decoded before the sender has finished the version; with early
    apply they are also applied in place as they arrive, otherwise (and with early="sealed",
    which waits for the seal) nothing is applied yet."""
    states = _states(1)
    s = TensorSender(states[0])
    for n in s.tensors:
        s.tensors[n] = states[1][n]
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, tensors, early=early)
    assert f.early == bool(early)
    seen, applied = [], []

    def after_chunk():
        import time

        time.sleep(0.2)  # parts upload asynchronously: give this one time to land
        f.poll()  # the version is not sealed: the follower streams what is there
        st = f._parts.get(1)
        if st is not None:  # the fetches run in the store's pool: let them land
            for fut in list(st.pending.values()):
                fut.result()
            st.harvest()
        seen.append(len(st.parts) if st is not None else 0)
        f._apply_early(1)
        applied.append(len(st.applied) if st is not None else 0)
        assert commit.read_record(store, 1) is None
        assert _same(tensors, states[0]) == (applied[-1] == 0)

    m = s.write(store, 1, 0, s.take(), part_bytes=1, after_chunk=after_chunk)  # one part per chunk
    assert seen[0] >= 1 and seen == sorted(seen) and seen[-1] == len(m["parts"]) > 1
    assert applied == (seen if early is True else [0] * len(seen))
    commit.run_commit(store, commit.seal_version(store, 1, 0, 1), commit.CommitPolicy())
    f.poll()
    assert f.version == 1 and _same(tensors, states[1])


def _stream_early(store, f, old, new, part_bytes=1):
    """Write version 1 from old to new one part per chunk while f streams and applies it early;
    returns the manifest (the version is not sealed)."""
    s = TensorSender(old)
    for n in s.tensors:
        s.tensors[n] = new[n]

    def after_chunk():
        import time

        time.sleep(0.1)
        f.poll()
        st = f._parts.get(1)
        if st is not None:
            for fut in list(st.pending.values()):
                fut.result()
        f._apply_early(1)

    return s.write(store, 1, 0, s.take(), part_bytes=part_bytes, after_chunk=after_chunk)


def test_early_apply_undone_on_abort(store):
    """Parts applied in place while the version streams are taken back, bit for bit, when the
    version is aborted: the receiver holds version 0 exactly."""
    states = _states(1)
    name = next(iter(states[1]))  # sign flips: cheapest as XOR, so this tensor's chunk is an XOR one
    old = states[0][name]
    flips = torch.rand(old.numel(), generator=torch.Generator().manual_seed(3)) < 0.03
    states[1][name] = (bits(old) ^ (flips.to(torch.int16) << 15)).view(torch.bfloat16).reshape(old.shape)
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, tensors, early=True)
    _stream_early(store, f, states[0], states[1])
    assert f._parts[1].applied and not _same(tensors, states[0])  # really applied early
    # both undo ways run: XOR chunks XOR again, ulp chunks add the negated differences
    assert {d.op for d, _ in f._parts[1].undo} == {OP_XOR, OP_ULP}
    rec = commit.seal_version(store, 1, 0, 1)
    commit.decide(store, 1, 0, "abort", [], [], "test")
    assert f.poll() == [] and f.version == 0 and 1 not in f._parts
    assert _same(tensors, states[0])
    assert rec["version"] == 1


def test_sealed_apply_before_the_decision_undone_on_abort(store):
    """early="sealed": once the version is sealed the receiver applies what it holds, checks
    the digests and acks, all before the decision; an abort then takes it all back exactly."""
    import time

    states = _states(1)
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, tensors, receiver_id="worker-0", early="sealed")
    _stream_early(store, f, states[0], states[1])
    assert not f._parts[1].applied and _same(tensors, states[0])  # streamed, not applied: not sealed
    commit.seal_version(store, 1, 0, 1)
    out: list = []
    th = threading.Thread(target=lambda: out.append(f.poll()))
    th.start()
    deadline = time.monotonic() + 20
    while not commit.read_acks(store, 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert commit.read_acks(store, 1)["worker-0"]["ok"]
    assert _same(tensors, states[1])  # applied (and its digests checked) before any decision
    commit.decide(store, 1, 0, "abort", [], ["worker-0"], "test")
    th.join(20)
    assert out == [[]] and f.version == 0 and _same(tensors, states[0])


def test_early_apply_undone_when_the_digests_fail(store):
    """A receiver that does not hold the base (one element off, untouched by the delta) applies
    early, fails the digest check before acking, and ends on exactly the bits it had."""
    states = _states(1)
    tensors = {k: t.clone() for k, t in states[0].items()}
    name = next(iter(tensors))
    flat = bits(tensors[name]).view(-1)
    changed = (bits(states[0][name]) != bits(states[1][name])).view(-1)
    i = int((~changed).nonzero()[0])
    flat[i] ^= 1
    before = {k: t.clone() for k, t in tensors.items()}
    f = Follower(store, tensors, early=True)  # holds "version 0": no record to check it against
    _stream_early(store, f, states[0], states[1])
    assert f._parts[1].applied
    commit.seal_version(store, 1, 0, 1)
    with pytest.raises(codec.ChunkError, match="does not match the version's digest"):
        f.poll()
    assert f.version == 0 and _same(tensors, before)


def test_early_apply_of_a_stray_part_is_taken_back(store):
    """A part object that no manifest lists (left by a failed writer) may be applied early; at
    the seal it is undone with the rest and the version's own parts give the exact bits."""
    states = _states(1)
    tensors = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, tensors, early=True)
    m = _stream_early(store, f, states[0], states[1])
    stray = commit.part_key(1, 0, 999)
    store.put(stray, store.get(m["parts"][0]["key"]))  # a valid copy: applying it twice undoes it
    f.poll()
    st = f._parts[1]
    for fut in list(st.pending.values()):
        fut.result()
    f._apply_early(1)
    assert stray in st.applied
    commit.run_commit(store, commit.seal_version(store, 1, 0, 1), commit.CommitPolicy())
    f.poll()
    assert f.version == 1 and _same(tensors, states[1])


def test_second_committer_refused(store):
    states = _states(1)
    _write(store, 1, 0, states[0], states[1])
    rec = commit.seal_version(store, 1, 0, 2)
    out = race(lambda i: commit.decide(store, 1, 0, ("commit", "abort")[i % 2], [], [], "racer"), 4)
    assert len({o["decision"] for o in out}) == 1  # every writer sees the one decision that stands
    assert commit.read_decision(store, 1)["decision"] == out[0]["decision"]
    assert rec["version"] == 1


def test_policies_abort_and_quorum(store):
    states = _states(2)
    commit.register(store, "ok", 0)
    commit.register(store, "ghost", 0)  # never acks
    _write(store, 1, 0, states[0], states[1])
    rec = commit.seal_version(store, 1, 0, 2)
    commit.write_ack(store, 1, "ok", 0)
    with pytest.raises(commit.CommitTimeout, match="ghost"):
        commit.run_commit(store, rec, commit.CommitPolicy("wait", timeout=0.3))
    assert commit.read_decision(store, 1) is None  # wait: nothing decided, the trainer sees the error
    d = commit.run_commit(store, rec, commit.CommitPolicy("abort", timeout=0.3))
    assert d["decision"] == "abort" and d["lagging"] == ["ghost"]
    _write(store, 2, 0, states[0], states[2])
    rec2 = commit.seal_version(store, 2, 0, 2)
    commit.write_ack(store, 2, "ok", 0)
    d2 = commit.run_commit(store, rec2, commit.CommitPolicy("quorum", timeout=0.3, quorum=0.5))
    assert d2["decision"] == "commit" and d2["lagging"] == ["ghost"]
    # the lagging receiver catches up later: version 2 builds on 0, which it holds
    tensors = {k: t.clone() for k, t in states[0].items()}
    Follower(store, tensors).poll()
    assert _same(tensors, states[2])


def test_catch_up_by_chain_and_new_receiver_by_keyframe(store):
    states = _states(5)
    commit.write_keyframe(store, 0, states[0])
    behind = {k: t.clone() for k, t in states[0].items()}
    for v in range(1, 6):
        _publish(store, v, v - 1, states[v - 1], states[v])
        if v == 2:
            commit.write_keyframe(store, 2, states[2])
    # 5 versions behind (holding 0): chains 1..5
    f = Follower(store, behind)
    applied = f.poll()
    assert [a.version for a in applied] == [1, 2, 3, 4, 5] and _same(behind, states[5])
    assert all(a.digest_checked for a in applied)
    # a new receiver: the newest committed keyframe, then deltas
    k = latest_keyframe(store)
    assert k == 2
    from safetensors.torch import load

    fresh = load(store.get(f"{commit.keyframe_dir(k)}/model.safetensors"))
    f2 = Follower(store, fresh, version=k)  # checks the keyframe's digests first
    assert [a.version for a in f2.poll()] == [3, 4, 5] and _same(fresh, states[5])


def test_gc_removes_what_nobody_needs(store):
    states = _states(4)
    commit.write_keyframe(store, 0, states[0])
    for v in range(1, 4):
        _publish(store, v, v - 1, states[v - 1], states[v])
    commit.register(store, "slow", 1)
    commit.write_keyframe(store, 3, states[3])
    _write(store, 4, 3, states[3], states[4])  # sealed but aborted
    commit.decide(store, 4, 3, "abort", [], [], "test")
    from nemo_dcr_callback.tools.status import collect  # `nemo-dcr status` reads the same from S3

    st = collect(store)
    assert [r["state"] for r in st["rows"]] == ["commit", "commit", "commit", "abort"]  # versions 1-4
    assert st["keyframes"] == [0, 3] and [r["receiver"] for r in st["receivers"]] == ["slow"] and st["gc"] > 0
    deleted = commit.gc(store)
    left = commit.list_versions(store)
    assert left == [2, 3]  # 1 is held by "slow" (it needs 2 and 3); 4 was aborted
    assert commit.keyframes(store) == [3] and any("keyframe/0000000000" in k for k in deleted)
    tensors = {k: t.clone() for k, t in states[1].items()}
    Follower(store, tensors, version=1).poll()  # the slow receiver still catches up
    assert _same(tensors, states[3])


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_training_abort_restores_baselines_then_commits(seaweed, tmp_path, worker):
    """torchrun, 2 ranks (TP 2), the Publisher on S3 with the abort policy: a registered
    receiver that never acks makes version 1 abort, and every rank's baselines are back at
    version 0 bit for bit; then a live receiver acks versions 2 and 3, which commit (2 on
    base 0), and it ends bit-exact with the dense export. With the worker as a process (the
    default: deltas through shared memory) and as a thread (the deltas handed over as they are)."""
    from nemo_dcr_callback.launcher import torchrun_cmd

    env = {**os.environ, **seaweed.env()}
    url = seaweed.url(f"{seaweed.bucket}/training-abort-{worker}")
    cmd = torchrun_cmd(2, [str(ROOT / "tests" / "s3_publish_worker.py"), url, worker])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "baselines restored bit-exact on 2 ranks" in out, out[-3000:]
    assert "receiver bit-exact with the dense export at version 3" in out, out[-3000:]
    store = seaweed.store(f"training-abort-{worker}")
    assert commit.read_decision(store, 1)["decision"] == "abort"
    assert commit.read_decision(store, 2)["decision"] == "commit" and commit.read_record(store, 2)["base"] == 0
    assert commit.read_decision(store, 3)["acked"] == ["rollout-0"]


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


def test_fast_path_does_puts_and_listings_without_boto3(seaweed, store, monkeypatch):
    """Puts, conditional puts and listings succeed as plain signed requests (boto3's calls
    are made to fail here, so a silent fallback would show) and read back the same through
    boto3 (a store with fast=False) on the same server; listings follow continuation tokens."""
    assert store.fast is not None
    plain = S3Store(store.url, access_key=seaweed.access_key, secret_key=seaweed.secret_key, fast=False)

    def no_boto(*a, **k):
        raise AssertionError("went through boto3")

    monkeypatch.setattr(store.client, "put_object", no_boto)
    monkeypatch.setattr(store.client, "get_paginator", no_boto)
    names = [f"v/{i:03d}/k{j}" for i in range(5) for j in range(3)] + ["v/top", "w/x y+z=~"]
    for n in names:
        store.put(n, n.encode() * 100)
    assert store.put_if_absent("v/rec", b"first") and not store.put_if_absent("v/rec", b"second")
    assert plain.get("v/rec") == b"first" and all(plain.get(n) == n.encode() * 100 for n in names)
    assert store.list("v") == plain.list("v") == sorted([*names[:-1], "v/rec"])
    assert store.children("v") == plain.children("v") == ["000", "001", "002", "003", "004", "rec", "top"]
    assert store.children("") == plain.children("") == ["v", "w"]
    keys, token = [], None
    while True:  # pages of 4: the continuation tokens are followed to the same listing
        page = store.fast.list_page(store.bucket, store._key("v") + "/", token=token, max_keys=4)
        assert page is not None and len(page.keys) <= 4
        keys += page.keys
        if page.next_token is None:
            break
        token = page.next_token
    assert [k[len(store.prefix) + 1:] for k in keys] == plain.list("v")


def test_fast_put_whose_body_does_not_match_its_signature_is_refused(store):
    """The payload hash and CRC32 are signed: a body changed after signing is refused by the
    server and nothing is stored."""
    import base64
    import hashlib
    import http.client
    import zlib

    body = b"the payload that was signed"
    f = store.fast
    crc = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
    h = f.signed_headers("PUT", f"/{store.bucket}/{store._key('tampered')}", {},
                         {"x-amz-checksum-crc32": crc}, hashlib.sha256(body).hexdigest())
    c = http.client.HTTPConnection(f.host, f.port, timeout=10)
    c.request("PUT", f"/{store.bucket}/{store._key('tampered')}", body=b"the payload that was changed",
              headers={**h, "content-length": "28"})
    r = c.getresponse()
    assert r.status in (400, 403), r.status
    assert not store.exists("tampered")


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


def test_fast_path_steps_aside_where_it_fails_and_boto3_does_not(seaweed, store, monkeypatch, capsys):
    """A plain request that gets no answer (here: the plain client pointed at a closed port)
    while boto3 then succeeds: boto3 alone for FAST_BACKOFF_S. One refused with a client
    error (here: signed with a wrong secret) while boto3 succeeds: this endpoint does not take
    our requests, boto3 alone from then on, said once. Every call succeeds either way."""
    import socket

    calls = []
    real = store.fast.request
    monkeypatch.setattr(store.fast, "request", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    port = store.fast.port
    store.fast.port = closed
    store.put("a", b"1")
    assert calls == ["PUT"] and store._fast_off_until > 0
    store.put("b", b"2")
    assert store.list("") == ["a", "b"] and calls == ["PUT"]  # boto3 alone meanwhile
    store.fast.port, store._fast_off_until = port, 0.0
    monkeypatch.setattr(store.fast, "credentials", lambda: (seaweed.access_key, "wrong-secret", None))
    store.put("c", b"3")
    assert calls == ["PUT", "PUT"] and store.fast is None and store.get("c") == b"3"
    assert "using boto3 only" in capsys.readouterr().err
