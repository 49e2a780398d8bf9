"""The delta format is fixed: files written by an earlier build still decode to the same bits,
a fresh diff of the same pair writes the same bytes, and files of format version 1 are
refused by name (tests/golden/README.md)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import GOLDEN

CLI = str(Path(sys.executable).parent / "nemo-dcr")
CASES = [("delta_v3.dcr", []), ("delta_v3_span512.dcr", ["--chunk-span", "512"])]
# format 2 differs only in its rANS tables: its files still patch to new/, byte-exact
READABLE = [c[0] for c in CASES] + ["delta_v2.dcr", "delta_v2_span512.dcr"]


def tree(p: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(p.iterdir())}


@pytest.mark.parametrize("name,flags", CASES)
def test_fresh_diff_writes_the_golden_bytes(tmp_path, name, flags):
    out = tmp_path / name
    subprocess.run([CLI, "diff", GOLDEN / "old", GOLDEN / "new", "-o", out, "-q", *flags], check=True)
    assert out.read_bytes() == (GOLDEN / name).read_bytes()


@pytest.mark.parametrize("name", READABLE)
def test_golden_delta_patches_to_new(tmp_path, name):
    out = tmp_path / "out"
    p = subprocess.run([CLI, "patch", GOLDEN / "old", GOLDEN / name, "-o", out], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert tree(out) == tree(GOLDEN / "new")


@pytest.mark.parametrize("name", ["delta_v1.dcr", "delta_v1_span512.dcr"])
def test_version_1_delta_is_refused_by_name(tmp_path, name):
    out = tmp_path / "out"
    p = subprocess.run([CLI, "patch", GOLDEN / "old", GOLDEN / name, "-o", out], capture_output=True, text=True)
    assert p.returncode == 2 and "version 1" in p.stderr and "reads 2" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not out.exists()
