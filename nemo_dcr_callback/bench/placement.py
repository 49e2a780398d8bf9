"""`nemo-dcr bench placement`: one-time map building and projection speed, per core.

Runs under torchrun (gloo, CPU) with a Llama-shaped megatron-core GPT; every rank builds its
maps, then projects sorted random positions (the given change rate of its shard) through
them. Rank 0 prints a table and writes JSON.
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
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from nemo_dcr_callback.testing import megatron_cpu

    megatron_cpu.enable()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, a.pp)
    from nemo_dcr_callback.placement import LLAMA, Placement, build_placement
    from nemo_dcr_callback.testing.megatron_model import TinyGPTConfig, build_model

    cfg = TinyGPTConfig(num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=a.ffn, num_attention_heads=a.heads,
                        num_query_groups=a.groups, vocab_size=a.vocab, seq_length=128)
    model = build_model(cfg)
    t0 = time.perf_counter()
    placement = build_placement(model, LLAMA, a.vocab)
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
    rows = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(row, rows, dst=0)
    if dist.get_rank() == 0:
        print(f"placement maps: Llama-shaped GPT, {a.layers} layers, hidden {a.hidden}, ffn {a.ffn}, "
              f"heads {a.heads}, groups {a.groups}, vocab {a.vocab}; TP {a.tp} x PP {a.pp}; "
              f"{a.rate:.0%} of positions; one core per rank")
        print(f"{'rank':>4} {'params':>11} {'segments':>8} {'build ms':>9} {'positions':>10} {'Mpos/s':>8}")
        for r in rows:
            print(f"{r['rank']:>4} {r['params']:>11,} {r['segments']:>8} {1e3 * r['build_s']:9.1f} "
                  f"{r['positions']:>10,} {r['positions_per_s'] / 1e6:8.1f}")
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps({"benchmark": "placement", "args": vars(a), "ranks": rows,
                                                "cpu": os.uname().machine}, indent=2) + "\n")
            print(f"wrote {a.json}")
    dist.barrier()


if __name__ == "__main__":
    main()
