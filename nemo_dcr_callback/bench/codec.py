"""`nemo-dcr bench codec`: this codec beside the simple schemes and the information bound.

One synthetic policy (FP32 masters, Adam-like step bisected to each change rate, cast to
BF16), every scheme measured on the same deltas in the same run, single-threaded (rates
are per core). Every round trip is checked bit for bit against the new BF16 weights.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch
import zstandard

from nemo_dcr_callback import codec
from nemo_dcr_callback.bench.results import machine, write_json
from nemo_dcr_callback.codec import Layout, ValueMode
from nemo_dcr_callback.core.delta import take_delta
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.recipes import synthetic


def _median_time(fn, reps: int, setup=None) -> float:
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_rate(policy: synthetic.SyntheticPolicy, rate: float, reps: int) -> dict:
    lr = policy.lr_for_rate(rate)
    old = policy.bf16()
    new = {k: (w - lr * policy.direction[k]).to(torch.bfloat16) for k, w in policy.master.items()}
    names = list(old)
    n_params = sum(t.numel() for t in old.values())
    dense = 2 * n_params
    zc = zstandard.ZstdCompressor(level=1)

    # The delta (kernel) and the sizes of every scheme.
    deltas, sizes = {}, {"codec": 0, "codec_xor_only": 0, "simple": 0, "dense_zstd": 0, "bitmap": 0}
    bound_x = bound_u = 0.0
    changed = payload = 0
    for k in names:
        base = old[k].clone()
        d = take_delta(new[k], base, threads=1, keep_new=True)
        deltas[k] = d
        changed += d.count
        b = codec.delta_bound_bits(d)
        bound_x += b["positions"] + b["xor"]
        bound_u += b["positions"] + b["ulp"]
        enc = codec.encode_delta(k, d)
        sizes["codec"] += sum(map(len, enc))
        payload += sum(len(c) - codec.parse_header(c).payload_offset - codec.format.SUM_BYTES for c in enc)
        sizes["codec_xor_only"] += sum(map(len, codec.encode_delta(k, d, value_modes=(ValueMode.RAW,))))
        sizes["simple"] += sum(len(codec.encode_chunk(k, codec.Kind.XOR, d.dtype, d.numel, lo, hi,
                                                      d.positions[s:e], d.xor[s:e],
                                                      value_modes=(ValueMode.RAW,), layouts=(Layout.PLANES,)))
                               for lo, hi, s, e in codec.split_ranges(d.positions, d.numel) if e > s)
        x = bits(old[k]) ^ bits(new[k])
        sizes["dense_zstd"] += len(zc.compress(x.numpy().tobytes()))
        mask = np.packbits((x != 0).numpy())
        sizes["bitmap"] += len(zc.compress(mask.tobytes())) + len(zc.compress(
            np.ascontiguousarray(d.xor.numpy().view(np.uint8).reshape(-1, 2).T).tobytes()))

    # Timings, per core, medians over reps of a whole-model pass.
    bases = {k: old[k].clone() for k in names}

    def reset():
        for k in names:
            bases[k].copy_(old[k])

    t_kernel = _median_time(lambda: [take_delta(new[k], bases[k], threads=1, keep_new=True) for k in names],
                            reps, reset)
    chunks = {}
    t_encode = _median_time(lambda: chunks.update({k: codec.encode_delta(k, deltas[k]) for k in names}), reps)
    decoded = {}
    t_decode = _median_time(lambda: decoded.update(
        {k: [codec.decode_chunk(c) for c in chunks[k]] for k in names}), reps)
    targets = {k: old[k].clone() for k in names}

    def reset_targets():
        for k in names:
            targets[k].copy_(old[k])

    # Side by side: a dense single-core copy of the same bytes (this machine's memcpy).
    dst = {k: torch.empty_like(old[k]) for k in names}
    [dst[k].copy_(new[k]) for k in names]  # untimed: faults in dst's pages (a receiver's target is warm)
    t_copy = _median_time(lambda: [dst[k].copy_(new[k]) for k in names], reps)
    t_apply = _median_time(lambda: [codec.apply_decoded(dc, targets[k]) for k in names for dc in decoded[k]],
                           reps, reset_targets)
    for k in names:  # the oracle: the new BF16 weights themselves
        if not torch.equal(bits(targets[k]), bits(new[k])):
            raise AssertionError(f"round trip is not bit-exact for {k}")
    ctx = _context_rates(names, deltas, old, new, targets, reset_targets, reps)

    return {
        "target_rate": rate, "change_rate": changed / n_params, "params": n_params, "changed": changed,
        "lr": lr, "dense_bytes": dense,
        "bytes": sizes, "ratio": {s: dense / b for s, b in sizes.items()},
        "bound_xor_bytes": bound_x / 8, "bound_ulp_bytes": bound_u / 8,
        "ratio_bound_xor": dense / (bound_x / 8), "ratio_bound_ulp": dense / (bound_u / 8),
        "efficiency_vs_xor_bound": (bound_x / 8) / sizes["codec"],  # whole chunks, headers included
        "codec_payload_bytes": payload,
        "efficiency_payload_vs_xor_bound": (bound_x / 8) / payload,
        "efficiency_vs_ulp_bound": (bound_u / 8) / sizes["codec"],
        "efficiency_xor_only_vs_xor_bound": (bound_x / 8) / sizes["codec_xor_only"],
        "seconds": {"kernel": t_kernel, "encode": t_encode, "decode": t_decode, "apply": t_apply,
                    "memcpy": t_copy, **{f"context_{s}": t for s, t in ctx["seconds"].items()}},
        "context": {"bytes": ctx["bytes"], "ratio": dense / ctx["bytes"], "vs_plain": sizes["codec"] / ctx["bytes"],
                    "coded_chunks": ctx["coded"], "chunks": ctx["chunks"]},
        "gbps_per_core": {
            "kernel_input": 2 * dense / t_kernel / 1e9,  # current + baseline bytes read
            "encode": dense / t_encode / 1e9,  # BF16 bytes covered per second
            "decode": dense / t_decode / 1e9,
            "apply": dense / t_apply / 1e9,
            "memcpy": dense / t_copy / 1e9,  # dense copy of the BF16 bytes, same run
            # a sender's context coding (from its baseline, the new bits) and a receiver's
            # decode + apply (from the old bits it holds), bytes covered per second
            "context_encode": dense / ctx["seconds"]["encode"] / 1e9,
            "context_decode_apply": dense / ctx["seconds"]["decode_apply"] / 1e9,
        },
        "bit_exact": True,
    }


def _context_rates(names, deltas, old, new, targets, reset_targets, reps: int) -> dict:
    """The context-modelled coding on the same deltas: encoded as a sender does (from its
    baseline, the new bits), decoded and applied as a receiver does (from the old bits it
    holds, in place), checked against the new weights."""
    chunks: dict[str, list[bytes]] = {}
    t_enc = _median_time(lambda: chunks.update(
        {k: codec.encode_delta(k, deltas[k], current=new[k]) for k in names}), reps)

    def decode_apply():
        for k in names:
            for c in chunks[k]:
                codec.apply_decoded(codec.decode_chunk(c, old=lambda h, t=targets[k]: t), targets[k])

    t_dec = _median_time(decode_apply, reps, reset_targets)
    for k in names:
        if not torch.equal(bits(targets[k]), bits(new[k])):
            raise AssertionError(f"context round trip is not bit-exact for {k}")
    flat = [c for k in names for c in chunks[k]]
    coded = sum(1 for c in flat if codec.parse_header(c).classes)
    return {"seconds": {"encode": t_enc, "decode_apply": t_dec}, "bytes": sum(map(len, flat)),
            "coded": coded, "chunks": len(flat)}


TARGETS = {"ratio_ulp": {0.01: 150, 0.03: 60, 0.05: 40}, "efficiency_vs_xor_bound": 0.95,
           "kernel_input": 4.0, "encode": 4.0, "decode": 15.0, "apply": 15.0}


def format_table(results: list[dict]) -> str:
    rows = []
    head = (f"{'rate':>6} {'codec':>8} {'xor-only':>8} {'simple':>8} {'zstd(xor)':>9} {'bitmap':>8} "
            f"{'bound x':>8} {'bound u':>8} {'eff x':>6} {'pay x':>6} {'eff u':>6} {'kernel':>7} {'encode':>7} "
            f"{'decode':>7} {'apply':>7} {'memcpy':>7} {'ctx':>6} {'ctx enc':>7} {'ctx d+a':>7}")
    rows.append("ratio vs dense BF16 (x); efficiency = bound / size (eff: whole chunks, headers included; "
                "pay: payload only); GB/s per core (kernel: input bytes); ctx: context coding's ratio, its "
                "encode (from the new bits) and decode + apply (from the old)")
    rows.append(head)
    for r in results:
        ra, g = r["ratio"], r["gbps_per_core"]
        rows.append(
            f"{r['change_rate']:6.2%} {ra['codec']:8.1f} {ra['codec_xor_only']:8.1f} {ra['simple']:8.1f} "
            f"{ra['dense_zstd']:9.1f} {ra['bitmap']:8.1f} {r['ratio_bound_xor']:8.1f} {r['ratio_bound_ulp']:8.1f} "
            f"{r['efficiency_vs_xor_bound']:6.3f} {r['efficiency_payload_vs_xor_bound']:6.3f} "
            f"{r['efficiency_vs_ulp_bound']:6.3f} {g['kernel_input']:7.2f} "
            f"{g['encode']:7.2f} {g['decode']:7.2f} {g['apply']:7.2f} {g['memcpy']:7.2f} "
            f"{r['context']['ratio']:6.1f} {g['context_encode']:7.2f} {g['context_decode_apply']:7.2f}")
    return "\n".join(rows)


def run(params: int = 1 << 26, rates=(0.01, 0.03, 0.05), reps: int = 5, seed: int = 0,
        json_path: str | None = None, quiet: bool = False) -> dict:
    torch.set_num_threads(1)
    os.environ["NEMO_DCR_THREADS"] = "1"
    if hasattr(os, "sched_setaffinity"):  # one core, no migrations: steadier per-core figures
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    policy = synthetic.make_policy(params, seed=seed)
    results = []
    for rate in rates:
        if not quiet:
            print(f"nemo-dcr bench codec: {policy.numel / 1e6:.1f}M params at {rate:.1%} ...", flush=True)
        results.append(bench_rate(policy, rate, reps))
    out = {"benchmark": "codec", "machine": machine(), "params": policy.numel, "reps": reps,
           "targets": {k: ({str(r): v for r, v in t.items()} if isinstance(t, dict) else t)
                       for k, t in TARGETS.items()},
           "results": results}
    print(format_table(results))
    if json_path:
        write_json(json_path, out)
    return out
