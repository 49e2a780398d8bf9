"""The README's main job, end to end: torchrun training (TP 2 x PP 2, CPU) publishing to a
file:// store and a receiver process following it with a transformers model; every version
must be bit-exact with the dense export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_end_to_end(tmp_path):
    exe = Path(sys.executable).parent / "nemo-dcr"
    p = subprocess.run([str(exe), "demo", "--steps", "3", "--workdir", str(tmp_path)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = [line for line in p.stdout.splitlines() if line.strip().endswith("bit-exact")]
    assert len(rows) == 3, p.stdout
    assert "demo ok" in p.stdout
    assert (tmp_path / "dcr-store" / "versions" / "0000000003" / "VERSION.json").exists()
