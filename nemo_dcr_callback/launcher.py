"""Which launcher started this process, and its rank, world and rendezvous.

torchrun, `mpirun`/`mpiexec` (OpenMPI or MPICH/Hydra) and Slurm's `srun` each describe a rank
with their own environment variables; torch.distributed's env:// rendezvous (and so Lightning,
megatron-core and the Publisher) reads torchrun's. `detect()` reads whichever launcher's are
there and checks them; `export()` writes torchrun's names, so everything downstream runs
alike under the three. A variable that is missing, not a number, or inconsistent (a rank at
or past the world size) is a LaunchError naming it, before any process group hangs on it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PORT = 29500


class LaunchError(ValueError):
    """A launcher's environment that is incomplete or inconsistent."""


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str  # torchrun | openmpi | mpich | slurm | single
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


# The variables of each launcher: rank, world size, local rank, local world size.
_MPI = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def _int(env: Mapping[str, str], name: str, launcher: str, default: int | None = None) -> int:
    v = env.get(name)
    if v is None or v == "":
        if default is not None:
            return default
        raise LaunchError(f"{launcher}: {name} is not set (the launcher's environment is incomplete)")
    try:
        return int(v)
    except ValueError:
        raise LaunchError(f"{launcher}: {name}={v!r} is not a number") from None


