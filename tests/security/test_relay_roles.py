"""Issue 38, finding 3 (and 4, 10 at the relay): tokens per role, committed history immutable,
receivers' records checked. Real `nemo-dcr relay` processes over a file:// origin on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.relay_process import PUB, RECV, request, start_relay

DECISION = "versions/0000000001/DECISION.json"


@pytest.fixture()
def relay(tmp_path):
    origin = tmp_path / "origin"
    store = FileStore(origin)
    commit.decide(store, 1, 0, "commit", ["r0"], [], "all acked")
    p, url = start_relay(origin, {"NEMO_DCR_RELAY_TOKEN": PUB, "NEMO_DCR_RELAY_RECEIVER_TOKEN": RECV})
    assert p.poll() is None, url
    yield store, url
    p.kill()
    p.wait()


def test_a_receiver_token_cannot_rewrite_history(relay):
    store, url = relay
    before = store.get(DECISION)
    flipped = json.dumps({**json.loads(before), "decision": "abort"}).encode()
    for key in (DECISION, "versions/0000000001/VERSION.json", "keyframe/0000000000/model.safetensors"):
        code, body = request(url, "PUT", key, RECV, flipped)
        assert code == 403 and b"registrations and acks" in body, (key, code, body)
    assert store.get(DECISION) == before
    code, body = request(url, "GET", DECISION, RECV)  # reading is allowed
    assert code == 200 and body == before


def test_committed_objects_are_create_only_even_for_the_publisher(relay):
    store, url = relay
    before = store.get(DECISION)
    flipped = json.dumps({**json.loads(before), "decision": "abort"}).encode()
    code, body = request(url, "PUT", DECISION, PUB, flipped)
    assert code == 409 and b"immutable" in body
    assert store.get(DECISION) == before
    assert request(url, "PUT", DECISION, PUB, before)[0] == 200  # a retry of the same bytes stands


@pytest.mark.parametrize("key,body", [
    ("receivers/evil.json", b"garbage"),
    ("receivers/evil.json", b"{}"),
    ("receivers/evil.json", b'{"receiver":"evil","version":1,"time":"soon"}'),
    ("receivers/evil.json", b'{"receiver":"someone-else","version":1,"time":1.0}'),
    ("versions/0000000001/acks/r1.json", b'{"version":2,"receiver":"r1","base":0,"ok":true,"time":1.0}'),
])
def test_malformed_receiver_records_are_refused(relay, key, body):
    store, url = relay
    code, resp = request(url, "PUT", key, RECV, body)
    assert code == 400 and b"refused" in resp, (code, resp)
    assert not store.exists(key)


def test_receivers_write_their_own_records(relay):
    store, url = relay
    reg = json.dumps({"receiver": "r1", "version": 1, "time": 1.0}).encode()
    assert request(url, "PUT", "receivers/r1.json", RECV, reg)[0] == 200
    ack = json.dumps({"version": 1, "receiver": "r1", "base": 0, "ok": True, "error": None, "time": 1.0}).encode()
    assert request(url, "PUT", "versions/0000000001/acks/r1.json", RECV, ack)[0] == 200
    assert store.get("receivers/r1.json") == reg
    assert request(url, "GET", DECISION, "wrong-token")[0] == 401


@pytest.mark.parametrize("env,args,says", [
    ({"NEMO_DCR_RELAY_TOKEN": ""}, (), "NEMO_DCR_RELAY_TOKEN is empty"),
    ({}, ("--no-token", "--listen", "0.0.0.0:0"), "loopback trials only"),
    ({"NEMO_DCR_RELAY_TOKEN": PUB, "NEMO_DCR_RELAY_RECEIVER_TOKEN": PUB}, (), "a token of its own"),
])
def test_relay_refuses_to_start_without_a_real_token(tmp_path, env, args, says):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_DCR_RELAY")}
    p = subprocess.run([sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent", f"file://{tmp_path}",
                        *args], capture_output=True, text=True, env={**clean, **env}, timeout=60)
    assert p.returncode == 2 and says in p.stderr, p.stdout + p.stderr
