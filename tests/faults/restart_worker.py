"""torchrun worker for the sender-restart fault (tests/faults/test_process_faults.py): real training,
TP 2 on CPU (gloo), the Publisher on a store a receiver follows.

  first  DIR URL   steps 1-3, a weights checkpoint after step 1; versions 1 and 2 commit, and
                   rank 1 is SIGKILLed (NEMO_DCR_SENDER_FAULT) while uploading version 3
  second DIR URL   restart from the step-1 checkpoint with Publisher(resume=True): rebase on
                   the last committed version (2), abort the unfinished 3, train steps 2-3 again
                   publishing versions 4 and 5; rank 0 stores the dense export of the final
                   weights for the test to compare with the receiver
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def main() -> int:
    phase, ckpt_dir, url = sys.argv[1], sys.argv[2], sys.argv[3]
    from nemo_dcr_callback.recipes import megatron_cpu

    rank = megatron_cpu.init_gloo(2, 1, timeout_s=120)
    from safetensors.torch import save

    from nemo_dcr_callback.placement import FAMILIES, dense_export
    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.recipes.megatron_model import (
        TEST_GPT,
        TinyGPTConfig,
        build_model,
        train_step,
        wrap_for_training,
    )
    from nemo_dcr_callback.sender.publisher import Publisher
    from nemo_dcr_callback.transport.store import open_store

    cfg = TinyGPTConfig(**TEST_GPT)
    fam, vocab = FAMILIES["llama"], cfg.vocab_size
    model = build_model(cfg)
    ckpt = f"{ckpt_dir}/rank{rank}.pt"
    g = torch.Generator().manual_seed(7)
    if phase == "second":  # restore the training checkpoint (weights and data order) before wrapping
        state = torch.load(ckpt, weights_only=False)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(state["params"][n])
        g.set_state(state["rng"])
    ddp, opt = wrap_for_training(model, lr=1e-3)
    store = open_store(url)
    if phase == "first":
        exp0 = dense_export(model, fam, vocab)  # a collective: every rank takes part
        if rank == 0:
            commit.write_keyframe(store, 0, exp0)
    dist.barrier()
    pub = Publisher(model, family=fam, vocab_size=vocab, store=store, resume=phase == "second",
                    policy=commit.CommitPolicy("wait", timeout=60.0), seal_timeout=60)

    def step():
        train_step(ddp, opt, torch.randint(0, vocab, (2, 2, cfg.seq_length + 1), generator=g), cfg)

    if phase == "first":
        for s in (1, 2, 3):
            step()
            if s == 1:
                torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                            "rng": g.get_state()}, ckpt)
            pub.publish(s)
            if s == 2:
                pub.flush()  # version 2 committed before the crash
                dist.barrier()
        pub.flush()  # rank 1 dies during version 3; rank 0 waits here until torchrun stops it
        return 3
    if rank == 0:
        print(f"resumed from version {pub.resumed_from}; next version {pub.next_version()}", flush=True)
    for _ in range(2):
        step()
        pub.publish(pub.next_version())
    pub.flush()
    exp = dense_export(model, fam, vocab)
    if rank == 0:
        store.put("test/final.safetensors", save(exp))
        print(f"published versions {[h.version for h in pub.history]}", flush=True)
    pub.close()
    dist.barrier()
    return 0


if __name__ == "__main__":
    from nemo_dcr_callback.recipes.megatron_cpu import exit_worker

    exit_worker(main())
