"""`nemo-dcr bench refit --bound`: what the refit's targets ask of the bytes alone.

bench refit's targets are speed-ups over the dense checkpoint's transport time over the same
link. With no time at either end, a speed-up S needs each version in at most dense / S bytes:
a compression ratio of S. This takes versions like the refit benchmark's (the same synthetic
policy and seed, one AdamW-like step per change rate) and sets that ratio beside the plain
codec's, the context codec's (coded from the sender's current bits, as the refit's sender
does) and the information bound of the context codec's model: positions and ulp values given
the old exponent, with one set of statistics shared by every tensor and tables free
(codec_real.bounds, the conditional-entropy figure). A target above the bound needs a richer
model than the exponent, whatever the transport and the kernels do.

No link, no root, no timing: the machine's speed does not enter. Writes
benchmarks/results/refit_bound.json with --json.
"""

from __future__ import annotations

import time

import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.bench.codec_real import bounds
from nemo_dcr_callback.bench.refit import RATES, TARGETS
from nemo_dcr_callback.bench.results import machine, write_json
from nemo_dcr_callback.core.delta import take_delta
from nemo_dcr_callback.recipes import synthetic


def version_row(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], rate: float) -> dict:
    """One version's bytes: plain, context-coded, the bound; and the ratios beside the target."""
    dense = sum(t.numel() * t.element_size() for t in cur.values())
    plain = ctx = changed = 0
    for name, t in cur.items():
        d = take_delta(t, prev[name].clone(), keep_new=True)
        changed += d.count
        if d.count:
            plain += sum(len(c) for c in codec.encode_delta(name, d))
            ctx += sum(len(c) for c in codec.encode_delta(name, d, current=t))
    b = bounds(prev, cur)
    target = TARGETS.get(rate)
    return {
        "target_rate": rate, "change_rate": changed / sum(t.numel() for t in cur.values()), "dense_bytes": dense,
        "plain_bytes": plain, "context_bytes": ctx, "bound_bytes": b["conditional"], "xor_bound_bytes": b["xor_bound"],
        "plain_ratio": dense / plain, "context_ratio": dense / ctx, "bound_ratio": dense / b["conditional"],
        "context_vs_bound": ctx / b["conditional"], "target_speedup": target,
        "allowed_bytes": dense / target if target else None,  # at the target with no time at either end
    }


def format_table(rows: list[dict]) -> str:
    out = ["compression ratio vs dense BF16 that each target needs with no time at either end, beside the codecs'"
           " and the context model's information bound",
           f"{'rate':>6} {'target':>7} {'allowed':>9} {'plain':>7} {'context':>8} {'bound':>7} "
           f"{'ctx MB':>7} {'bound MB':>8} {'ctx/bound':>9}"]
    for r in rows:
        t = r["target_speedup"]
        target, allowed = (f"{t}x", f"{r['allowed_bytes'] / 1e6:.2f}MB") if t else ("-", "-")
        out.append(f"{r['change_rate']:6.2%} {target:>7} {allowed:>9} {r['plain_ratio']:6.1f}x "
                   f"{r['context_ratio']:7.1f}x {r['bound_ratio']:6.1f}x {r['context_bytes'] / 1e6:7.2f} "
                   f"{r['bound_bytes'] / 1e6:8.2f} {r['context_vs_bound']:9.3f}")
    return "\n".join(out)


def run(params: int = 1 << 29, rates=RATES, seed: int = 0, json_path: str | None = None,
        quiet: bool = False) -> dict:
    t0 = time.time()
    if not quiet:
        print(f"nemo-dcr bench refit --bound: building a {params / 1e6:.0f}M-param synthetic policy ...", flush=True)
    policy = synthetic.make_policy(params, seed=seed)
    cur = policy.bf16()
    rows = []
    for rate in rates:
        lr = policy.lr_for_rate(rate)
        prev = cur
        policy.step(lr)
        cur = policy.bf16()
        rows.append(version_row(prev, cur, rate))
        if not quiet:
            r = rows[-1]
            print(f"  {rate:.0%}: plain {r['plain_bytes'] / 1e6:.2f} MB, context {r['context_bytes'] / 1e6:.2f} MB, "
                  f"bound {r['bound_bytes'] / 1e6:.2f} MB", flush=True)
    out = {"benchmark": "refit_bound", "params": policy.numel, "seed": seed, "rows": rows, "machine": machine(),
           "wall_s": time.time() - t0}
    print(format_table(rows))
    if json_path:
        write_json(json_path, out)
    return out
