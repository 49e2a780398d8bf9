"""The callback inside NeMo 2's trainer (nemo.lightning.Trainer), from the YAML config with
Hydra overrides, under torchrun: TP 2 x PP 2 on CPU, every version checked bit for bit by a
receiver against the dense export (dcr.verify=true).

nemo-toolkit 2.7 pins lightning 2.4.0 and transformers 4.57, so this runs in its own
environment: `make test-nemo` (.venv-nemo, the [nemo] extra). Elsewhere it is skipped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

nl = pytest.importorskip("nemo.lightning", reason="needs the [nemo] extra: make test-nemo")

from nemo_dcr_callback.launcher import torchrun_cmd  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def test_callback_in_nemo_trainer(tmp_path):
    steps = 3
    cmd = torchrun_cmd(4, [str(REPO / "scripts" / "train.py"), "parallel.tensor_model_parallel_size=2",
                           "parallel.pipeline_model_parallel_size=2", f"trainer.max_steps={steps}", "trainer.cls=nemo",
                           "dcr.verify=true", f"hydra.run.dir={tmp_path}"])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "trainer: nemo.lightning.pytorch.trainer.Trainer" in out, out[-4000:]
    exact = [line for line in out.splitlines() if "the store's chain is bit-exact with the dense export" in line]
    assert len(exact) == steps, out[-4000:]
    assert (tmp_path / "dcr-store" / "versions").is_dir()
    assert sys.modules["nemo.lightning"] is nl
