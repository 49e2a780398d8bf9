"""torchrun worker of `nemo-dcr demo`: a tiny Llama-style megatron-core GPT trained on CPU
(TP x PP, gloo) with the plain-loop Publisher on a file:// store. Rank 0 writes the keyframe
(the dense export of version 0) and, with --verify, the dense export of every version for
the receiver to compare with."""

from __future__ import annotations

import argparse
import datetime
import io
import json
import sys
import time
import warnings

import torch
import torch.distributed as dist


def put_checkpoint(store, key: str, state: dict[str, torch.Tensor], config_json: str | None = None) -> None:
    from safetensors.torch import save

    store.put(f"{key}/model.safetensors", save({k: v.contiguous() for k, v in state.items()}))
    if config_json is not None:
        store.put(f"{key}/config.json", config_json.encode())


def main() -> int:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--store", required=True)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--vocab", type=int, default=1000)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from nemo_dcr_callback import megatron_cpu

    megatron_cpu.enable()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, a.pp)
    from nemo_dcr_callback import commit
    from nemo_dcr_callback.megatron_model import TinyGPTConfig, build_model, hf_config, train_step, wrap_for_training
    from nemo_dcr_callback.placement import LLAMA, dense_export
    from nemo_dcr_callback.publisher import Publisher
    from nemo_dcr_callback.transport.store import open_store

    rank = dist.get_rank()
    cfg = TinyGPTConfig(num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=a.ffn, num_attention_heads=8,
                        num_query_groups=4, vocab_size=a.vocab, seq_length=64)
    model = build_model(cfg)
    ddp, opt = wrap_for_training(model, lr=a.lr)
    store = open_store(a.store)
    exp = dense_export(model, LLAMA, a.vocab)
    if rank == 0:
        put_checkpoint(store, commit.keyframe_dir(0), exp, hf_config(cfg).to_json_string())
        print(f"trainer: {sum(v.numel() for v in exp.values()) / 1e6:.1f}M-param GPT, TP {a.tp} x PP {a.pp}, "
              f"keyframe written", flush=True)
    pub = Publisher(model, family=LLAMA, vocab_size=a.vocab, store=store)
    g = torch.Generator().manual_seed(7 + ps.get_data_parallel_rank())
    for step in range(1, a.steps + 1):
        tokens = torch.randint(0, a.vocab, (2, 2, cfg.seq_length + 1), generator=g)
        t0 = time.perf_counter()
        loss = train_step(ddp, opt, tokens, cfg)
        t1 = time.perf_counter()
        st = pub.publish(step)
        if a.verify:
            exp = dense_export(model, LLAMA, a.vocab)
            if rank == 0:
                put_checkpoint(store, "/".join(commit.verify_key(step).split("/")[:-1]), exp)
        if loss is not None and ps.get_tensor_model_parallel_rank() == 0:
            print(f"trainer: step {step} loss {loss:.4f} train {1e3 * (t1 - t0):.0f} ms, "
                  f"delta kernel {1e3 * st.kernel_s:.1f} ms", flush=True)
    pub.close()
    stats = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object([vars(s) for s in pub.history], stats, dst=0)
    if rank == 0:
        buf = io.StringIO()
        json.dump(stats, buf)
        store.put("demo/publish_stats.json", buf.getvalue().encode())
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
