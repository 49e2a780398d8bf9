"""Issue 36: the launcher helper under a real mpirun, against MPI's own view of the world."""

from __future__ import annotations

import socket

import pytest

from nemo_dcr_callback.launcher import detect


@pytest.mark.mpi(min_size=2)
def test_launcher_agrees_with_mpi(comm):
    le = detect()
    assert le.launcher in ("openmpi", "mpich"), le
    assert (le.rank, le.world_size) == (comm.rank, comm.size)
    seen = comm.allgather((socket.gethostname(), le.local_rank, le.local_world_size, le.master_addr,
                           le.master_port))
    assert len({(h, lr) for h, lr, *_ in seen}) == comm.size  # local ranks unique on each host
    assert len({(a, p) for *_, a, p in seen}) == 1  # one rendezvous for all
    hosts = {h for h, *_ in seen}
    assert all(lw == sum(1 for h2, *_ in seen if h2 == h) for h, _, lw, *_ in seen) or len(hosts) > 1
