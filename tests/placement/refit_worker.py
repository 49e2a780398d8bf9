"""torchrun worker: train a tiny Llama-style megatron-core GPT on CPU (gloo) and check, at
every step, that a Hugging Face LlamaForCausalLM that started from the dense export of step 0
and then received only this project's chunks is bit-identical, tensor by tensor, to the dense
export of that step. Also counts coverage: every canonical element sent by exactly one rank.

Exit status 0 and one "bit-exact" line per step on rank 0, or non-zero naming the tensor.
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np
import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def moe_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer")
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--moe-ffn", type=int, default=32)
    ap.add_argument("--shared", type=int, default=None, help="shared expert's intermediate size")
    ap.add_argument("--dense-first", type=int, default=0, help="dense layers before the MoE ones")
    ap.add_argument("--mla", action="store_true", help="multi-head latent attention (DeepSeek-V3)")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)


def moe_config(a) -> dict:
    """TinyGPTConfig fields for the family's mixture of experts (none for dense families)."""
    if not a.experts:
        return {}
    kw = dict(num_moe_experts=a.experts, moe_router_topk=a.topk, moe_ffn_hidden_size=a.moe_ffn,
              moe_shared_expert_intermediate_size=a.shared, moe_first_dense_layers=a.dense_first,
              multi_latent_attention=a.mla, qk_layernorm=a.family == "qwen3_moe")
    if a.family == "deepseek_v3":  # sigmoid scores, a score-correction bias, group-limited routing
        kw.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=2,
                  moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5)
    return kw


def _is_expert(p) -> bool:
    return not getattr(p, "allreduce", True)  # megatron-core marks expert parameters so


