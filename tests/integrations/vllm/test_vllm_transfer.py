"""`dcr` as vLLM's weight-transfer backend, selected by configuration only
(`weight_transfer_config={"backend": "dcr"}`: the package's `vllm.general_plugins` entry point
registers it; no worker extension), driven by vLLM's own API: `LLM`'s weight-update methods,
and the HTTP routes of two `vllm serve` behind one trainer engine (HTTPClient, a subclass of
vLLM's HTTP client), with requests in flight.

The trainer side is DCRTrainerWeightTransferEngine through vLLM's WeightTransferTrainerFactory,
over vLLM's ModuleSource of a transformers model: it publishes each version (the engine acks
into the joint commit) and has the engine apply it. The oracle for version v is a fresh engine
loaded from v's dense export (`save_pretrained`), with the same configuration: after every
version, vLLM's own weight checksums (SHA-256 of every parameter) are identical, and so are
greedy tokens and logprobs. Bad input (another store, a version not in it, an aborted one, a
corrupt part) is an error and leaves the weights as they were."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vLLM (make test-vllm builds .venv-vllm)")

from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory  # noqa: E402

from nemo_dcr_callback import codec  # noqa: E402
from nemo_dcr_callback.config import CommitPolicy  # noqa: E402
from nemo_dcr_callback.integrations.vllm_transfer import DCRTrainerInitInfo, HTTPClient, LLMClient  # noqa: E402
from nemo_dcr_callback.launcher import free_port  # noqa: E402
from nemo_dcr_callback.protocol import commit  # noqa: E402
from nemo_dcr_callback.sender.named import NamedSender  # noqa: E402
from nemo_dcr_callback.transport.store import FileStore  # noqa: E402
from tests.helpers import versions  # noqa: E402
from tests.helpers.vllm_engines import PROMPTS, dense_versions, generate, stop_engine  # noqa: E402

N = 5
BACKEND = {"backend": "dcr"}
ARGS = dict(skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0,
            gpu_memory_utilization=0.1)


def _engine(model_dir):
    return vllm.LLM(model=str(model_dir), weight_transfer_config=BACKEND, **ARGS)


def _checksums(llm) -> dict[str, str]:
    out = {}
    for part in llm.collective_rpc("compute_weight_checksums"):
        out.update(part)
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """Versions 0..N of a tiny Llama, and for 1..N a fresh engine's checksums and generation."""
    states, dirs = dense_versions(tmp_path_factory.mktemp("dense"), versions=N, adam=1e-6)  # context coding wins
    sums, gens = [None], [None]
    for v in range(1, N + 1):
        b = _engine(dirs[v])
        sums.append(_checksums(b))
        gens.append(generate(b))
        stop_engine(b)
    return states, dirs, sums, gens


def _trainer(dirs, store_url: str, client, context: str = "auto", link_mbit: float | None = None, **kw):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dirs[0], torch_dtype=torch.bfloat16)
    info = DCRTrainerInitInfo(store=store_url, rank=0, **{"receiver_id": "rollout-0", "commit_timeout_s": 120, **kw},
                              context=context, link_mbit=link_mbit)
    return model, WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))


def _corrupt_version(store, staging, v: int, base: int, old, new) -> None:
    """Version v with one part damaged, then committed (no receiver awaited): every engine that
    reads it must refuse it. Written to a staging store and copied in damaged
    (versions.copy_damaged: the engine's background follower would fetch a part damaged in
    place after the write intact first; a CI run saw exactly that)."""
    stage = FileStore(staging)
    s = NamedSender(old)
    s.tensors = dict(new)
    s.write(stage, v, base, s.take())
    versions.copy_damaged(stage, store, v)
    rec = commit.seal_version(store, v, base, 1, timeout=30)
    commit.run_commit(store, rec, CommitPolicy(), expected=[])


