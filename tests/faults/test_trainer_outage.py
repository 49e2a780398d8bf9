"""The trainer rides out a store outage shorter than its patience (dcr.store_patience_s).

Found by the chaos soak: S3 killed for a few seconds ended the training job (rc 1) twice,
because a failed upload was raised in the training loop at the next step. Real training
(torchrun, TP 2, the callback), the real S3 server (SeaweedFS) behind the fault proxy, which
answers 500 to every request for 10 s: the job goes on, every version commits (the uploads
wait, and the steps with them), and the store's chain ends bit-exact with the trainer's dense
export of its last version (the oracle: gathered and converted by the trainer, not the delta
path)."""

from __future__ import annotations

import os
import subprocess
import time

from safetensors.torch import load

from nemo_dcr_callback.launcher import kill_tree, torchrun_cmd
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.rebuild import reconstruct
from tests.helpers.tensors import same_bits

MODEL = ["parallel.tensor_model_parallel_size=2", "model.num_layers=2", "model.hidden_size=64",
         "model.ffn_hidden_size=176", "model.num_attention_heads=2", "model.num_query_groups=1",
         "model.vocab_size=256", "model.seq_length=16", "optimizer.lr=1e-3"]
STEPS = 24
OUTAGE_S = 10.0


def test_trainer_survives_a_store_outage_shorter_than_its_patience(seaweed, proxy, tmp_path, table):
    prefix = "trainer-outage"
    direct = seaweed.store(prefix)
    url = f"s3://{seaweed.bucket}/{prefix}?endpoint={proxy.endpoint}"
    env = {**os.environ, **seaweed.env(), "AWS_ENDPOINT_URL_S3": proxy.endpoint, "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = torchrun_cmd(2, ["-m", "nemo_dcr_callback.recipes.train", *MODEL, f"trainer.max_steps={STEPS}",
                           "trainer.min_step_s=0.3", f"dcr.store='{url}'", "dcr.export_every=1",
                           "dcr.store_patience_s=120", f"hydra.run.dir={tmp_path / 'run'}"])
    log_path = tmp_path / "train.log"
    log = open(log_path, "w")
    trainer = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def decided(v):
        return (commit.read_decision(direct, v) or {}).get("decision")

    try:
        deadline = time.monotonic() + 240
        while not any(decided(v) == "commit" for v in commit.list_versions(direct) if v >= 3):
            assert trainer.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        before = max(commit.list_versions(direct))
        rule = proxy.add(method="*", path="", action="status", status=500, code="InternalError", times=-1)
        t0 = time.monotonic()
        time.sleep(OUTAGE_S)
        proxy.clear()
        assert trainer.wait(240) == 0, log_path.read_text()[-4000:]
        took = time.monotonic() - t0
    finally:
        if trainer.poll() is None:
            kill_tree(trainer.pid)
            trainer.wait()
        log.close()
    out = log_path.read_text()
    assert rule.hits > 0, "the outage never hit a request"
    assert "failing" in out and "answering again" in out, out[-3000:]
    versions = commit.list_versions(direct)
    states = {v: decided(v) for v in versions}
    assert versions == list(range(1, STEPS + 1)) and set(states.values()) == {"commit"}, states
    assert before < STEPS  # versions were still to come when the store failed
    last = versions[-1]
    oracle = load(direct.get(commit.verify_key(last)))
    assert same_bits(reconstruct(direct, last), oracle)
    table("store answers 500 to everything for 10 s while training (torchrun TP 2)",
          f"trainer waits (patience 120 s) and goes on; all {STEPS} versions committed; chain bit-exact with the "
          "trainer's dense export", took, None)
