"""The S3 tests' versions: a small BF16 model's states, written by TensorSender ranks (the
sender path over canonical tensors held whole, without Megatron placement), sealed and
committed."""

from __future__ import annotations

import torch

from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.testing.tensor_sender import TensorSender

from .tensors import perturb, random_tensor


def s3_states(steps: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Four BF16 tensors of 96 x 65, then `steps` versions each changing ~3% of the elements."""
    g0 = torch.Generator().manual_seed(0)
    states = [{f"layer.{i}.w": random_tensor((96, 65), torch.bfloat16, g0, specials=False) for i in range(4)}]
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        states.append({k: perturb(t, 0.03, g) for k, t in states[-1].items()})
    return states


def write_version(store, v, base, old, new, world=2, part_bytes=4 << 20):
    """Every sender rank's parts and manifest of version v (not sealed)."""
    for r in range(world):
        s = TensorSender(old, r, world)
        for n in s.tensors:
            s.tensors[n] = new[n]
        s.write(store, v, base, s.take(), part_bytes=part_bytes)


def commit_version(store, v, base, old, new, world=2, policy=None):
    """write_version, then seal and commit v; the decision."""
    write_version(store, v, base, old, new, world)
    rec = commit.seal_version(store, v, base, world, timeout=10)
    return commit.run_commit(store, rec, policy or commit.CommitPolicy())
