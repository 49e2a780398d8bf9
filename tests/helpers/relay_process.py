"""A real `nemo-dcr relay` process over a file:// origin on loopback, with a token per role,
and raw HTTP requests to it (the security tests: what the relay refuses, and with which status)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

PUB, RECV = "publisher-token-1b2c", "receiver-token-9d8e"


def start_relay(origin, env_extra: dict, *args: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, **env_extra}
    p = subprocess.Popen([sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent", f"file://{origin}",
                          *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    line = p.stdout.readline()
    if "listening on" not in line:
        p.wait(30)
        return p, line + p.stdout.read()
    threading.Thread(target=p.stdout.read, daemon=True).start()
    return p, line.split("listening on ")[1].split()[0].replace("relay://", "http://")


def request(base: str, method: str, key: str, token: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"{base}/o/{key}", data=body, method=method,
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