def test_llm_follows_through_the_dcr_backend(tmp_path, oracle):
    states, dirs, sums, gens = oracle
    store = FileStore(tmp_path / "store")
    llm = _engine(dirs[0])
    # context-coded chunks (a file store is never behind, so "auto" would code them plain): the
    # engine decodes them from the weights it holds, read back through its loader's copies
    model, trainer = _trainer(dirs, store.url, LLMClient(llm), context="on", link_mbit=100.0)
    assert (trainer.publisher.sender.context, trainer.publisher.sender.link_mbit) == ("on", 100.0)
    assert "rollout-0" in commit.receivers(store)
    for v in range(1, N + 1):
        model.load_state_dict(states[v], strict=False)
        d = trainer.send_weights()
        assert d["committed"] and d["version"] == v and d["acked"] == ["rollout-0"], d
        assert 0 < d["changed"] < d["params"]
        assert llm.get_weight_version() == str(v)
        assert _checksums(llm) == sums[v], f"version {v}: weights differ from a fresh load"
        assert generate(llm) == gens[v], f"version {v}: generation differs from a fresh load"
    assert sum(codec.parse_header(c).classes > 0 for k in store.list("versions") if k.endswith(".dcr")
               for c in codec.split_chunks(store.get(k))) > 0

    # bad input: an error naming it, and the weights as they were
    def refused(call, match):
        with pytest.raises(Exception, match=match):
            call()
        assert _checksums(llm) == sums[N] and generate(llm) == gens[N]

    empty = tmp_path / "empty"
    empty.mkdir()
    refused(lambda: llm.init_weight_transfer_engine({"init_info": {"store": f"file://{empty}"}}),
            "holds no version 0")
    client = LLMClient(llm)

    def update(v):
        client.start_weight_update()
        client.update_weights({"version": v, "timeout_s": 30})

    refused(lambda: update(N + 7), f"version {N + 7} is not in")
    rec_base = N
    s = NamedSender(states[N])
    s.tensors = dict(states[N - 1])
    s.write(store, N + 1, rec_base, s.take())
    commit.seal_version(store, N + 1, rec_base, 1, timeout=30)
    commit.decide(store, N + 1, rec_base, "abort", [], [], "the trainer gave up")
    refused(lambda: update(N + 1), f"version {N + 1} was not committed")
    _corrupt_version(store, tmp_path / "staging", N + 2, rec_base, states[N], states[N - 1])
    refused(lambda: update(N + 2), "checksum|bad magic")  # (where the flipped byte lands)
    stop_engine(llm)


def _post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{path}: HTTP {exc.code}: {exc.read()[:400]!r}") from exc


def _generate(base: str, prompt: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy tokens and their top-2 logprobs through vLLM's token-in, token-out route (the
    OpenAI routes need a tokenizer for logprobs; this model has none)."""
    c = _post(base, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 8, "temperature": 0, "logprobs": 2}})["choices"][0]
    steps = [{x["token_id"]: x["logprob"] for x in [step, *step["top_logprobs"]]} for step in c["logprobs"]["content"]]
    return c["token_ids"], steps


# The API server and the offline engine (the oracle) take different GEMM paths on some CPUs (an
# AMX Xeon): with the same weights (vLLM's checksums, checked first) top-2 logprobs differed by
# up to 4e-5. Tokens must match exactly, logprobs within SERVE_TOL; one version moves them by far
# more (checked), so an engine serving stale weights still fails.
SERVE_TOL = 2e-4


def _close(got, want) -> bool:
    return len(got) == len(want) and all(
        gt == wt and len(gl) == len(wl) and all(a.keys() == b.keys() and all(abs(a[k] - b[k]) <= SERVE_TOL for k in a)
                                                for a, b in zip(gl, wl, strict=True))
        for (gt, gl), (wt, wl) in zip(got, want, strict=True))


def _moved(a, b) -> float:
    """The largest logprob change between two versions' generations, over the tokens both rank."""
    return max(abs(x[k] - y[k]) for (_, al), (_, bl) in zip(a, b, strict=True) for x, y in zip(al, bl, strict=False)
               for k in x.keys() & y.keys())


