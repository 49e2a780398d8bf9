"""The callback inside NeMo 2's trainer (nemo.lightning.Trainer), from the YAML config with
Hydra overrides, under torchrun: TP 2 x PP 2 on CPU, every version checked bit for bit by a
receiver against the dense export (dcr.verify=true).

nemo-toolkit 2.7 pins lightning 2.4.0 and transformers 4.57, so this runs in its own
environment: `make test-nemo` (.venv-nemo, the [nemo] extra). Elsewhere it is skipped.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

nl = pytest.importorskip("nemo.lightning", reason="needs the [nemo] extra: make test-nemo")

from nemo_dcr_callback.launcher import torchrun_cmd  # noqa: E402
from nemo_dcr_callback.transport.store import FileStore  # noqa: E402
from tests.helpers import REPO, training  # noqa: E402


def test_callback_in_nemo_trainer(tmp_path):
    steps = 3
    cmd = torchrun_cmd(4, [str(REPO / "scripts" / "train.py"), "parallel.tensor_model_parallel_size=2",
                           "parallel.pipeline_model_parallel_size=2", f"trainer.max_steps={steps}", "trainer.cls=nemo",
                           "dcr.verify=true", f"hydra.run.dir={tmp_path}"])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "trainer: nemo.lightning.pytorch.trainer.Trainer" in out, out[-4000:]
    done = training.verified(out)
    assert [v for v, _, _ in done] == list(range(1, steps + 1)), out[-4000:]
    # bit-exact alone would pass with frozen weights: every version changed elements, as the
    # verify replay counted them and as the store's version records say
    assert all(c > 0 for _, _, c in done), done
    assert (tmp_path / "dcr-store" / "versions").is_dir()
    assert all(c > 0 for c in training.changed(FileStore(tmp_path / "dcr-store"), range(1, steps + 1)).values())
    assert sys.modules["nemo.lightning"] is nl
