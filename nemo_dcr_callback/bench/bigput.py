"""A relay's memory under one large PUT (issue 38, finding 5): a `nemo-dcr relay` process over
a file:// origin takes an N MB keyframe model in one PUT; its resident set is read before and
at its peak (VmHWM). Loopback only. Prints a table, writes JSON.

    python -m nemo_dcr_callback.bench.bigput --mb 900 --json benchmarks/results/bigput.json
"""

from __future__ import annotations

import argparse
import http.client
import os
import subprocess
import sys
import tempfile
import time

from nemo_dcr_callback.bench.results import machine, write_json

TOKEN = "bigput-bench-token"


def rss_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field)) / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=900)
    ap.add_argument("--key", default="keyframe/0000000001/model.safetensors")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    block = os.urandom(1 << 20)
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "NEMO_DCR_RELAY_TOKEN": TOKEN}
        p = subprocess.Popen([sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent", f"file://{d}"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            line = p.stdout.readline()
            port = int(line.split("listening on relay://")[1].split()[0].split(":")[1])
            time.sleep(0.5)
            before = rss_mb(p.pid, "VmRSS")
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            c.putrequest("PUT", f"/o/{a.key}")
            c.putheader("Authorization", f"Bearer {TOKEN}")
            c.putheader("Content-Length", str(a.mb << 20))
            c.endheaders()
            t0 = time.monotonic()
            for _ in range(a.mb):
                c.send(block)
            r = c.getresponse()
            body = r.read()
            put_s = time.monotonic() - t0
            peak, after = rss_mb(p.pid, "VmHWM"), rss_mb(p.pid, "VmRSS")
            stored = os.path.getsize(os.path.join(d, a.key)) if r.status == 200 else 0
        finally:
            p.kill()
            p.wait()
    res = {"mb": a.mb, "key": a.key, "status": r.status, "answer": body.decode(errors="replace")[:300],
           "stored_bytes": stored, "rss_before_mb": before, "rss_peak_mb": peak, "rss_after_mb": after,
           "peak_over_before_mb": peak - before, "peak_over_body": (peak - before) / a.mb, "put_s": put_s,
           "machine": machine()}
    print(f"{'body':>8} {'status':>6} {'RSS before':>11} {'RSS peak':>9} {'peak-before':>12} {'/body':>6} {'PUT':>7}")
    print(f"{a.mb:5d} MB {r.status:>6} {before:8.0f} MB {peak:6.0f} MB {peak - before:9.0f} MB "
          f"{(peak - before) / a.mb:6.2f} {put_s:5.1f} s")
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
