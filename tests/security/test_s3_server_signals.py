"""Issue 38, finding 9: `nemo-dcr s3-server` stops SeaweedFS when it is stopped by SIGTERM
(systemd, docker, timeout) or SIGHUP, instead of orphaning it with its ports and data."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = str(Path(sys.executable).parent / "nemo-dcr")


def weed_pids(data_dir: Path) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(b"weed" in c for c in cmd[:1]) and any(str(data_dir).encode() in c for c in cmd):
                out.append(int(d.name))
    return out


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_stop_signal_stops_seaweedfs(tmp_path, sig):
    data = tmp_path / "s3data"
    p = subprocess.Popen([CLI, "s3-server", "--dir", data], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = p.stdout.readline()  # "S3 (SeaweedFS) at http://127.0.0.1:PORT, ..."
        assert "S3 (SeaweedFS) at http://127.0.0.1:" in line, line + p.stdout.read()
        port = int(line.split("http://127.0.0.1:")[1].split(",")[0])
        assert port_open(port) and weed_pids(data)
        p.send_signal(sig)
        assert p.wait(30) == 0
        rest = p.stdout.read()
        assert f"{sig.name}: stopping SeaweedFS" in rest
        deadline = time.monotonic() + 15
        while (weed_pids(data) or port_open(port)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not weed_pids(data), "weed outlived s3-server"
        assert not port_open(port)
    finally:
        for pid in weed_pids(data):
            os.kill(pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