def hf_receiver(cfg, family: str, export: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16):
    """A transformers model of the family loaded from the export (written as a checkpoint, read
    by from_pretrained), and the tensor names transformers itself writes for this config."""
    import tempfile
    from pathlib import Path

    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file

    from nemo_dcr_callback.recipes.megatron_model import hf_config

    hcfg = hf_config(cfg, family)
    with tempfile.TemporaryDirectory() as d:
        fresh = transformers.AutoModelForCausalLM.from_config(hcfg)
        fresh.should_save_on_this_rank = lambda is_main_process: True  # (it writes on torch rank 0 only)
        fresh.save_pretrained(d + "/fresh")
        names = set()
        for path in Path(d, "fresh").glob("*.safetensors"):
            with safe_open(str(path), "pt") as f:
                names |= set(f.keys())
        hcfg.save_pretrained(d + "/export")
        save_file({k: v.contiguous() for k, v in export.items()}, d + "/export/model.safetensors",
                  metadata={"format": "pt"})
        model = transformers.AutoModelForCausalLM.from_pretrained(d + "/export", dtype=dtype)
    # from_pretrained computes non-persistent buffers (rotary inv_freq) after its meta-device
    # init; with megatron_cpu's wrapped torch factories in this process it leaves them unset:
    # they come from the model built from the config instead (they are no checkpoint tensors)
    persistent = set(model.state_dict())
    with torch.no_grad():
        for n, b in fresh.named_buffers():
            if n not in persistent:
                dict(model.named_buffers())[n].copy_(b)
    return model, names


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=250)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dist-opt", action="store_true")
    ap.add_argument("--family", default="llama")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--context", action="store_true",
                    help="context coding from the worker's copy (sender/mirror.py), undone and redone at the abort")
    moe_arguments(ap)
    a = ap.parse_args()

    from nemo_dcr_callback.recipes import megatron_cpu

    megatron_cpu.enable()
    import datetime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, a.pp, expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp)
    from nemo_dcr_callback import codec
    from nemo_dcr_callback.placement import FAMILIES, build_placement, dense_export
    from nemo_dcr_callback.receiver.targets import apply_chunks
    from nemo_dcr_callback.recipes.megatron_model import (
        TinyGPTConfig,
        build_model,
        train_step,
        wrap_for_training,
    )
    from nemo_dcr_callback.sender.shard import ShardSender

    rank = dist.get_rank()
    family = FAMILIES[a.family]
    cfg = TinyGPTConfig(num_layers=a.layers, num_attention_heads=a.heads, num_query_groups=a.groups,
                        vocab_size=a.vocab, tie_word_embeddings=a.tie, hidden_size=a.hidden, ffn_hidden_size=a.ffn,
                        **moe_config(a))
    model = build_model(cfg)
    ddp, opt = wrap_for_training(model, lr=a.lr, distributed_optimizer=a.dist_opt)
    dp = ps.get_data_parallel_world_size()
    placement = build_placement(model, family, a.vocab, dp_rank=ps.get_data_parallel_rank(), dp_size=dp)
    sender = ShardSender(placement)
    mirror = None
    if a.context:  # as the publisher's worker does: a copy of the runs this rank owns whole
        from nemo_dcr_callback.sender.mirror import Mirror

        mirror = sender.encoder.mirror = Mirror(sender.context_runs(), 0)
    ctx_chunks = 0

    # Coverage: every canonical element exactly once across all ranks.
    cov = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((sender.coverage(), placement.canonical), cov, dst=0)
    receiver = None
    exp0 = dense_export(model, family, a.vocab)
    if rank == 0:
        # the receiver: transformers' own loader reads the dense export as a checkpoint; the
        # canonical tensors are its parameters (or views of its fused experts)
        receiver, expected = hf_receiver(cfg, a.family, exp0)
        if set(exp0) != expected:
            print(f"FAIL: export names differ from the HF checkpoint's: {sorted(set(exp0) ^ expected)}")
            return 1
        from nemo_dcr_callback.receiver.targets.hf_memory import canonical_views

        state = canonical_views(receiver, exp0)
        for k, v in exp0.items():
            if not torch.equal(state[k].view(torch.uint8), v.view(torch.uint8)):
                print(f"FAIL: {k} loaded by transformers differs from the export")
                return 1
        shapes: dict[str, tuple] = {}
        per: dict[str, list] = {}
        for c, canon in cov:
            shapes.update(canon)
            for k, v in c.items():
                per.setdefault(k, []).append(v)
        if set(per) != expected:
            print(f"FAIL: canonical tensors covered differ: {sorted(set(per) ^ expected)}")
            return 1
        for k, parts in per.items():
            allp = np.sort(np.concatenate(parts))
            n = state[k].numel()
            if allp.size != n or not np.array_equal(allp, np.arange(n)) or tuple(state[k].shape) != shapes[k]:
                print(f"FAIL: coverage of {k}: {allp.size} positions for {n} elements (duplicates or gaps)")
                return 1
        print(f"coverage: {len(per)} canonical tensors, {sum(state[k].numel() for k in per)} elements, "
              f"each sent by exactly one rank")

    g = torch.Generator().manual_seed(1000 + ps.get_data_parallel_rank())
    for step in range(1, a.steps + 1):
        tokens = torch.randint(0, a.vocab, (2, 2, cfg.seq_length + 1), generator=g)
        train_step(ddp, opt, tokens, cfg)
        # The DP work split assumes data-parallel replicas hold the same bits: check it.
        from nemo_dcr_callback.codec import tensor_digest

        # (expert parameters are replicated over the expert-data-parallel group instead)
        for experts, group in ((False, ps.get_data_parallel_group()), (True, ps.get_expert_data_parallel_group())):
            mine = [tensor_digest(p.detach()) for p in model.parameters() if _is_expert(p) == experts]
            peers = [None] * dist.get_world_size(group)
            dist.all_gather_object(peers, mine, group=group)
            if any(x != mine for x in peers):
                print(f"FAIL step {step}: data-parallel replicas diverged (rank {rank})")
                return 1
        taken = sender.take(step)
        dig_c = sender.digests()
        dig_p = dict(dig_c)
        if mirror is not None:
            mirror.begin(step, step - 1)
        # with the copy: odd steps coded plain (the copy follows them), even steps context-coded from it
        chunks, st = sender.encode(taken, digests=dig_c,
                                   context_now=None if mirror is None else (lambda s=step: s % 2 == 0))
        if mirror is not None:
            mirror.end(True)
            ctx_chunks += sum(codec.parse_header(c).classes > 0 for c in chunks)
        else:
            sender.encoder.fused_slices = False  # the Python path (project + encode_sparse) writes the same chunks
            py_chunks, _ = sender.encode(taken, digests=dig_p)
            sender.encoder.fused_slices = True
            if py_chunks != chunks or dig_c != dig_p:
                print(f"FAIL step {step}: the compiled slice encoder and the Python path differ (rank {rank})")
                return 1
        if step == 2:  # an aborted refit: the undo log restores the baselines, the retry is identical
            sender.roll_back(step)
            if mirror is not None:  # the worker's copy goes back to the base too
                mirror.settle(step, "abort")
                mirror.begin(step, step - 1)
            again, _ = sender.step(step)
            if mirror is not None:
                mirror.end(True)
            if again != chunks:
                print(f"FAIL step {step}: chunks after abort + retry differ")
                return 1
        sender.settle(step)
        if mirror is not None:
            mirror.settle(step, "commit")
        got = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object((chunks, st.changed, st.params, st.residual_changed), got, dst=0)
        exp = dense_export(model, family, a.vocab)
        if rank == 0:
            all_chunks = [c for r in got for c in r[0]]
            changed = sum(r[1] for r in got)
            total = sum(r[2] for r in got)
            resid = sum(r[3] for r in got)
            apply_chunks(state, all_chunks)
            for name, ref in exp.items():
                if not torch.equal(ref.view(torch.uint8), state[name].view(torch.uint8)):
                    bad = int((ref.view(torch.uint8) != state[name].view(torch.uint8)).sum())
                    print(f"FAIL step {step}: {name} differs from the dense export in {bad} elements")
                    return 1
            if changed == 0:
                print(f"FAIL step {step}: nothing changed (the test would prove nothing)")
                return 1
            nbytes = sum(map(len, all_chunks))
            print(f"step {step}: changed {changed}/{total} ({changed / total:.2%}, residual {resid}), "
                  f"{len(all_chunks)} chunks, {nbytes} bytes vs {2 * total} dense; "
                  f"{len(exp)} tensors bit-exact with the dense export", flush=True)
    if mirror is not None:
        total_ctx = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(ctx_chunks, total_ctx, dst=0)
        if rank == 0:
            print(f"context-coded chunks: {sum(total_ctx)}", flush=True)
    if rank == 0:  # buffers moved by training itself (DeepSeek's router bias): sent too
        moved = {k: int((exp[k] != exp0[k]).sum()) for k in exp if k.endswith("e_score_correction_bias")}
        if moved:
            print(f"router score-correction bias: {sum(moved.values())} elements moved in {len(moved)} tensors")
            if not sum(moved.values()):
                print("FAIL: the router bias never moved (the test would not show it is sent)")
                return 1
    dist.barrier()
    return 0


if __name__ == "__main__":
    from nemo_dcr_callback.recipes.megatron_cpu import exit_worker

    exit_worker(main())
