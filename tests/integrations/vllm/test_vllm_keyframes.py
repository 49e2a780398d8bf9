"""Issue 47, item 0: a vLLM engine (CPU build) starts from the keyframe the training recipe
publishes, with no hand edits, for the families engines refused before: qwen3 (config.json said
llama while the checkpoint held q_norm/k_norm) and qwen3_moe (no `architectures`: vLLM took its
pooling path). Attaching the worker extension at version 0 checks every weight the engine
holds against the keyframe record's digests (the dense export's): bit for bit, through vLLM's
own loader. transformers' side of the same keyframes: tests/recipes/test_keyframe_families.py."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (make test-vllm builds .venv-vllm)")

from nemo_dcr_callback.transport.store import FileStore  # noqa: E402
from tests.helpers.keyframes import publish_keyframe  # noqa: E402
from tests.helpers.vllm_engines import generate, start_engine, stop_engine  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_an_engine_starts_from_the_recipe_keyframe(tmp_path, family):
    folder = publish_keyframe(tmp_path, family)
    llm = start_engine(folder, max_model_len=16)
    try:
        store = FileStore(tmp_path / "store")
        assert llm.collective_rpc("dcr_attach", args=(store.url,)) == [0]  # digests checked: bit-exact
        out = generate(llm)
        assert all(len(tokens) == 8 for tokens, _ in out)
    finally:
        stop_engine(llm)
