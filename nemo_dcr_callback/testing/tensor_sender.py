"""TensorSender (sender/named.py's NamedSender) and `publish`, one version through the sender
path in one call, for benchmarks and tests: a synthetic policy or a Hugging Face state dict
published without a Megatron model and without a NamedPublisher's keyframe and resume.
"""

from __future__ import annotations

import torch

from nemo_dcr_callback.config import CommitPolicy
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.sender.named import NamedSender

TensorSender = NamedSender  # (the tests' and benchmarks' name)


def publish(store, v: int, base: int, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], world: int = 1,
            timeout: float = 60.0, **write_options) -> dict:
    """One version old -> new through the sender path over whole tensors (chunks, parts,
    manifests, seal and joint commit as the Publisher writes them; no Megatron placement):
    `world` TensorSenders write their share, the version is sealed and committed (the default
    policy: no receivers awaited). Returns the decision."""
    for r in range(world):
        s = TensorSender(old, r, world)
        for n in s.tensors:
            s.tensors[n] = new[n]
        s.write(store, v, base, s.take(), **write_options)
    rec = commit.seal_version(store, v, base, world, timeout=timeout)
    return commit.run_commit(store, rec, CommitPolicy())
