"""`nemo-dcr bench receive`, small: every kind of receiver (a state dict, a transformers model
through its own loader, sparse and dense, a checkpoint directory) applies a chain of versions
and holds the sender's dense BF16 tensors after each (the bench checks, and raises otherwise),
with the digests checked; the JSON says so. Timings are the benchmark's, not asserted here."""

from __future__ import annotations

import json

import pytest

from nemo_dcr_callback.bench import receive as bench_receive


def test_every_receiver_kind_ends_bit_exact_with_its_digests_checked(tmp_path):
    out = bench_receive.run(params=1 << 20, versions=2, rounds=1, json_path=str(tmp_path / "r.json"))
    assert set(out["kinds"]) == set(bench_receive.KINDS)
    assert all(k["bit_exact"] and k["digests_checked"] and k["samples"] == 2 for k in out["kinds"].values())
    assert json.loads((tmp_path / "r.json").read_text())["changed_per_version"] == out["changed_per_version"]
    assert min(out["changed_per_version"]) > 0
    with pytest.raises(ValueError, match="unknown receiver kind"):
        bench_receive.run(params=1 << 20, versions=1, rounds=1, kinds=("loader", "vllm"))
