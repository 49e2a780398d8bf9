"""Launching torchrun on this host (gloo on CPU) for the demo, benchmarks and tests."""

from __future__ import annotations

import socket
import sys


def free_port() -> int:
    """A free TCP port on the loopback interface (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, target: list[str]) -> list[str]:
    """The command running target (a script path, or "-m", module) under torchrun with nproc
    local processes, rendezvous on a free loopback port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), *target]
