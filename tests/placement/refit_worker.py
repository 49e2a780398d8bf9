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
    a = ap.parse_args()

    from nemo_dcr_callback.testing import megatron_cpu

    megatron_cpu.enable()
    import datetime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, a.pp)
    from nemo_dcr_callback.placement import FAMILIES, build_placement, dense_export
    from nemo_dcr_callback.receiver.targets import apply_chunks
    from nemo_dcr_callback.sender.shard import ShardSender
    from nemo_dcr_callback.testing.megatron_model import (
        TinyGPTConfig,
        build_model,
        hf_config,
        train_step,
        wrap_for_training,
    )

    rank = dist.get_rank()
    family = FAMILIES[a.family]
    cfg = TinyGPTConfig(num_layers=a.layers, num_attention_heads=a.heads, num_query_groups=a.groups,
                        vocab_size=a.vocab, tie_word_embeddings=a.tie)
    model = build_model(cfg)
    ddp, opt = wrap_for_training(model, lr=a.lr, distributed_optimizer=a.dist_opt)
    dp = ps.get_data_parallel_world_size()
    placement = build_placement(model, family, a.vocab, dp_rank=ps.get_data_parallel_rank(), dp_size=dp)
    sender = ShardSender(placement)

    # Coverage: every canonical element exactly once across all ranks.
    cov = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((sender.coverage(), placement.canonical), cov, dst=0)
    receiver = None
    exp0 = dense_export(model, family, a.vocab)
    if rank == 0:
        from transformers import LlamaForCausalLM

        receiver = LlamaForCausalLM(hf_config(cfg)).to(torch.bfloat16)
        state = receiver.state_dict()
        expected = set(state) - ({"lm_head.weight"} if a.tie else set())
        if set(exp0) != expected:
            print(f"FAIL: export names differ from the HF model: {sorted(set(exp0) ^ expected)}")
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
        missing, unexpected = receiver.load_state_dict(exp0, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            print(f"FAIL: load_state_dict: missing {missing} unexpected {unexpected}")
            return 1

    g = torch.Generator().manual_seed(1000 + ps.get_data_parallel_rank())
    for step in range(1, a.steps + 1):
        tokens = torch.randint(0, a.vocab, (2, 2, cfg.seq_length + 1), generator=g)
        train_step(ddp, opt, tokens, cfg)
        # The DP work split assumes data-parallel replicas hold the same bits: check it.
        from nemo_dcr_callback.codec import tensor_digest

        mine = [tensor_digest(p.detach()) for p in model.parameters()]
        peers = [None] * dp
        dist.all_gather_object(peers, mine, group=ps.get_data_parallel_group())
        if any(x != mine for x in peers):
            print(f"FAIL step {step}: data-parallel replicas diverged (rank {rank})")
            return 1
        taken = sender.take()
        dig_c = sender.digests()
        dig_p = dict(dig_c)
        chunks, st = sender.encode(taken, digests=dig_c)
        sender.fused_slices = False  # the Python path (project + encode_sparse) writes the same chunks
        py_chunks, _ = sender.encode(taken, digests=dig_p)
        sender.fused_slices = True
        if py_chunks != chunks or dig_c != dig_p:
            print(f"FAIL step {step}: the compiled slice encoder and the Python path differ (rank {rank})")
            return 1
        if step == 2:  # an aborted refit: the undo log restores the baselines, the retry is identical
            sender.abort()
            again, _ = sender.step()
            if again != chunks:
                print(f"FAIL step {step}: chunks after abort + retry differ")
                return 1
        sender.commit()
        got = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object((chunks, st.changed, st.params, st.residual_changed), got, dst=0)
        exp = dense_export(model, family, a.vocab)
        if rank == 0:
            all_chunks = [c for r in got for c in r[0]]
            changed = sum(r[1] for r in got)
            total = sum(r[2] for r in got)
            resid = sum(r[3] for r in got)
            state = receiver.state_dict()
            apply_chunks(state, all_chunks)
            for name, ref in exp.items():
                if not torch.equal(ref.view(torch.int16), state[name].view(torch.int16)):
                    bad = int((ref.view(torch.int16) != state[name].view(torch.int16)).sum())
                    print(f"FAIL step {step}: {name} differs from the dense export in {bad} elements")
                    return 1
            if changed == 0:
                print(f"FAIL step {step}: nothing changed (the test would prove nothing)")
                return 1
            nbytes = sum(map(len, all_chunks))
            print(f"step {step}: changed {changed}/{total} ({changed / total:.2%}, residual {resid}), "
                  f"{len(all_chunks)} chunks, {nbytes} bytes vs {2 * total} dense; "
                  f"{len(exp)} tensors bit-exact with the dense export", flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    from nemo_dcr_callback.testing.megatron_cpu import exit_worker

    exit_worker(main())
