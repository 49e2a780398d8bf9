"""Issue 38, findings 2, 5 and 10 at the relay: a slow-headers flood, a body that never ends,
bad query values. A real `nemo-dcr relay` process on loopback; the flood comes from another
loopback address (127.0.0.2) so the per-peer limit can be told from the total one. Every loop
here is bounded in count and time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

TOKEN = "limits-token-5e6f"


@pytest.fixture()
def relay(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NEMO_DCR_RELAY")}, "NEMO_DCR_RELAY_TOKEN": TOKEN}
    p = subprocess.Popen([sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent", f"file://{tmp_path}",
                          "--header-timeout-s", "2", "--body-timeout-s", "2", "--max-connections-per-peer", "64"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    line = p.stdout.readline()
    assert "listening on" in line, line + p.stdout.read()
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(p.stdout), daemon=True).start()
    host, port = line.split("listening on relay://")[1].split()[0].split(":")
    yield host, int(port), out
    p.kill()
    p.wait()


def get(host: str, port: int, path: str, token: str | None = TOKEN) -> tuple[int, bytes, float]:
    req = urllib.request.Request(f"http://{host}:{port}{path}",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read(), time.monotonic() - t0


def slow_headers(port: int, n: int, source: str = "127.0.0.2") -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket, wait: float) -> bool:
    s.settimeout(wait)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_slow_headers_flood_leaves_the_relay_serving(relay):
    host, port, out = relay
    socks = slow_headers(port, 600)
    try:
        code, _, dt = get(host, port, "/health", token=None)
        assert code == 200 and dt < 2.0, dt  # other peers are served during the flood
        refused = sum(closed_by_server(s, 0.05) for s in socks)
        assert refused >= 600 - 64  # beyond the per-peer limit, closed at once
        held = [s for s in socks if not closed_by_server(s, 0.0)]
        time.sleep(2.5)  # the header timeout
        assert all(closed_by_server(s, 1.0) for s in held)
        code, body, _ = get(host, port, "/stats")
        assert code == 200 and json.loads(body)["refused_connections"] >= 600 - 64
    finally:
        for s in socks:
            s.close()
    assert not any("Too many open files" in line for line in out)


def test_a_body_shorter_than_its_content_length_is_refused_in_time(relay):
    host, port, _ = relay
    s = socket.create_connection((host, port))
    s.sendall(b"PUT /o/versions/0000000001/VERSION.json HTTP/1.1\r\nHost: x\r\n"
              + f"Authorization: Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n".encode() + b"0123456789")
    s.settimeout(10)
    t0 = time.monotonic()
    head = s.recv(4096)
    s.close()
    assert head.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 6, head[:200]


@pytest.mark.parametrize("query", ["gen=abc", "timeout=soon", "gen=1&timeout=nan"])
def test_bad_query_values_get_400(relay, query):
    host, port, _ = relay
    code, body, _ = get(host, port, f"/wait?{query}")
    assert code == 400 and b"Traceback" not in body, (code, body)


def test_an_oversized_receiver_record_is_refused(relay):
    host, port, _ = relay
    req = urllib.request.Request(f"http://{host}:{port}/o/receivers/r1.json", data=b" " * (65 << 10), method="PUT",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 413
