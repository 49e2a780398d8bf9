"""The Publisher in real torchrun training (TP 2 on CPU, gloo; tests/sender/s3_publish_worker.py)
on a real S3 server (SeaweedFS, the `seaweed` fixture) with the abort policy: an aborted
version restores every rank's baselines bit for bit, and the versions after it commit and
reach a receiver bit-exact with the dense export."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from nemo_dcr_callback.protocol import commit

WORKER = Path(__file__).with_name("s3_publish_worker.py")


@pytest.mark.parametrize("worker", ["process", pytest.param("thread", marks=pytest.mark.slow)])  # (make test: one)
def test_training_abort_restores_baselines_then_commits(seaweed, tmp_path, worker):
    """torchrun, 2 ranks (TP 2), the Publisher on S3 with the abort policy: a registered
    receiver that never acks makes version 1 abort, and every rank's baselines are back at
    version 0 bit for bit; then a live receiver acks versions 2 and 3, which commit (2 on
    base 0), and it ends bit-exact with the dense export. With the worker as a process (the
    default: deltas through shared memory) and as a thread (the deltas handed over as they are)."""
    from nemo_dcr_callback.launcher import torchrun_cmd

    env = {**os.environ, **seaweed.env()}
    url = seaweed.url(f"{seaweed.bucket}/training-abort-{worker}")
    cmd = torchrun_cmd(2, [str(WORKER), url, worker])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "baselines restored bit-exact on 2 ranks" in out, out[-3000:]
    assert "receiver bit-exact with the dense export at version 3" in out, out[-3000:]
    store = seaweed.store(f"training-abort-{worker}")
    assert commit.read_decision(store, 1)["decision"] == "abort"
    assert commit.read_decision(store, 2)["decision"] == "commit" and commit.read_record(store, 2)["base"] == 0
    assert commit.read_decision(store, 3)["acked"] == ["rollout-0"]
