"""What the `dcr` trainer engine costs each trainer rank in host memory (issue 65): a Llama of
about 400 MB in BF16, sharded by FSDP2 over 2 ranks (gloo, CPU), its vLLM `ModuleSource`
(iteration gathers one parameter at a time: `full_tensor()`, a collective), trainer_init and a
few send_weights with no engine attached. Per rank: resident memory before, and the peak
(VmHWM, reset before each phase) above it during trainer_init and during the sends. The sender
keeps its baseline (one copy of the model); the other ranks should keep nothing beyond one
gathered parameter. Launched by `nemo-dcr bench trainer-memory` (torchrun, 2 ranks; in
.venv-vllm, which has vLLM's trainer-side classes):

    .venv-vllm/bin/nemo-dcr bench trainer-memory --json benchmarks/results/trainer_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _status(key: str) -> int:
    """A /proc/self/status figure, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: clear_refs 5); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _phase(fn) -> dict:
    """Run fn; the resident set before, and the peak above it during fn (bytes)."""
    import gc

    gc.collect()
    before = _status("VmRSS")
    exact = _reset_peak()
    t0 = time.perf_counter()
    out = fn()
    return {"rss_before": before, "peak_above": _status("VmHWM") - before, "peak_exact": exact,
            "seconds": time.perf_counter() - t0, "result": out}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--versions", type=int, default=2)
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True, help="this rank's figures go to OUT.rankN.json")
    a = p.parse_args(argv)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from nemo_dcr_callback.integrations.vllm_transfer import DCRTrainerInitInfo

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75) // 64 * 64,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                      num_key_value_heads=a.hidden // 128, vocab_size=a.vocab, tie_word_embeddings=False)
    with torch.device("meta"):  # no rank ever holds the whole model for its own training
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for prm in model.parameters():
            prm.to_local().normal_(0, 0.02)
    model_bytes = sum(prm.numel() * prm.element_size() for prm in model.parameters())
    shard_bytes = sum(prm.to_local().numel() * prm.element_size() for prm in model.parameters())
    rss_model = _status("VmRSS")

    info = DCRTrainerInitInfo(store=a.store, rank=rank, receiver_id=None)
    init = _phase(lambda: WeightTransferTrainerFactory.trainer_init(info, client=[], source=ModuleSource(model)))
    sync = init.pop("result")
    sends = []
    for v in range(1, a.versions + 1):
        with torch.no_grad():  # an optimizer step's worth of change on this rank's shards
            g = torch.Generator().manual_seed(v * 100 + rank)
            for prm in model.parameters():
                loc = prm.to_local()
                m = torch.rand(loc.shape, generator=g) < 0.03
                loc[m] = (loc[m].float() * 1.01).to(loc.dtype)
        ph = _phase(sync.send_weights)
        d = ph.pop("result")
        ph["committed"] = None if d is None else bool(d["committed"])
        sends.append(ph)
    row = {"rank": rank, "world": world, "sender": rank == 0, "model_bytes": model_bytes, "shard_bytes": shard_bytes,
           "rss_with_model": rss_model, "init": init, "sends": sends,
           "largest_param_bytes": max(prm.numel() * prm.element_size() for prm in model.parameters())}
    Path(f"{a.out}.rank{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def run(hidden: int = 1024, layers: int = 12, vocab: int = 32000, versions: int = 2, nproc: int = 2,
        json_path: str | None = None) -> dict:
    """Launch main() on `nproc` ranks under torchrun, gather and print their figures."""
    import subprocess
    import sys

    from nemo_dcr_callback.bench.results import machine, write_json
    from nemo_dcr_callback.launcher import torchrun_cmd

    with tempfile.TemporaryDirectory() as td:
        out = os.path.join(td, "mem")
        cmd = torchrun_cmd(nproc, ["-m", "nemo_dcr_callback.bench.trainer_memory", "--hidden", str(hidden),
                                   "--layers", str(layers), "--vocab", str(vocab), "--versions", str(versions),
                                   "--store", f"file://{td}/store", "--out", out])
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            raise RuntimeError(f"the trainer-memory ranks failed (exit {rc})")
        rows = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]
    mb = 1e6
    print(f"{rows[0]['model_bytes'] / mb:.0f} MB model (BF16), FSDP2 over {nproc} ranks (gloo, CPU); "
          f"largest parameter {rows[0]['largest_param_bytes'] / mb:.0f} MB", flush=True)
    print(f"{'rank':>4} {'role':>7} {'shard':>8} {'RSS':>8} {'init peak+':>10} {'send peak+':>10}", flush=True)
    for r in rows:
        send_peak = max(s["peak_above"] for s in r["sends"])
        print(f"{r['rank']:4d} {'sender' if r['sender'] else 'other':>7} {r['shard_bytes'] / mb:7.0f}M "
              f"{r['rss_with_model'] / mb:7.0f}M {r['init']['peak_above'] / mb:9.0f}M {send_peak / mb:9.0f}M",
              flush=True)
    res = {"rows": rows, "machine": machine(), "sys_executable": sys.executable}
    if json_path:
        write_json(json_path, res)
    return res


if __name__ == "__main__":
    main()
