"""launcher.detect(): each launcher's variables, and clear errors for missing or inconsistent
ones (issue 36). Environments are given as dicts here; tests/mpi runs the real launchers."""

from __future__ import annotations

import pytest

from nemo_dcr_callback.launcher import LaunchError, detect, export, first_host

OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4",
         "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[017-018]"}
TORCHRUN = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1",
            "MASTER_PORT": "29600"}


@pytest.mark.parametrize("env,want", [
    ({}, ("single", 0, 1, 0, 1, "127.0.0.1", 29500)),
    (TORCHRUN, ("torchrun", 2, 4, 0, 2, "n1", 29600)),
    (OMPI, ("openmpi", 3, 4, 3, 4, "127.0.0.1", 29500)),
    (MPICH, ("mpich", 1, 2, 1, 2, "127.0.0.1", 29500)),
    ({**SLURM, "MASTER_PORT": "30000"}, ("slurm", 5, 8, 1, 4, "gpu017", 30000)),
    ({**SLURM, **TORCHRUN}, ("torchrun", 2, 4, 0, 2, "n1", 29600)),  # torchrun under srun
])
def test_each_launcher_is_read(env, want):
    le = detect(env)
    assert (le.launcher, le.rank, le.world_size, le.local_rank, le.local_world_size, le.master_addr,
            le.master_port) == want


def test_slurm_port_comes_from_the_job_and_export_writes_torchrun_names():
    le = detect(SLURM)
    assert 20000 <= le.master_port < 40000 and le.master_port == detect(SLURM).master_port
    out: dict = {}
    export(le, out)
    assert out == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "gpu017", "MASTER_PORT": str(le.master_port)}


def test_the_batch_script_itself_is_no_srun_task():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert detect(env).launcher == "single"


@pytest.mark.parametrize("env,names", [
    ({**OMPI, "OMPI_COMM_WORLD_RANK": "4"}, "OMPI_COMM_WORLD_RANK=4"),
    ({**OMPI, "OMPI_COMM_WORLD_SIZE": "four"}, "OMPI_COMM_WORLD_SIZE='four' is not a number"),
    ({k: v for k, v in OMPI.items() if k != "OMPI_COMM_WORLD_SIZE"}, "OMPI_COMM_WORLD_SIZE is not set"),
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "5"}, "OMPI_COMM_WORLD_LOCAL_RANK=5"),
    ({**MPICH, "PMI_SIZE": "0"}, "PMI_SIZE=0"),
    ({"RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE is not set"),
    ({**TORCHRUN, "RANK": "-1"}, "RANK=-1"),
    ({**SLURM, "SLURM_PROCID": "8"}, "SLURM_PROCID=8"),
    ({**{k: v for k, v in SLURM.items() if "NODELIST" not in k}}, "SLURM_STEP_NODELIST"),
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, "MASTER_ADDR is not set"),
    ({**OMPI, "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
])
def test_a_bad_launcher_environment_names_the_variable(env, names):
    with pytest.raises(LaunchError, match=names.replace("(", r"\(").replace("[", r"\[")):
        detect(env)


@pytest.mark.parametrize("nodes,first", [("n1", "n1"), ("gpu[003-005,009],cpu1", "gpu003"),
                                         ("a-1,b-2", "a-1"), ("node[7]", "node7")])
def test_first_host_of_a_slurm_node_list(nodes, first):
    assert first_host(nodes) == first


def test_receiver_ids_take_the_launchers_rank():
    from nemo_dcr_callback.launcher import receiver_id

    assert receiver_id("rx-{rank}-{local_rank}", SLURM) == "rx-5-1"
    assert receiver_id("rx-{rank}", {}) == "rx-0"
    assert receiver_id("plain", SLURM) == "plain"
    with pytest.raises(LaunchError, match="only {rank} and {local_rank}"):
        receiver_id("rx-{host}", SLURM)
    with pytest.raises(LaunchError, match="SLURM_PROCID=8"):
        receiver_id("rx-{rank}", {**SLURM, "SLURM_PROCID": "8"})


def test_the_training_entry_point_stops_on_a_bad_launcher_environment(tmp_path):
    """A real process: scripts/train.py given a rank past the world size exits at once with
    the variable named, no traceback, before any process group would wait for ranks."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({**OMPI, "OMPI_COMM_WORLD_RANK": "4"})
    p = subprocess.run([sys.executable, str(script), f"hydra.run.dir={tmp_path}"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 1 and "OMPI_COMM_WORLD_RANK=4 is not a rank of a world of 4" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_kill_tree_reaches_children_in_sessions_of_their_own():
    """torchrun starts each rank with a session of its own: killing the launcher's process
    group left the ranks training (the chaos soak saw them write a second trainer's versions).
    kill_tree signals the tree, read before anything dies."""
    import subprocess
    import time

    from nemo_dcr_callback.launcher import descendants, kill_tree

    p = subprocess.Popen(["bash", "-c", "setsid sleep 300 & setsid sleep 300 & wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(below := descendants(p.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(below) == 2
    kill_tree(p.pid)
    p.wait(10)

    def running(pid):
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while any(running(x) for x in below) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(x) for x in below)
