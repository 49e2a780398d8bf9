"""`nemo-dcr bench placement`: one-time map building and projection speed, per core.

Runs under torchrun (gloo, CPU) with a Llama-shaped megatron-core GPT (with --experts, a
mixture of experts under expert parallelism, --ep); every rank builds its maps, then projects
sorted random positions (the given change rate of its shard) through them. With --encode each
rank then changes that share of its weights (one ulp), takes and encodes a version, and the
table adds what a version costs beyond its payload: chunks, canonical tensors, the bytes of
chunk headers (fixed fields, stream table, the tensor's name, checksum) and of the per-tensor
digests the version record carries for the rank's tensors. Rank 0 prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--family", default="llama")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per layer (a mixture)")
    ap.add_argument("--moe-ffn", type=int, default=None)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--encode", action="store_true", help="also encode a version: chunks, tensors, overhead")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from nemo_dcr_callback.recipes import megatron_cpu

    megatron_cpu.enable()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, a.pp, expert_model_parallel_size=a.ep)
    from nemo_dcr_callback.placement import FAMILIES, Placement, build_placement
    from nemo_dcr_callback.recipes.megatron_model import TinyGPTConfig, build_model

    moe = dict(num_moe_experts=a.experts, moe_ffn_hidden_size=a.moe_ffn, qk_layernorm=a.family == "qwen3_moe")
    cfg = TinyGPTConfig(num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=a.ffn, num_attention_heads=a.heads,
                        num_query_groups=a.groups, vocab_size=a.vocab, seq_length=128, **(moe if a.experts else {}))
    model = build_model(cfg)
    t0 = time.perf_counter()
    placement = build_placement(model, FAMILIES[a.family], a.vocab)
    t_build = time.perf_counter() - t0
    rng = np.random.default_rng(dist.get_rank())
    work = []
    for pm in placement.params:
        n = pm.hi - pm.lo
        if n == 0:
            continue
        k = max(1, int(n * a.rate))
        pos = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64) + pm.lo
        work.append((pm, pos))
    total = sum(p.size for _, p in work)
    times = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        for pm, pos in work:
            Placement.project(pm, pos)
        times.append(time.perf_counter() - t0)
    t_proj = statistics.median(times)
    segs = sum(pm.local_start.size for pm in placement.params)
    row = {"rank": dist.get_rank(), "params": sum(pm.numel for pm in placement.params), "segments": segs,
           "build_s": t_build, "positions": total, "project_s": t_proj, "positions_per_s": total / t_proj}
    if a.encode:
        row.update(_encode(placement, a.rate, dist.get_rank()))
    rows = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(row, rows, dst=0)
    if dist.get_rank() == 0:
        moe = f", {a.experts} experts of ffn {a.moe_ffn} per layer" if a.experts else ""
        print(f"placement maps: {a.family} GPT, {a.layers} layers, hidden {a.hidden}, ffn {a.ffn}{moe}, "
              f"heads {a.heads}, groups {a.groups}, vocab {a.vocab}; TP {a.tp} x PP {a.pp} x EP {a.ep}; "
              f"{a.rate:.0%} of positions; one core per rank")
        print(f"{'rank':>4} {'params':>11} {'segments':>8} {'build ms':>9} {'positions':>10} {'Mpos/s':>8}")
        for r in rows:
            print(f"{r['rank']:>4} {r['params']:>11,} {r['segments']:>8} {1e3 * r['build_s']:9.1f} "
                  f"{r['positions']:>10,} {r['positions_per_s'] / 1e6:8.1f}")
        if a.encode:
            print(f"one version at {a.rate:.0%}: {'chunks':>7} {'tensors':>8} {'payload B':>11} {'headers B':>10} "
                  f"{'digests B':>10} {'overhead':>8}")
            for r in rows:
                print(f"rank {r['rank']:>3}{'':>13} {r['chunks']:>7} {r['tensors']:>8} {r['payload_bytes']:>11,} "
                      f"{r['header_bytes']:>10,} {r['digest_bytes']:>10,} {r['overhead']:8.2%}")
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps({"benchmark": "placement", "args": vars(a), "ranks": rows,
                                                "cpu": os.uname().machine}, indent=2) + "\n")
            print(f"wrote {a.json}")
    dist.barrier()


def _encode(placement, rate: float, seed: int) -> dict:
    """One version's chunks after moving `rate` of every parameter one ulp; what they cost
    beyond the payload (the codec's entropy tables count as payload here)."""
    from nemo_dcr_callback import codec
    from nemo_dcr_callback.sender.shard import ShardSender

    sender = ShardSender(placement)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pm in placement.params:
            b = pm.param.detach().view(torch.int16 if pm.param.element_size() == 2 else torch.int32).reshape(-1)
            m = torch.rand(b.numel(), generator=g) < rate
            b[m] ^= 1  # the lowest mantissa bit: one ulp
    t0 = time.perf_counter()
    taken = sender.take(1)
    chunks, _ = sender.encode(taken, digests=sender.digests())
    encode_s = time.perf_counter() - t0
    heads = [codec.parse_header(c, verify=False) for c in chunks]
    header = sum(h.payload_offset + 8 for h in heads)  # (+ the 8-byte checksum)
    digests = len(json.dumps({n: "0" * 16 for n in placement.canonical}))  # the rank's share of the record's digests
    total = sum(map(len, chunks))
    names = {p.name for h in heads for p in h.parts()}
    return {"chunks": len(chunks), "tensors": len(names), "payload_bytes": total - header,
            "header_bytes": header, "digest_bytes": digests, "encode_s": encode_s,
            "overhead": (header + digests) / max(1, total - header)}


if __name__ == "__main__":
    main()
