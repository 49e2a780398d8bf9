"""Issue 46, finding 8: receivers' slow uploads stalled the publisher at a relay. Request bodies
took one of 4 upload slots while they came in, whoever sent them: four ack PUTs whose bodies
never came (a receivers'-token holder) held every slot until the body timeout, 120 s by
default, and the publisher's parts and records waited behind them. Now receivers' records have
slots of their own, a short body timeout, and one address takes a few of them at most."""

from __future__ import annotations

import json
import socket
import time

from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.relay_process import PUB, RECV, request, start_relay


def _stalled_put(host: str, port: int, key: str, token: str) -> socket.socket:
    """A PUT whose headers announce a body that never comes."""
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(f"PUT /o/{key} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
              f"Content-Length: 200\r\nContent-Type: application/octet-stream\r\n\r\n".encode())
    return s


def test_slow_receiver_uploads_do_not_hold_the_publisher_up(tmp_path):
    origin = tmp_path / "origin"
    FileStore(origin)
    p, url = start_relay(origin, {"NEMO_DCR_RELAY_TOKEN": PUB, "NEMO_DCR_RELAY_RECEIVER_TOKEN": RECV},
                         "--body-timeout-s", "30")
    held: list[socket.socket] = []
    try:
        assert p.poll() is None, url
        host, port = url.removeprefix("http://").rsplit(":", 1)
        for i in range(6):  # more than the publisher's 4 slots
            held.append(_stalled_put(host, int(port), f"versions/0000000001/acks/rx{i}.json", RECV))
        time.sleep(1.0)  # the relay has them all reading
        decision = json.dumps({"version": 1, "base": 0, "decision": "commit", "acked": [], "lagging": [],
                               "reason": "test", "time": 1.0}).encode()
        t0 = time.monotonic()
        status, body = request(url, "PUT", commit.decision_key(1), PUB, decision)
        took = time.monotonic() - t0
        assert status in (200, 201), body[:300]
        assert took < 5.0, f"the publisher's write waited {took:.1f} s behind receivers' stalled uploads"
        # one address holds at most 16 record uploads: the 17th is refused at once
        held += [_stalled_put(host, int(port), f"versions/0000000001/acks/ry{i}.json", RECV) for i in range(10)]
        time.sleep(1.0)
        status, _ = request(url, "PUT", "versions/0000000001/acks/late.json", RECV, b"{}")
        assert status == 429
    finally:
        for s in held:
            s.close()
        p.kill()
        p.wait()
    assert (origin / "versions" / "0000000001" / "DECISION.json").read_bytes() == decision
