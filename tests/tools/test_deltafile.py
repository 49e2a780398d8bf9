"""nemo-dcr diff / patch / stats (tools/deltafile.py) as real processes on real safetensors
checkpoints.

The oracle is NEW itself: the patched files must be byte-identical to NEW's files (and load
with the safetensors library to the same tensors). Refusals leave no OUT, no temp files,
and BASE unchanged.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_dcr_callback.core.rawbits import bits
from tests.helpers.cli import CLI, run
from tests.helpers.tensors import perturb, random_tensor


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def tree(p: Path) -> dict[str, str]:
    """Content hashes of a checkpoint: its files by name, or the single file's."""
    return {f.name: sha(f) for f in sorted(p.iterdir())} if p.is_dir() else {"": sha(p)}


def make_pair(tmp: Path, layout: str = "dir", rate: float = 0.03):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": random_tensor((300, 64), torch.bfloat16, g),
        "model.layers.0.self_attn.q_proj.weight": random_tensor((64, 64), torch.bfloat16, g),
        "model.layers.0.input_layernorm.weight": random_tensor((64,), torch.float32, g),
        "model.layers.0.mlp.up_proj.weight": random_tensor((128, 64), torch.float16, g),
        "model.step": torch.tensor(3, dtype=torch.int64),
        "lm_head.weight": random_tensor((300, 64), torch.bfloat16, g),
    }
    new = {k: perturb(v, rate, g) for k, v in tensors.items()}
    old_p, new_p = tmp / "old", tmp / "new"
    if layout == "file":
        save_file(tensors, str(tmp / "old.safetensors"), metadata={"step": "0"})
        save_file(new, str(tmp / "new.safetensors"), metadata={"step": "1"})
        return tmp / "old.safetensors", tmp / "new.safetensors", new
    for d, ts in ((old_p, tensors), (new_p, new)):
        d.mkdir()
        keys = sorted(ts)
        save_file({k: ts[k] for k in keys[:3]}, str(d / "model-00001-of-00002.safetensors"))
        save_file({k: ts[k] for k in keys[3:]}, str(d / "model-00002-of-00002.safetensors"))
        (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (new_p / "generation_config.json").write_text("{}")
    return old_p, new_p, new


@pytest.mark.parametrize("layout", ["file", "dir"])
def test_diff_patch_byte_identical(tmp_path, layout):
    old, new, new_tensors = make_pair(tmp_path, layout)
    before = tree(old)
    delta = tmp_path / "d.dcr"
    run("diff", old, new, "-o", delta)
    out = tmp_path / ("out" if layout == "dir" else "out.safetensors")
    p = run("patch", old, delta, "-o", out)
    assert "verified" in p.stdout
    assert tree(out) == tree(new)
    assert tree(old) == before  # BASE never modified
    files = sorted(out.glob("*.safetensors")) if layout == "dir" else [out]
    loaded = {}
    for f in files:
        loaded.update(load_file(str(f)))
    assert set(loaded) == set(new_tensors)
    for k, v in new_tensors.items():
        assert torch.equal(bits(loaded[k].contiguous()), bits(v.contiguous())), k


@pytest.mark.slow  # (a CLI process each, about 5-12 s: make test keeps the round trips and two refusals)
def test_added_removed_and_retyped_tensors(tmp_path):
    g = torch.Generator().manual_seed(1)
    a = {"x": random_tensor((50,), torch.bfloat16, g), "gone": random_tensor((5,), torch.bfloat16, g),
         "y": random_tensor((10,), torch.bfloat16, g)}
    b = {"x": perturb(a["x"], 0.1, g), "y": random_tensor((10,), torch.float32, g),
         "added": random_tensor((7, 3), torch.float16, g), "empty": torch.zeros(0, 4, dtype=torch.bfloat16)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    run("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "-o", tmp_path / "d")
    run("patch", tmp_path / "a.safetensors", tmp_path / "d", "-o", tmp_path / "c.safetensors")
    assert sha(tmp_path / "c.safetensors") == sha(tmp_path / "b.safetensors")
    st = json.loads(run("stats", tmp_path / "d", "--json").stdout)
    assert st["full_tensors"] == 3 and st["removed_tensors"] == 1


@pytest.mark.slow  # (a CLI process each, about 5-12 s: make test keeps the round trips and two refusals)
def test_stats(tmp_path):
    old, new, _ = make_pair(tmp_path, "dir", rate=0.05)
    run("diff", old, new, "-o", tmp_path / "d.dcr", "-q")
    st = json.loads(run("stats", tmp_path / "d.dcr", "--json").stdout)
    assert st["params"] == 300 * 64 * 2 + 64 * 64 + 64 + 128 * 64 + 1
    assert 0.03 < st["change_rate"] < 0.07
    assert st["ratio_vs_dense"] > 1 and 0 < st["efficiency_vs_xor_bound"]
    # the whole file (manifest and framing included) is below the payload-only figure
    assert st["non_payload_bytes"] > 0 and 0 < st["efficiency_whole_vs_xor_bound"] < st["efficiency_vs_xor_bound"]
    text = run("stats", tmp_path / "d.dcr").stdout
    assert "ratio vs dense" in text and "bits per param" in text and "(whole file)" in text


def _assert_refused(tmp_path, base, delta, match):
    out = tmp_path / "out"
    before = tree(base)
    listing = sorted(p.name for p in tmp_path.iterdir())
    p = run("patch", base, delta, "-o", out, ok=False)
    assert p.returncode != 0
    assert match in p.stderr, p.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no temp files left
    assert tree(base) == before


def _diffed(tmp_path):
    old, new, _ = make_pair(tmp_path)
    d = tmp_path / "d.dcr"
    run("diff", old, new, "-o", d, "-q")
    return old, new, d


def test_corrupt_delta_refused(tmp_path):
    old, new, d = _diffed(tmp_path)
    raw = bytearray(d.read_bytes())
    raw[40] ^= 0x10  # inside the first chunk
    bad = tmp_path / "bad.dcr"
    bad.write_bytes(bytes(raw))
    _assert_refused(tmp_path, old, bad, "checksum")


@pytest.mark.slow  # (a CLI process each, about 5-12 s: make test keeps the round trips and two refusals)
def test_truncated_delta_refused(tmp_path):
    old, new, d = _diffed(tmp_path)
    raw = d.read_bytes()
    for n, msg in [(len(raw) - 3, "truncated"), (10, "truncated"), (len(raw) // 2, "truncated")]:
        bad = tmp_path / f"t{n}.dcr"
        bad.write_bytes(raw[:n])
        _assert_refused(tmp_path, old, bad, msg)


@pytest.mark.slow  # (a CLI process each, about 5-12 s: make test keeps the round trips and two refusals)
def test_corrupt_manifest_refused(tmp_path):
    old, new, d = _diffed(tmp_path)
    raw = bytearray(d.read_bytes())
    raw[-40] ^= 1
    d.write_bytes(bytes(raw))
    _assert_refused(tmp_path, old, d, "manifest checksum")


def test_wrong_base_refused(tmp_path):
    old, new, d = _diffed(tmp_path)
    # NEW as the base: right model, wrong version.
    _assert_refused(tmp_path, new, d, "does not match the delta's base")


@pytest.mark.slow  # (a CLI process each, about 5-12 s: make test keeps the round trips and two refusals)
def test_wrong_model_refused(tmp_path):
    old, new, d = _diffed(tmp_path)
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(3)}, str(other))
    _assert_refused(tmp_path, other, d, "wrong base")


@pytest.mark.slow  # (a CLI process each, about 5-12 s: make test keeps the round trips and two refusals)
def test_wrong_version_refused(tmp_path):
    old, new, d = _diffed(tmp_path)
    raw = bytearray(d.read_bytes())
    raw[4] = 9
    d.write_bytes(bytes(raw))
    _assert_refused(tmp_path, old, d, "version 9")


@pytest.mark.slow  # (a CLI process each, about 5-12 s: make test keeps the round trips and two refusals)
def test_missing_inputs_and_existing_output(tmp_path):
    old, new, _ = make_pair(tmp_path)
    p = run("diff", tmp_path / "nope", new, "-o", tmp_path / "d", ok=False)
    assert p.returncode == 2 and "no such file" in p.stderr
    assert not (tmp_path / "d").exists()
    run("diff", old, new, "-o", tmp_path / "d", "-q")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    p = run("patch", old, tmp_path / "d", "-o", tmp_path / "out", ok=False)
    assert p.returncode == 2 and "exists" in p.stderr
    assert (tmp_path / "out" / "keep").read_text() == "x"
    run("patch", old, tmp_path / "d", "-o", tmp_path / "out", "--force", "-q")
    assert tree(tmp_path / "out") == tree(new)


def test_not_a_checkpoint(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    p = run("diff", junk, junk, "-o", tmp_path / "d", ok=False)
    assert p.returncode == 2 and "header" in p.stderr


def test_without_compiled_kernels(tmp_path):
    """NEMO_DCR_NATIVE=0: the torch/numpy/Python paths write and read the same format."""
    import os
    old, new, _ = make_pair(tmp_path, "file")
    env = dict(os.environ, NEMO_DCR_NATIVE="0")
    d = tmp_path / "d.dcr"
    subprocess.run(CLI + ["diff", str(old), str(new), "-o", str(d), "-q"], check=True, env=env)
    run("patch", old, d, "-o", tmp_path / "a.safetensors", "-q")  # compiled reads it
    run("diff", old, new, "-o", tmp_path / "d2.dcr", "-q")
    subprocess.run(CLI + ["patch", str(old), str(tmp_path / "d2.dcr"), "-o", str(tmp_path / "b.safetensors"), "-q"],
                   check=True, env=env)  # and the reference reads the compiled one's
    assert sha(tmp_path / "a.safetensors") == sha(new) == sha(tmp_path / "b.safetensors")
    assert d.read_bytes() == (tmp_path / "d2.dcr").read_bytes()  # byte-identical encoders
