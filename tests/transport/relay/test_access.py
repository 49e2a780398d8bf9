"""Who may use a relay and what it records: tokens (refused without one, at start and per
request), TLS with a certificate the client trusts, picking the nearest relay that answers,
and the access log (requests served and calls to the parent, never the token)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import urllib3

from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.transport.relay_store import FailoverStore, RelayStore
from nemo_dcr_callback.transport.store import FileStore
from nemo_dcr_callback.transport.topology import Topology
from tests.helpers.relay import (
    TOKEN,
)

# objects of the protocol (a relay serves nothing else)
KF1, KF2, KF9 = (f"keyframe/{v:010d}/model.safetensors" for v in (1, 2, 9))


def test_unauthenticated_peer_refused(tmp_path, relays):
    origin = FileStore(tmp_path / "origin")
    origin.put(KF1, b"secret weights")
    root = relays(origin.url, "root")
    assert RelayStore(root.url, token=TOKEN).get(KF1) == b"secret weights"
    with pytest.raises(StoreError, match="refused the token.*no token"):
        RelayStore(root.url, token="").get(KF1)
    with pytest.raises(StoreError, match="refused the token.*wrong token"):
        RelayStore(root.url, token="guess").get(KF1)
    with pytest.raises(StoreError, match="refused the token"):
        RelayStore(root.url, token="guess").put(KF2, b"evil")
    assert not origin.exists(KF2)
    host = root.url.split("//")[1]
    assert urllib3.request("GET", f"http://{host}/o/a/x").status == 401
    assert urllib3.request("GET", f"http://{host}/health").status == 200
    assert root.stats()["unauthorized"] == 4


def test_relay_needs_a_token_and_unreachable_relay_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("NEMO_DCR_RELAY_TOKEN")
    r = subprocess.run([sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no relay token: set NEMO_DCR_RELAY_TOKEN" in r.stderr
    with pytest.raises(StoreError, match="relay at relay://127.0.0.1:9 unreachable"):
        RelayStore("relay://127.0.0.1:9", token=TOKEN).get("k")
    chain = FailoverStore([RelayStore("relay://127.0.0.1:9", token=TOKEN), FileStore(tmp_path)], quiet=True)
    FileStore(tmp_path).put("k", b"v")
    assert chain.get("k") == b"v" and chain.failovers == 1


def test_tls_and_nearest_relay(tmp_path, relays):
    """TLS is optional: a relay with a certificate serves relays:// clients that trust it; and
    --attach auto picks a relay that answers."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    key, crt = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    origin = FileStore(tmp_path / "origin")
    origin.put(KF1, b"over tls")
    r = relays(origin.url, "tls", extra=("--tls-cert", str(crt), "--tls-key", str(key)))
    assert r.url.startswith("relays://")
    assert RelayStore(f"{r.url}?ca={crt}", token=TOKEN).get(KF1) == b"over tls"
    with pytest.raises(StoreError, match="unreachable"):  # an untrusted certificate is refused
        RelayStore(r.url, token=TOKEN).get(KF1)
    plain = relays(origin.url, "plain")
    topo = Topology.from_dict({"origin": origin.url, "relays": {
        "dead": {"url": "relay://127.0.0.1:9"}, "plain": {"url": plain.url}}})
    assert topo.nearest() == "plain"


def test_the_access_log_traces_requests_and_calls_to_the_parent(tmp_path, relays):
    """`--access-log FILE`: one JSON line per request served (status, bytes, time) and per call
    to the parent (what was asked, and whether it was there), so a refusal can be traced to
    its cause; the token never appears in it. A log that cannot be opened is a clear error."""

    origin = FileStore(tmp_path / "origin")
    origin.put(KF1, b"weights")
    log = tmp_path / "access.jsonl"
    root = relays(origin.url, "root", extra=("--access-log", str(log), "--no-prefetch"))
    rs = RelayStore(root.url, token=TOKEN)
    assert rs.get(KF1) == b"weights"
    with pytest.raises(KeyError):
        rs.get(KF9)
    with pytest.raises(StoreError, match="refused the token"):
        RelayStore(root.url, token="guess").get(KF1)
    rs.wait(0, 0.01)
    text = log.read_text()  # (each line is written before its response is sent)
    assert TOKEN not in text and "guess" not in text
    lines = [json.loads(ln) for ln in text.splitlines()]
    assert all(ln["relay"] == "root" and ln["t"] > 0 and ln["ms"] >= 0 for ln in lines)
    served = [(ln["method"], ln["path"].split("&")[0], ln["status"]) for ln in lines if "method" in ln]
    assert served == [("GET", "/o/" + KF1, 200), ("GET", "/o/" + KF9, 404), ("GET", "/o/" + KF1, 401),
                      ("GET", "/wait?gen=0", 200)]
    assert next(ln for ln in lines if ln.get("path") == "/o/" + KF1)["bytes"] == len(b"weights")
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", ln["peer"]) for ln in lines if "method" in ln)  # host:port
    up = [(ln["up"], ln["arg"], ln["result"], ln.get("n")) for ln in lines if "up" in ln]
    assert up == [("get", KF1, "ok", len(b"weights")), ("get", KF9, "missing", None)]

    bad = subprocess.run([sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent", origin.url,
                          "--no-token", "--access-log", str(tmp_path / "no" / "such" / "dir" / "log")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "access log" in bad.stderr and "No such file" in bad.stderr
