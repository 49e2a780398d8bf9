"""A write the store acknowledged and then lost does not stall training.

Found by the chaos soak (seed 1, `make soak`): S3 killed right after it acknowledged rank 1's
manifest of a version lost it. Rank 0's seal timed out on it, and its worker then failed that
version and every later one without writing a decision, while rank 1 waited for the decisions
(up to seal + commit + patience timeouts, 396 s) and rank 0 waited for rank 1 in the next
step: the job stood still for minutes. Now rank 0 aborts a version it cannot decide, and
training goes on as after any abort. Real torchrun (TP 2), the recipe and its callback, the
real S3 server behind the fault proxy, which answers rank 1's manifest PUT of one version with
200 and drops it; the oracle for the chain is the trainer's dense export of its last version."""

from __future__ import annotations

import os
import re
import subprocess
import time

from safetensors.torch import load

from nemo_dcr_callback.launcher import kill_tree, torchrun_cmd
from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.protocol.rebuild import reconstruct
from tests.helpers.tensors import same_bits

MODEL = ["parallel.tensor_model_parallel_size=2", "model.num_layers=2", "model.hidden_size=64",
         "model.ffn_hidden_size=176", "model.num_attention_heads=2", "model.num_query_groups=1",
         "model.vocab_size=256", "model.seq_length=16", "optimizer.lr=1e-3"]
STEPS, LOST = 20, 3
SEAL_S = 5.0


def test_a_lost_manifest_aborts_its_version_and_training_goes_on(seaweed, proxy, tmp_path, table):
    prefix = "lost-write"
    direct = seaweed.store(prefix)
    url = f"s3://{seaweed.bucket}/{prefix}?endpoint={proxy.endpoint}"
    manifest = keys.rank_manifest(LOST, 1)
    rule = proxy.add(method="PUT", path=re.escape(manifest) + "$", action="lose", times=1)
    env = {**os.environ, **seaweed.env(), "AWS_ENDPOINT_URL_S3": proxy.endpoint, "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = torchrun_cmd(2, ["-m", "nemo_dcr_callback.recipes.train", *MODEL, f"trainer.max_steps={STEPS}",
                           "trainer.min_step_s=0.5", f"dcr.store='{url}'", "dcr.export_every=1",
                           f"dcr.seal_timeout={SEAL_S}", f"hydra.run.dir={tmp_path / 'run'}"])
    log_path = tmp_path / "train.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        trainer = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = trainer.wait(240)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if trainer.poll() is None:
                kill_tree(trainer.pid)
                trainer.wait()
    took = time.monotonic() - t0
    out = log_path.read_text()
    assert rule.hits == 1, f"the manifest PUT {manifest} was never lost"
    assert rc == 0, f"rc {rc} after {took:.0f} s\n{out[-4000:]}"
    d = commit.read_decision(direct, LOST)
    assert d is not None and d["decision"] == "abort" and "could not decide it" in d["reason"], d
    assert "rank manifests missing" in d["reason"] and manifest in d["reason"], d  # named, as it was
    states = {v: (commit.read_decision(direct, v) or {}).get("decision") for v in commit.list_versions(direct)}
    last = max(v for v, s in states.items() if s == "commit")
    assert last > LOST and states[last] == "commit", states
    oracle = load(direct.get(commit.verify_key(last)))
    assert same_bits(reconstruct(direct, last), oracle)
    table("S3 acknowledges rank 1's manifest of one version and loses it (torchrun TP 2)",
          f"rank 0's seal times out ({SEAL_S:.0f} s): the version aborted, training goes on; the chain bit-exact "
          "with the trainer's dense export", took, None)
