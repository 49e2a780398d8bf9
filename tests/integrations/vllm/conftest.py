"""Every vLLM engine in these tests: results of collective_rpc are dicts of bytes (vLLM's msgpack
encoder falls back to pickle only when allowed), and a small KV cache on CPU."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _vllm_env(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
