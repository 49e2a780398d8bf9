"""torchrun worker for tests/sender/test_training_abort.py: real training (TP 2 on CPU,
gloo) publishing to S3 with the abort policy. Version 1 aborts (a registered receiver never
acks) and every rank checks its baselines are back at version 0 bit for bit; versions 2 and
3 commit with a live receiver's acks, and the receiver ends bit-exact with the dense export
of step 3. argv: the store URL, then the publisher's worker ("process", the default, or
"thread")."""

from __future__ import annotations

import sys
import threading
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def main() -> int:
    url = sys.argv[1]
    worker = sys.argv[2] if len(sys.argv) > 2 else "process"
    from nemo_dcr_callback.recipes import megatron_cpu

    rank = megatron_cpu.init_gloo(2, 1, timeout_s=300)
    from nemo_dcr_callback.core.rawbits import bits
    from nemo_dcr_callback.placement import FAMILIES, dense_export
    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.receiver import Follower
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
    ddp, opt = wrap_for_training(model, lr=1e-3)
    store = open_store(url)
    exp0 = dense_export(model, fam, vocab)
    if rank == 0:
        commit.write_keyframe(store, 0, exp0)
        commit.register(store, "ghost", 0)  # registered, never acks
    dist.barrier()
    pub = Publisher(model, family=fam, vocab_size=vocab, store=store,
                    policy=commit.CommitPolicy("abort", timeout=2.0), seal_timeout=60, worker=worker)
    snap = {k: v.clone() for k, v in pub.sender.baselines.items()}
    g = torch.Generator().manual_seed(7)

    def step():
        train_step(ddp, opt, torch.randint(0, vocab, (2, 2, cfg.seq_length + 1), generator=g), cfg)

    step()
    pub.publish(1)
    pub.flush()
    ok = [v.version for v in pub.aborted] == [1] and pub.last_version == 0 and all(
        torch.equal(bits(snap[k]), bits(v)) for k, v in pub.sender.baselines.items())
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    if rank == 0:
        print(f"version 1 aborted; baselines restored bit-exact on {sum(flags)} ranks", flush=True)
    if not all(flags):
        return 1
    follower = None
    if rank == 0:
        store.delete([commit.receiver_key("ghost")])
        tensors = {k: v.clone() for k, v in exp0.items()}
        follower = Follower(store, tensors, version=0, receiver_id="rollout-0")
        th = threading.Thread(target=follower.follow, kwargs={"until": 3, "timeout": 120}, daemon=True)
        th.start()
    dist.barrier()
    for v in (2, 3):
        step()
        pub.publish(v)
    pub.flush()
    exp = dense_export(model, fam, vocab)
    rc = 0
    if rank == 0:
        th.join(120)
        bad = [k for k, t in exp.items() if not torch.equal(bits(t), bits(tensors[k]))]
        if follower.version != 3 or bad:
            print(f"FAIL: receiver at version {follower.version}, differing tensors {bad[:3]}", flush=True)
            rc = 1
        else:
            print("receiver bit-exact with the dense export at version 3", flush=True)
    pub.close()
    dist.barrier()
    return rc


if __name__ == "__main__":
    from nemo_dcr_callback.recipes.megatron_cpu import exit_worker

    exit_worker(main())