def _readme_trainer_lines() -> str:
    """The README's trainer lines for vLLM's weight-transfer API, as a user copies them."""
    text = (Path(__file__).parents[3] / "README.md").read_text()
    part = text[text.index("**vLLM's weight-transfer API.**"):]
    return part[part.index("```python\n") + len("```python\n"):part.index("```\n", part.index("```python\n") + 9)]


# What the fresh trainer process runs around the README's lines: `model`, `steps` and
# `train_step` (each step loads the next version's dense checkpoint), and the checks after
# each version (both engines hold it bit for bit, and generate as a fresh engine of it does).
_PRELUDE = '''
import json, sys, torch, urllib.request
from transformers import AutoModelForCausalLM
cfg = json.load(open(sys.argv[1]))
model = AutoModelForCausalLM.from_pretrained(cfg["dirs"][cfg["first"]], torch_dtype=torch.bfloat16)
steps = len(cfg["dirs"]) - 1 - cfg["first"]
held = [cfg["first"]]
results = []

def _post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())

def train_step(model):
    if held[0] > cfg["first"]:
        _check(held[0])
    held[0] += 1
    nxt = AutoModelForCausalLM.from_pretrained(cfg["dirs"][held[0]], torch_dtype=torch.bfloat16)
    model.load_state_dict(nxt.state_dict())

def _check(v):
    results.append({k: d[k] for k in ("version", "committed", "acked", "engines")} | {"checked": v})
    assert d["version"] == v and d["committed"], d
    for base in cfg["bases"]:
        got = _post(base, "/weight_checker", {"action": "compare", "baseline": cfg["sums"][v]})
        assert got == {"match": True, "mismatches": []}, (base, v, got)
'''
_EPILOGUE = '''
_check(held[0])
import vllm.plugins
assert not vllm.plugins.plugins_loaded, "the trainer process loaded vLLM's plugins (an engine was built)"
json.dump(results, open(cfg["out"], "w"))
'''


