"""A relay under a slow-headers flood (issue 38, finding 2): N connections from 127.0.0.2 that
send a request line and never finish their headers, then /health timed from 127.0.0.1.
Loopback only; the flood is bounded in count and time. Prints a table, writes JSON.

    python -m nemo_dcr_callback.bench.flood --connections 20000 --json benchmarks/results/flood.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from nemo_dcr_callback.bench.results import machine, write_json


def health_ms(port: int, n: int = 5) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                r.read()
            out.append(1e3 * (time.monotonic() - t0))
        except OSError:
            out.append(float("inf"))
    return out


def _closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=20000)
    ap.add_argument("--relay-nofile", type=int, default=4096,
                    help="the relay's file-descriptor limit (the flood must be able to exceed it)")
    ap.add_argument("--seconds", type=float, default=60.0, help="stop opening connections after this")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "NEMO_DCR_RELAY_TOKEN": "flood-bench-token"}
        p = subprocess.Popen([sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent", f"file://{d}"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (a.relay_nofile,) * 2))
        line = p.stdout.readline()
        port = int(line.split("listening on relay://")[1].split()[0].split(":")[1])
        log: list[str] = []
        threading.Thread(target=lambda: log.extend(p.stdout), daemon=True).start()
        before = health_ms(port)
        socks, t0, failed, opened, swept, along = [], time.monotonic(), 0, 0, 0, []
        try:
            while opened + failed < a.connections and time.monotonic() - t0 < a.seconds:
                s = socket.socket()
                s.settimeout(2.0)  # (a relay that stopped accepting leaves connects hanging)
                try:
                    s.bind(("127.0.0.2", 0))
                    s.connect(("127.0.0.1", port))
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                    socks.append(s)
                    opened += 1
                except OSError:
                    s.close()
                    failed += 1
                if (opened + failed) % 1000 == 0:
                    # an attacker keeps what the relay holds and drops what it closed (this
                    # process's own descriptors bound the flood otherwise)
                    keep = []
                    for c in socks:
                        if _closed(c):
                            c.close()
                            swept += 1
                        else:
                            keep.append(c)
                    socks = keep
                if (opened + failed) % 5000 == 0:
                    along.append(health_ms(port, 1)[0])
            during = health_ms(port)
            try:
                with urllib.request.urlopen(urllib.request.Request(
                        f"http://127.0.0.1:{port}/stats", headers={"Authorization": "Bearer flood-bench-token"}),
                        timeout=10) as r:
                    refused = json.loads(r.read()).get("refused_connections", 0)  # (0: a relay without the limit)
            except OSError:
                refused = None  # the relay no longer answers
        finally:
            for s in socks:
                s.close()
            rss_kb = int(next(ln.split()[1] for ln in open(f"/proc/{p.pid}/status") if ln.startswith("VmHWM")))
            p.kill()
            p.wait()

    def ms(xs: list[float]) -> list[float | None]:
        return [None if x == float("inf") else x for x in xs]  # None: no answer within 10 s

    res = {"connections_opened": opened, "held_by_the_flood_at_end": len(socks),
           "closed_by_relay_and_dropped": swept, "health_ms_along": ms(along), "relay_nofile": a.relay_nofile,
           "connect_failures": failed,
           "refused_by_relay": refused, "health_ms_before": ms(before), "health_ms_during": ms(during),
           "health_ms_during_median": ms([statistics.median(during)])[0], "relay_peak_rss_mb": rss_kb / 1024,
           "too_many_open_files_lines": sum("Too many open files" in ln for ln in log), "machine": machine()}
    print(f"{'connections':>11} {'refused':>8} {'health before':>14} {'health during':>14} {'relay RSS':>10}")
    print(f"{opened:>11} {str(refused):>8} {statistics.median(before):11.1f} ms "
          f"{statistics.median(during):11.1f} ms {res['relay_peak_rss_mb']:7.0f} MB")
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
