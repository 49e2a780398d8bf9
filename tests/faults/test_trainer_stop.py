"""A training job stops when asked, and a rank whose peer died leaves: both within
trainer.stop_grace_s (20 s), from the worst place, a step blocked on back-pressure.

Found by the chaos soak: the recipe's ranks ignored SIGTERM (Lightning, seeing a world of one
under SingleDeviceStrategy, acts on it only at an epoch's end), so torchrun's SIGKILL ended
every stop 30 s later, and a survivor of a killed peer waited as long in the step's publish
for decisions that could not come. Real torchrun (TP 2), the recipe, the callback and a file
store. A registered receiver that never acks, under the `wait` policy with one version of
room, holds every step after the first in publish(): the state the soak's kills found."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from nemo_dcr_callback.launcher import descendants, kill_tree, torchrun_cmd
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.recipes.stop import StopConfig
from nemo_dcr_callback.transport.store import FileStore

MODEL = ["parallel.tensor_model_parallel_size=2", "model.num_layers=2", "model.hidden_size=64",
         "model.ffn_hidden_size=176", "model.num_attention_heads=2", "model.num_query_groups=1",
         "model.vocab_size=256", "model.seq_length=16"]
GRACE_S = StopConfig.grace_s  # the stated time: the recipe's default


def _blocked_job(tmp_path):
    """torchrun, its two ranks (by rank), the log: once both ranks wait in publish()."""
    store = FileStore(tmp_path / "store")
    commit.register(store, "never-acks", 0)
    cmd = torchrun_cmd(2, ["-m", "nemo_dcr_callback.recipes.train", *MODEL, "trainer.max_steps=1000",
                           f"dcr.store=file://{tmp_path / 'store'}", "dcr.commit_policy=wait", "dcr.ack_timeout=600",
                           "dcr.max_pending_bytes=1", f"hydra.run.dir={tmp_path / 'run'}"])
    log_path = tmp_path / "train.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 240
    while commit.read_record(store, 1) is None:  # version 1 sealed: both ranks are past it
        assert job.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(2.0)  # step 2 runs, and its publish waits for room
    assert commit.read_decision(store, 1) is None and 2 not in commit.list_versions(store)
    ranks = sorted(p for p in descendants(job.pid) if _rank_of(p) is not None)
    return job, {_rank_of(p): p for p in ranks}, log_path


def _rank_of(pid: int) -> int | None:
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return None
    if b"recipes.train" not in cmd or b"torch.distributed.run" in cmd:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _wait(job, log_path, limit: float) -> tuple[int, float]:
    t0 = time.monotonic()
    try:
        rc = job.wait(limit + 30)
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            job.wait()
    return rc, time.monotonic() - t0


def test_sigterm_stops_every_rank_within_the_grace_with_status_0(tmp_path, table):
    job, ranks, log_path = _blocked_job(tmp_path)
    assert set(ranks) == {0, 1}, ranks
    for pid in ranks.values():  # as a scheduler's preemption does: each process told
        os.kill(pid, signal.SIGTERM)
    rc, took = _wait(job, log_path, GRACE_S)
    out = log_path.read_text()
    assert rc == 0 and took < GRACE_S, f"rc {rc} after {took:.1f} s\n{out[-3000:]}"
    assert "rank 0: stopped on SIGTERM" in out and "rank 1: stopped on SIGTERM" in out, out[-3000:]
    assert "undecided after" in out  # version 1 left to the next start, which aborts it
    table("SIGTERM to both ranks, each blocked in a step's publish (torchrun TP 2)",
          f"both stop, exit 0 (stated: within trainer.stop_grace_s = {GRACE_S:.0f} s)", took, None)


def test_a_rank_whose_peer_died_leaves_within_the_grace(tmp_path, table):
    job, ranks, log_path = _blocked_job(tmp_path)
    os.kill(ranks[1], signal.SIGKILL)
    rc, took = _wait(job, log_path, GRACE_S)
    out = log_path.read_text()
    # torchrun reports the killed rank (rc 1); the survivor left on its SIGTERM, not its SIGKILL
    assert rc != 0 and took < GRACE_S, f"rc {rc} after {took:.1f} s\n{out[-3000:]}"
    assert "rank 0: stopped on SIGTERM" in out and "forcefully exiting via 9" not in out, out[-3000:]
    table("one rank SIGKILLed while both wait in a step's publish (torchrun TP 2)",
          f"the survivor leaves on torchrun's SIGTERM (stated: within {GRACE_S:.0f} s; before: torchrun's "
          "SIGKILL at 30 s)", took, None)
