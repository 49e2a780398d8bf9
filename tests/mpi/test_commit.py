"""Issue 36: the joint commit with 4 ranks, each a process started by mpirun. Every rank sends
its share of a synthetic policy (canonical tensors split by name) and runs a receiver; rank 0
seals and commits each version once all 4 receivers acked. The oracle is the policy itself:
every receiver must hold its bits exactly, after each version."""

from __future__ import annotations

import threading

import pytest
import torch

from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.testing.tensor_sender import TensorSender
from nemo_dcr_callback.transport.store import FileStore

VERSIONS = 3


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)  # the same on every rank
    base = {f"layer.{i}.w": torch.randn(80, 33, generator=g).to(torch.bfloat16) for i in range(10)}
    out = [base]
    for _ in range(n):
        nxt = {}
        for k, t in out[-1].items():
            x = t.clone()
            m = torch.rand(t.shape, generator=g) < 0.05
            x[m] = (x.float()[m] + 0.01 * torch.randn(int(m.sum()), generator=g)).to(torch.bfloat16)
            nxt[k] = x
        out.append(nxt)
    return out


@pytest.mark.mpi(min_size=4)
def test_joint_commit_of_four_ranks(comm, shared_dir):
    r, world = comm.rank, comm.size
    store = FileStore(f"{shared_dir}/store")
    states = _states(VERSIONS)
    held = {k: t.clone() for k, t in states[0].items()}
    follower = Follower(store, held, receiver_id=f"rx-{r}", poll_s=0.005, decision_timeout=120)
    errors: list[BaseException] = []

    def follow():
        try:
            follower.follow(until=VERSIONS, timeout=180)
        except BaseException as exc:  # noqa: BLE001 - reported below, on every rank
            errors.append(exc)

    t = threading.Thread(target=follow)
    t.start()
    sender = TensorSender(states[0], r, world)
    expected = [f"rx-{i}" for i in range(world)]
    decisions = []
    for v in range(1, VERSIONS + 1):
        sender.tensors = {n: states[v][n] for n in sender.tensors}
        sender.stream(store, v, v - 1, part_bytes=8 << 10)
        d = None
        if r == 0:
            rec = commit.seal_version(store, v, v - 1, world, timeout=60)
            d = commit.run_commit(store, rec, commit.CommitPolicy("wait", 120), expected=expected)
        d = comm.bcast(d, root=0)
        decisions.append(d["decision"])
        (sender.settle if d["decision"] == "commit" else sender.roll_back)()
    t.join(200)
    exact = not t.is_alive() and not errors and all(torch.equal(bits(held[k]), bits(states[-1][k]))
                                                     for k in states[-1])
    everyone = comm.allgather((exact, repr(errors[:1])))
    assert decisions == ["commit"] * VERSIONS
    assert all(ok for ok, _ in everyone), everyone
    if r == 0:
        acks = commit.read_acks(store, VERSIONS)
        assert sorted(acks) == expected and all(a["ok"] for a in acks.values())
        assert commit.read_record(store, VERSIONS)["base"] == VERSIONS - 1


@pytest.mark.mpi(min_size=4)
def test_a_receiver_fleet_started_per_rank_takes_its_ids_from_the_launcher(comm, shared_dir, tmp_path):
    """Each rank starts `nemo-dcr receive --id rx-{rank}` on its own checkpoint directory; the
    CLI reads its id from OpenMPI's variables (inherited), and rank 0 commits only once the
    four receivers rx-0..rx-3 acked. Every directory then holds version 1's bits exactly."""
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    r, world = comm.rank, comm.size
    store = FileStore(f"{shared_dir}/fleet")
    states = _states(1)
    model = tmp_path / f"model-{r}"
    model.mkdir()
    save_file({k: t.contiguous() for k, t in states[0].items()}, str(model / "model.safetensors"))
    cli = str(Path(sys.executable).parent / "nemo-dcr")
    rx = subprocess.Popen([cli, "receive", "--store", store.url, "--model-dir", str(model), "--id", "rx-{rank}",
                           "--follow", "--until", "1", "--timeout", "120", "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sender = TensorSender(states[0], r, world)
    sender.tensors = {n: states[1][n] for n in sender.tensors}
    sender.stream(store, 1, 0, part_bytes=8 << 10)
    d = None
    if r == 0:
        rec = commit.seal_version(store, 1, 0, world, timeout=60)
        d = commit.run_commit(store, rec, commit.CommitPolicy("wait", 120), expected=[f"rx-{i}" for i in range(world)])
    d = comm.bcast(d, root=0)
    out, _ = rx.communicate(timeout=150)
    got = load_file(str(model / "model.safetensors"))
    exact = rx.returncode == 0 and all(torch.equal(bits(got[k]), bits(states[1][k])) for k in states[1])
    everyone = comm.allgather((exact, out[-600:]))
    assert d["decision"] == "commit" and sorted(d["acked"]) == [f"rx-{i}" for i in range(world)], d
    assert all(ok for ok, _ in everyone), everyone
