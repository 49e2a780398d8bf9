#!/usr/bin/env python
"""The sender's cost of context coding, timed alone (issue 48): one version of the synthetic
policy (recipes/synthetic.py, AdamW-like, at the given change rate) streamed by TensorSender into
a file:// store in /dev/shm, plain (`context=off`) and context-coded (`on`), `--reps` passes over
the same version each (rolled back between), alternating, in one process; medians.
Single-threaded by default (ENCODE_THREADS=1): what one core does. docs/PERFORMANCE.md
"2026-12-06 (afternoon)" has the figures.
  .venv/bin/python scripts/experiments/sender_context_cost.py --params 1.34e8 --rate 0.01 --rate 0.03
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

from nemo_dcr_callback.recipes import synthetic
from nemo_dcr_callback.testing.tensor_sender import TensorSender
from nemo_dcr_callback.transport.store import FileStore


def measure(params: int, rate: float, reps: int, threads: int) -> dict:
    policy = synthetic.make_policy(params, seed=0)
    senders = {m: TensorSender(policy.bf16(), context=m, encode_threads=threads) for m in ("off", "on")}
    policy.step(policy.lr_for_rate(rate))
    cur = policy.bf16()
    times: dict[str, list[float]] = {"off": [], "on": []}
    sizes = {}
    for _ in range(reps):
        for m, s in senders.items():
            s.tensors = cur
            d = tempfile.mkdtemp(dir="/dev/shm")
            t0 = time.perf_counter()
            _, man = s.stream(FileStore(d), 1, 0)
            times[m].append(time.perf_counter() - t0)
            sizes[m] = man["bytes"]
            s.roll_back()
            shutil.rmtree(d)
    return {"params": policy.numel, "rate": rate, "plain_s": statistics.median(times["off"]),
            "context_s": statistics.median(times["on"]), "plain_bytes": sizes["off"], "context_bytes": sizes["on"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1.34e8)
    ap.add_argument("--rate", type=float, action="append")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="TensorSender encode_threads")
    a = ap.parse_args()
    print(f"{'rate':>5} {'plain s':>8} {'context s':>9} {'+ s':>7}  bytes plain / context")
    for rate in a.rate or [0.01, 0.03]:
        r = measure(int(a.params), rate, a.reps, a.threads)
        print(f"{100 * rate:4.0f}% {r['plain_s']:8.3f} {r['context_s']:9.3f} {r['context_s'] - r['plain_s']:+7.3f}  "
              f"{r['plain_bytes']} / {r['context_bytes']}", flush=True)


if __name__ == "__main__":
    main()