def _check(launcher: str, names: tuple[str, ...], rank: int, world: int, local: int, local_world: int) -> None:
    if world < 1:
        raise LaunchError(f"{launcher}: {names[1]}={world}, must be at least 1")
    if not 0 <= rank < world:
        raise LaunchError(f"{launcher}: {names[0]}={rank} is not a rank of a world of {world} ({names[1]})")
    if not 1 <= local_world <= world:
        raise LaunchError(f"{launcher}: {names[3]}={local_world} does not fit a world of {world}")
    if not 0 <= local < local_world:
        raise LaunchError(f"{launcher}: {names[2]}={local} is not a local rank of {local_world} ({names[3]})")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("gpu[003-005,009],cpu1" -> "gpu003"), as
    `scontrol show hostnames | head -1` gives it, without needing scontrol."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m or not m.group(1):
        raise LaunchError(f"slurm: cannot read a host from the node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _rendezvous(env: Mapping[str, str], launcher: str, world: int, local_world: int) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT where given; else what the launcher tells: Slurm's first node
    and a port from the job id (two jobs on one node do not collide); for a one-node MPI job,
    loopback. A multi-node MPI job must be told (mpirun -x MASTER_ADDR)."""
    port = _int(env, "MASTER_PORT", launcher, default=-1)
    addr = env.get("MASTER_ADDR") or None
    if launcher == "slurm":
        if addr is None:
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            if not nodes:
                raise LaunchError("slurm: neither MASTER_ADDR nor SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is set")
            addr = first_host(nodes)
        if port < 0:
            job = env.get("SLURM_JOB_ID", "")
            port = 20000 + zlib.crc32(job.encode()) % 20000 if job else DEFAULT_PORT
    if addr is None:
        if world != local_world:
            raise LaunchError(f"{launcher}: MASTER_ADDR is not set and the job spans several nodes: "
                              f"set it to rank 0's host (mpirun -x MASTER_ADDR=...)")
        addr = "127.0.0.1"
    if port < 0:
        port = DEFAULT_PORT
    if not 0 < port < 65536:
        raise LaunchError(f"{launcher}: MASTER_PORT={port} is not a port")
    return addr, port


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """This process's rank and rendezvous, from torchrun's, OpenMPI's, MPICH's or Slurm's
    variables (in that order: torchrun started under srun is torchrun's), else a single
    process."""
    env = os.environ if env is None else env
    if any(n in env for n in _TORCHRUN[:3]):
        launcher, names = "torchrun", _TORCHRUN
        rank, world, local = (_int(env, n, launcher) for n in names[:3])
        local_world = _int(env, names[3], launcher, default=world)
    elif mpi := next((k for k, names in _MPI.items() if names[0] in env), None):
        launcher, names = mpi, _MPI[mpi]
        rank, world = _int(env, names[0], launcher), _int(env, names[1], launcher)
        local = _int(env, names[2], launcher, default=rank if mpi == "mpich" else None)
        local_world = _int(env, names[3], launcher, default=world if mpi == "mpich" else None)
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # a task of an srun step (not the batch script)
        launcher = "slurm"
        rank, world, local = (_int(env, n, launcher) for n in _SLURM)
        # SLURM_NTASKS_PER_NODE is absent for uneven layouts; tasks on this node then come
        # from SLURM_STEP_TASKS_PER_NODE ("4(x2),2": this node's share is unknown: 1 + max local)
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", launcher, default=-1)
        if local_world < 0:
            per = env.get("SLURM_STEP_TASKS_PER_NODE", "")
            counts = [int(x) for x in re.findall(r"(\d+)(?:\(x\d+\))?", per)]
            local_world = counts[0] if len(set(counts)) == 1 and counts else max(local + 1, 1)
        names = (*_SLURM, "SLURM_NTASKS_PER_NODE")
    else:
        return LaunchEnv("single", 0, 1, 0, 1, env.get("MASTER_ADDR") or "127.0.0.1",
                         _int(env, "MASTER_PORT", "single", default=DEFAULT_PORT))
    _check(launcher, names, rank, world, local, local_world)
    addr, port = _rendezvous(env, launcher, world, local_world)
    return LaunchEnv(launcher, rank, world, local, local_world, addr, port)


def export(le: LaunchEnv, env: dict | None = None) -> LaunchEnv:
    """Write torchrun's variables for le (torch.distributed's env:// reads them)."""
    env = os.environ if env is None else env
    env.update(RANK=str(le.rank), WORLD_SIZE=str(le.world_size), LOCAL_RANK=str(le.local_rank),
               LOCAL_WORLD_SIZE=str(le.local_world_size), MASTER_ADDR=le.master_addr, MASTER_PORT=str(le.master_port))
    return le


def receiver_id(template: str, env: Mapping[str, str] | None = None) -> str:
    """A receiver id with {rank} and {local_rank} filled in from the launcher ("rx-{rank}" under
    `srun -n 64 nemo-dcr receive --id rx-{rank}`: 64 receivers, each its own id)."""
    if "{" not in template:
        return template
    le = detect(env)
    try:
        return template.format(rank=le.rank, local_rank=le.local_rank)
    except (KeyError, IndexError, ValueError) as exc:
        raise LaunchError(f"receiver id {template!r}: only {{rank}} and {{local_rank}} can be filled in "
                          f"({type(exc).__name__}: {exc})") from None


def setup() -> LaunchEnv:
    """detect() then export(): call first thing in an entry point."""
    return export(detect())


# ------------------------------------------------------------------ starting ranks on this host
def collective_device():
    """Where a small collective's tensor lives: this rank's GPU under NCCL (which takes no CPU
    tensors), the CPU under gloo. The process group must be initialised."""
    # (torch here, not at the top: the launcher runs in processes that never load it, the CLI's)
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


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


def is_loopback(host: str) -> bool:
    """Is `host` (a name, an IPv4 or IPv6 address, bracketed or not) this machine's loopback?
    Services without authentication bind only there."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from Linux's /proc (None once
    it is gone, or elsewhere); the start time tells a process from a later one with its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2:].split()  # (the name in parentheses may hold spaces)
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every live process below pid (Linux's /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    for d in entries:
        if (st := proc_stat(d)) is not None:
            children.setdefault(st[0], []).append(d)
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal pid's process group and every process below pid. torchrun starts each rank in a
    session of its own: a signal to the launcher's group never reaches the ranks, and ranks
    whose launcher was killed train on (publishing into the store a restarted job then uses).
    The tree is read before anything is signalled: an orphan is reparented, and lost."""
    below = descendants(pid)
    for target, group in [(pid, True), *((p, False) for p in below)]:
        try:
            (os.killpg if group else os.kill)(target, sig)
        except (ProcessLookupError, PermissionError):
            pass