def test_two_servers_one_trainer_requests_in_flight(tmp_path, oracle):
    """Two real `vllm serve` behind one trainer engine: one started from another checkpoint is
    refused by its own id; the README's trainer lines, run in a fresh process that builds no
    engine, then keep both bit-exact over 4 versions while 32 requests stream from one of them
    (every request completes; requests that crossed an update carry the versions of their
    tokens); with one engine gone, a version does not commit under `wait`."""
    from nemo_dcr_callback.bench import inflight
    from nemo_dcr_callback.integrations.vllm_transfer import EngineError

    states, dirs, sums, gens = oracle
    store = FileStore(tmp_path / "store")
    ports = [free_port(), free_port()]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    # B starts from version 1's checkpoint: it cannot follow from version 0
    procs = [inflight.serve(dirs[v], p, store.url, log=open(tmp_path / f"serve{i}.log", "w"))
             for i, (v, p) in enumerate(zip((0, 1), ports, strict=True))]
    try:
        inflight.wait_up(bases, procs)
        # a server is pinned to its store: another is refused before anything changes. vLLM
        # answers 500 with no message, so the refusal is read from the server's log (any 500
        # passed before), and the weights are checked unchanged.
        other = tmp_path / "other"
        FileStore(other).put("receivers/x.json", b"{}")  # (a store that exists: refused for being another)
        before = _post(bases[0], "/weight_checker", {"action": "checksum"})["checksums"]
        with pytest.raises(AssertionError, match="HTTP 500"):
            _post(bases[0], "/init_weight_transfer_engine", {"init_info": {"store": f"file://{other}"}})
        log0 = (tmp_path / "serve0.log").read_text()
        assert "follows only the store it was started for" in log0, log0[-3000:]
        got = _post(bases[0], "/weight_checker", {"action": "compare", "baseline": before})
        assert before and got == {"match": True, "mismatches": []}, got
        with pytest.raises(EngineError) as err:
            _trainer(dirs, store.url, [HTTPClient(b) for b in bases], receiver_id="rollout")
        assert set(err.value.errors) == {"rollout-1"}, err.value.errors  # B by name; A initialised
        assert "rollout-1" not in commit.receivers(store)

        # A alone takes version 1, which B holds already
        model, trainer = _trainer(dirs, store.url, [HTTPClient(bases[0])], receiver_ids=["rollout-0"])
        model.load_state_dict(states[1], strict=False)
        d = trainer.send_weights()
        assert d["committed"] and d["acked"] == ["rollout-0"], d

        # the README's lines in a fresh process, both engines, while requests stream from A
        cfg = {"dirs": [str(x) for x in dirs], "first": 1, "bases": bases, "sums": sums,
               "out": str(tmp_path / "r.json")}
        (tmp_path / "cfg.json").write_text(json.dumps(cfg))
        lines = (_readme_trainer_lines().replace("s3://bucket/run-1", store.url)
                 .replace("http://rollout-a:8000", bases[0]).replace("http://rollout-b:8000", bases[1]))
        (tmp_path / "trainer.py").write_text(_PRELUDE + lines + _EPILOGUE)
        load = inflight.Load(bases[0], 32, max_tokens=48).start()
        try:
            run = subprocess.run([sys.executable, str(tmp_path / "trainer.py"), str(tmp_path / "cfg.json")],
                                 capture_output=True, text=True, timeout=900)
        finally:
            reqs = load.stop()
        assert run.returncode == 0, run.stderr[-3000:]
        results = json.loads((tmp_path / "r.json").read_text())
        assert [r["checked"] for r in results] == list(range(2, N + 1))
        for r in results:
            assert r["acked"] == ["rollout-0", "rollout-1"] and set(r["engines"]) == {"rollout-0", "rollout-1"}, r
            assert all(e["reset"] is True and e["pause_s"] >= e["apply_s"] > 0 for e in r["engines"].values()), r
        assert reqs and all(r.error is None and r.finish == "length" and len(r.tokens) == 48 for r in reqs), \
            [r.error for r in reqs if r.error][:3]
        crossed = inflight.crossed(reqs)
        assert crossed, "no request was in flight across an update"
        for r in crossed:
            vs = r.version_of_tokens(initial=1)  # (A started from version 0, but took 1 before the load)
            assert len(vs) == 48 and vs == sorted(vs) and 1 <= vs[0] < vs[-1] <= N, r.versions

        # both generate as a fresh engine of version N does (token-in, token-out route)
        moved = [_moved(gens[v], gens[v - 1]) for v in range(2, N + 1)]
        assert min(moved) > 5 * SERVE_TOL, moved  # the tolerance tells versions apart
        want = [(list(t), lp) for t, lp in gens[N]]
        for base in bases:
            got = [_generate(base, p["prompt_token_ids"]) for p in PROMPTS]
            assert _close(got, want), f"{base}: generation differs from a fresh load: {got} {want}"
        with urllib.request.urlopen(bases[1] + "/weight_info", timeout=30) as r:
            assert json.loads(r.read())["weight_version"] == str(N)

        # B gone: under "wait" the next version does not commit (B registered and never acks)
        inflight.stop(procs[1])
        model, trainer = _trainer(dirs, store.url, [HTTPClient(bases[0])], receiver_ids=["rollout-0"],
                                  commit_timeout_s=10)
        model.load_state_dict(states[N - 1], strict=False)
        with pytest.raises(commit.CommitTimeout, match="rollout-1"):
            trainer.send_weights()
        assert commit.read_decision(store, N + 1)["decision"] == "abort"
        got = _post(bases[0], "/weight_checker", {"action": "compare", "baseline": sums[N]})
        assert got == {"match": True, "mismatches": []}, got
    finally:
        for p in procs:
            inflight.stop(p)
