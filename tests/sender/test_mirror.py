"""The publisher worker's context copy (sender/mirror.py): it follows every version it encodes
and goes back to whatever base the trainer rebases on (an abort, a failed upload), bit for
bit; a base it cannot reach turns context coding off instead of coding from wrong bits."""

from __future__ import annotations

import torch

from nemo_dcr_callback.sender.mirror import Mirror

KEY = ("decoder.layers.0.mlp.linear_fc1.weight", "model.layers.0.mlp.up_proj.weight")


def _mirror():
    g = torch.Generator().manual_seed(0)
    v0 = torch.randint(-2**15, 2**15, (64,), generator=g, dtype=torch.int32).to(torch.int16)
    return Mirror({KEY: (100, v0.clone())}, version=0), v0


def _version(m: Mirror, v: int, base: int, seed: int, ok: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m.begin(v, base)
    rel = torch.randperm(64, generator=g)[:9].sort().values
    m.advance(KEY, rel, torch.randint(-2**15, 2**15, (9,), generator=g, dtype=torch.int32).to(torch.int16))
    m.end(ok)
    return m.get(*KEY)[1].clone()


def test_it_follows_versions_and_goes_back_to_an_earlier_base():
    m, v0 = _mirror()
    v1 = _version(m, 1, 0, 1)
    assert not torch.equal(v1, v0)
    _version(m, 2, 1, 2)
    _version(m, 3, 2, 3)
    m.settle(1, "commit")
    m.settle(2, "abort")  # 2 aborted, and 3 (on it) with it: the trainer rebases on 1
    _version(m, 4, 1, 4)
    m.begin(5, 1)  # back to 1 again (4 aborted too)
    assert torch.equal(m.get(*KEY)[1], v1) and m.version == 1
    m.end(True)


def test_a_version_that_fails_part_way_is_taken_back():
    m, v0 = _mirror()
    _version(m, 1, 0, 1, ok=False)
    assert torch.equal(m.get(*KEY)[1], v0) and m.version == 0


def test_a_base_it_cannot_reach_turns_context_coding_off(capsys):
    m, _ = _mirror()
    _version(m, 1, 0, 1)
    m.settle(1, "commit")  # 1's undo dropped: version 0 cannot be reached again
    m.begin(2, 0)
    assert m.get(*KEY) is None
    assert "context coding is off" in capsys.readouterr().err
