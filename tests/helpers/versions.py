"""A small model's versions published to a store. The sender is the TensorSender harness
(nemo_dcr_callback/testing/tensor_sender.py): the sender path over canonical tensors held
whole, split between ranks, without Megatron placement; training publishes through
ShardSender + Publisher instead. Both write the same parts, manifests and records and go
through the same seal and joint commit."""

from __future__ import annotations

import torch

from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.testing.tensor_sender import publish as _publish

from .tensors import perturb, random_tensor


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Four BF16 tensors of 64 x 33."""
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.w": random_tensor((64, 33), torch.bfloat16, g, specials=False) for i in range(4)}


def publish(store, v: int, base: int, old, new, world: int = 2):
    """Version v (old -> new, on base) written by `world` TensorSender ranks, sealed, committed."""
    return _publish(store, v, base, old, new, world=world, timeout=5)


def chain(store, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """Versions 1..steps of model(), each changing ~5% of the elements, committed in order; the
    states 0..steps (the oracle)."""
    states = [model()]
    g = torch.Generator().manual_seed(1)
    for v in range(1, steps + 1):
        states.append({k: perturb(t, 0.05, g) for k, t in states[-1].items()})
        publish(store, v, v - 1, states[-2], states[-1])
    return states


def copy_damaged(staging, store, v: int, part: str | None = None) -> str:
    """Copy version v's objects written to `staging` into `store`, one part (default: the
    first) with a bit flipped, parts first. A follower streams a version while it is written,
    so a part damaged in place after the write may be held intact already (and then applying
    it is right); copied in damaged, no reader ever sees it intact. Returns the damaged key."""
    keys = sorted(staging.list(commit.vdir(v)), key=lambda k: (not k.endswith(".dcr"), k))
    part = part or keys[0]
    assert part in keys and part.endswith(".dcr"), (part, keys)
    for k in keys:
        blob = bytearray(staging.get(k))
        if k == part:
            blob[len(blob) // 2] ^= 0x20
        store.put(k, bytes(blob))
    return part
