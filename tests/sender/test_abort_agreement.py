"""After an abort, every rank publishes the next version on the same base (Publisher._agree).

Found by the chaos soak: with TP 2 and the quorum policy, a version aborted for want of acks
left the ranks on different bases, because each learned the decision when its own worker read
it. The next versions were refused at the seal ("ranks disagree": the job stopped), or every
version aborted until the job was restarted (250 in a row). Real training (torchrun, TP 2, the
callback), a real receiver process stopped past the ack timeout: after the abort, versions
commit again, and the receiver ends bit-exact with the dense export of the last one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load, load_file

from nemo_dcr_callback.launcher import kill_tree, torchrun_cmd
from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.tensors import same_bits

MODEL = ["parallel.tensor_model_parallel_size=2", "model.num_layers=2", "model.hidden_size=64",
         "model.ffn_hidden_size=176", "model.num_attention_heads=2", "model.num_query_groups=1",
         "model.vocab_size=256", "model.seq_length=16", "optimizer.lr=1e-3"]


@pytest.mark.slow  # (about 30 s, and its receiver stop is timed: make test-all)
def test_versions_commit_again_after_an_abort_with_tp2(tmp_path):
    store = FileStore(tmp_path / "store")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = torchrun_cmd(2, ["-m", "nemo_dcr_callback.recipes.train", *MODEL, "trainer.max_steps=40",
                           "trainer.min_step_s=0.3", f"dcr.store=file://{tmp_path / 'store'}",
                           "dcr.commit_policy=quorum", "dcr.quorum=1.0", "dcr.ack_timeout=2", "dcr.export_every=1",
                           f"hydra.run.dir={tmp_path / 'run'}"])
    log = open(tmp_path / "train.log", "w")
    trainer = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    rx = None
    try:
        deadline = time.monotonic() + 180
        while not store.exists(keys.keyframe_record(0)):
            assert trainer.poll() is None and time.monotonic() < deadline, (tmp_path / "train.log").read_text()[-3000:]
            time.sleep(0.2)
        model = tmp_path / "model"
        model.mkdir()
        (model / keys.MODEL_FILE).write_bytes(store.get(keys.keyframe_model(0)))
        (model / keys.CONFIG_FILE).write_bytes(store.get(keys.keyframe_config(0)))
        rx = subprocess.Popen([sys.executable, "-m", "nemo_dcr_callback.cli", "receive", "--store", store.url,
                               "--model-dir", str(model), "--id", "rx", "--follow", "--until", "10000",
                               "--timeout", "120"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              start_new_session=True)

        def decided(v):
            return (commit.read_decision(store, v) or {}).get("decision")

        while not any(decided(v) == "commit" and v >= 8 for v in commit.list_versions(store)):
            assert trainer.poll() is None and time.monotonic() < deadline, (tmp_path / "train.log").read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(rx.pid, signal.SIGSTOP)  # past the ack timeout: the next version has no quorum
        time.sleep(5)
        os.killpg(rx.pid, signal.SIGCONT)
        assert trainer.wait(240) == 0, (tmp_path / "train.log").read_text()[-3000:]
        states = {v: decided(v) for v in commit.list_versions(store)}
        aborted = [v for v, d in states.items() if d == "abort"]
        last = max(v for v, d in states.items() if d == "commit")
        assert aborted and last > max(aborted), states  # committing again after the abort
        deadline = time.monotonic() + 60
        while (model / ".nemo-dcr" / "state.json").exists() and f'"version": {last},' not in \
                (model / ".nemo-dcr" / "state.json").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert same_bits(load_file(str(model / keys.MODEL_FILE)), load(store.get(commit.verify_key(last))))
    finally:
        for p in (trainer, rx):
            if p is not None and p.poll() is None:
                kill_tree(p.pid)
                p.wait()
        log.close()
