"""The fault suite's helpers (tests/faults): BF16 weights and small updates, a fleet of
receivers following a store in threads, and versions written by TensorSender ranks (the
sender path over canonical tensors held whole, without Megatron placement)."""

from __future__ import annotations

import threading

import torch

from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.testing.tensor_sender import TensorSender


def fault_states(steps: int, n: int = 6, shape=(256, 515), rate: float = 0.03, seed: int = 0):
    """BF16 weights and `steps` updates changing ~rate of the elements by a few ulps."""
    g = torch.Generator().manual_seed(seed)
    cur = {f"layer.{i}.w": (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for i in range(n)}
    out = [cur]
    for _ in range(steps):
        nxt = {}
        for k, t in out[-1].items():
            b = bits(t).clone()
            m = torch.rand(b.shape, generator=g) < rate
            step = torch.randint(1, 4, b.shape, generator=g, dtype=torch.int16)
            b[m] += step[m]
            nxt[k] = b.view(torch.bfloat16)
        out.append(nxt)
    return out


def clone_state(t):
    return {k: v.clone() for k, v in t.items()}


class Fleet:
    """Receivers following a store in threads; errors are collected, not lost."""

    def __init__(self, store, start, n=2, until=None, decision_timeout=30.0):
        self.tensors = [clone_state(start) for _ in range(n)]
        stores = store if isinstance(store, list) else [store] * n
        self.followers = [Follower(st, t, receiver_id=f"rx-{i}", poll_s=0.005, decision_timeout=decision_timeout)
                          for i, (st, t) in enumerate(zip(stores, self.tensors, strict=True))]
        self.errors: list[BaseException] = []
        self.until = until

    def run(self, until: int, timeout: float = 60.0) -> None:
        def go(f):
            try:
                f.follow(until=until, timeout=timeout)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)

        self.threads = [threading.Thread(target=go, args=(f,)) for f in self.followers]
        for t in self.threads:
            t.start()

    def join(self, timeout: float = 60.0) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a receiver is stuck"


def send_version(store, v, base, old, new, world=2, part_bytes=16 << 10):
    senders = []
    for r in range(world):
        s = TensorSender(old, r, world)
        for n in s.tensors:
            s.tensors[n] = new[n]
        s.stream(store, v, base, part_bytes=part_bytes)
        senders.append(s)
    return senders


def version_bytes(store, v) -> int:
    return sum(len(store.get(k)) for k in store.list(commit.vdir(v)) if k.endswith(".dcr"))
