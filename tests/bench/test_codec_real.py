"""The real-gradient corpus and `bench codec --real`'s rows, on a model small enough for
`make test` (the benchmark itself runs the full-size corpus). The oracle for every round trip
is the new BF16 tensors: pair_row raises unless decode and apply land on them bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.bench import codec_real, corpus
from nemo_dcr_callback.protocol import commit, keys


@pytest.fixture(scope="module")
def moe_pairs():
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=16,
                         num_experts_per_tok=2, vocab_size=512, max_position_embeddings=128,
                         tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
    return corpus.pairs("moe", (0.01, 0.04), steps=2, config=cfg)


def test_corpus_pairs_are_real_steps_at_the_target_rates(moe_pairs):
    assert [p.target for p in moe_pairs] == [0.01, 0.04]
    for p in moe_pairs:
        assert set(p.old) == set(p.new) and len(p.old) > 96  # 2 layers x 16 experts x 3, plus the rest
        assert any(".mlp.experts.15.down_proj.weight" in n for n in p.old)
        assert all(t.dtype == torch.bfloat16 for t in p.new.values())
        assert abs(p.rate - p.target) < 0.5 * p.target, (p.rate, p.target)


def test_whole_file_rows_beat_the_bound_and_land_bit_exact(moe_pairs, tmp_path):
    row = codec_real.pair_row(moe_pairs[1], tmp_path, reps=1)
    assert row["plain"]["whole_vs_xor_bound"] > 0.9
    assert row["context"]["bytes"] <= row["plain"]["bytes"]
    assert row["conditional_bytes"] < row["xor_bound_bytes"]
    assert row["plain"]["payload_bytes"] < row["plain"]["bytes"]


def test_refit_row_counts_what_a_receiver_downloads(moe_pairs, tmp_path):
    """refit_row's byte counts against an independent count of the store it wrote: the files
    on disk a receiver downloads (parts, rank manifests, the record, the decision), the parts'
    sizes as the manifests list them, and the payload as the chunks' stream tables declare it
    (refit_row subtracts the headers it parsed from the part bytes)."""
    r = codec_real.refit_row(moe_pairs[0], tmp_path)
    vdir = tmp_path / "store" / commit.vdir(1)
    parts = sorted(vdir.glob("rank-*/part-*.dcr"))
    manifests = sorted(vdir.glob("rank-*.json"))
    records = [vdir / keys.VERSION_FILE, vdir / keys.DECISION_FILE]
    assert parts and len(manifests) == 1 and all(f.is_file() for f in records)
    size = lambda fs: sum(f.stat().st_size for f in fs)  # noqa: E731
    assert r["version_bytes"] == size(parts) + size(manifests) + size(records)
    assert r["manifest_and_record_bytes"] == size(manifests) + size(records)
    listed = [p for f in manifests for p in json.loads(f.read_bytes())["parts"]]
    assert sorted(p["key"] for p in listed) == sorted(str(f.relative_to(tmp_path / "store")) for f in parts)
    assert sum(p["bytes"] for p in listed) == size(parts)
    chunks = [c for f in parts for c in codec.split_chunks(f.read_bytes())]
    payload = sum(stored for c in chunks for _, stored, _ in codec.parse_header(c).streams)
    assert r["chunk_payload_bytes"] == payload > 0
    assert r["chunk_header_bytes"] == size(parts) - payload
    assert r["non_payload_fraction"] == (r["version_bytes"] - payload) / r["version_bytes"]
    assert 0 < r["non_payload_fraction"] < 1
