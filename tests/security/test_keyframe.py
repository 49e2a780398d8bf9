"""Issue 38, finding 10: a corrupt keyframe made `receive` print a SafetensorError traceback.
A keyframe is now parsed and checked against its record's digests before a receiver starts
from it: a clear error naming the key, exit 2, nothing loaded. The damage is made at rest
(written to the store's files directly: history objects are create-only through its API)."""

from __future__ import annotations

import subprocess

import pytest
import torch
from safetensors.torch import save

from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.protocol.rebuild import KeyframeError, load_keyframe
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.cli import EXE as CLI


def _store(tmp_path) -> tuple[FileStore, dict]:
    s = FileStore(tmp_path / "store")
    tensors = {"a": torch.arange(64, dtype=torch.bfloat16), "b": torch.ones(8, 8, dtype=torch.bfloat16)}
    commit.write_keyframe(s, 0, tensors, config_json="{}")
    return s, tensors


def _damaged(tensors: dict, how: str) -> bytes:
    if how == "garbage":
        return b"\x00" * 40
    if how == "truncated":
        return save(tensors)[:-10]
    changed = dict(tensors, b=tensors["b"].clone())
    changed["b"][0, 0] = 2.0  # a valid file with other weights
    return save(changed)


@pytest.mark.parametrize("how", ["garbage", "truncated", "replaced"])
def test_receive_refuses_a_corrupt_keyframe_clearly(tmp_path, how):
    s, tensors = _store(tmp_path)
    load_keyframe(s, 0)  # the honest keyframe passes
    (s.root / keys.keyframe_model(0)).write_bytes(_damaged(tensors, how))
    with pytest.raises(KeyframeError, match="keyframe/0000000000/model.safetensors"):
        load_keyframe(s, 0)
    p = subprocess.run([CLI, "receive", "--store", s.url, "--until", "0"], capture_output=True, text=True,
                       timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out, out
    assert keys.keyframe_model(0) in p.stderr, out
