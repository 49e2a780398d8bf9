"""`nemo-dcr receive --vllm MODEL_DIR`: vLLM's own OpenAI server follows the store while it
serves. Checked over HTTP, as a user would: the server's parameters (digests read through
/collective_rpc, in vLLM's layout) equal those of an engine loaded fresh from the dense export
of the version it reports, and its greedy completion equals that engine's. Stopping the
command stops the server."""

from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (make test-vllm builds .venv-vllm)")

from nemo_dcr_callback.integrations.vllm_serve import rpc  # noqa: E402
from nemo_dcr_callback.protocol import commit  # noqa: E402
from tests.helpers import versions  # noqa: E402
from tests.helpers.vllm_engines import dense_versions, start_engine, stop_engine  # noqa: E402

PROMPT = [1, 5, 9, 33, 2, 71]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(proc) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            if line.startswith("{"):
                q.put(json.loads(line))

    threading.Thread(target=read, daemon=True).start()
    return q


def _next(q: queue.Queue, proc, event: str, timeout: float) -> dict:
    end = time.monotonic() + timeout
    while True:
        try:
            e = q.get(timeout=1.0)
        except queue.Empty:
            assert proc.poll() is None, f"nemo-dcr receive --vllm exited with status {proc.returncode}"
            assert time.monotonic() < end, f"no {event!r} event within {timeout:.0f} s"
            continue
        if e["event"] == event:
            return e


def _complete(base: str, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def test_receive_vllm_serves_and_follows(tmp_path):
    from nemo_dcr_callback.transport.store import FileStore

    states, dirs = dense_versions(tmp_path)
    store = FileStore(tmp_path / "store")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nemo_dcr_callback.cli", "receive", "--store", store.url, "--vllm", str(dirs[0]),
         "--port", str(port), "--json", "--idle-poll-ms", "200", "--id", "rx-vllm",
         "--vllm-args", "--skip-tokenizer-init --dtype bfloat16 --enforce-eager --max-model-len 128 "
                        "--gpu-memory-utilization 0.1 --seed 0"],
        stdout=subprocess.PIPE, text=True)
    try:
        q = _events(proc)
        # registered before the engine is up (it starts for minutes with a large model, and gc
        # keeps only what registered receivers hold: the chaos soak lost an engine's chain so)
        deadline = time.monotonic() + 60
        while "rx-vllm" not in commit.receivers(store) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert q.empty() and commit.receivers(store)["rx-vllm"]["version"] == 0
        # ... as starting: the committer does not count an engine that cannot ack yet
        assert commit.receivers(store)["rx-vllm"].get("starting") is True
        assert _next(q, proc, "ready", 600)["version"] == 0
        for v in (1, 2):
            versions.publish(store, v, v - 1, states[v - 1], states[v])
        while _next(q, proc, "applied", 300)["version"] < 2:
            pass
        assert rpc(base, "dcr_version") == ["2"]  # (non-JSON answers come as strings)
        assert not commit.receivers(store)["rx-vllm"].get("starting")  # following: counted again
        served, tokens = rpc(base, "dcr_param_digests")[0], _complete(base, str(dirs[0]))
        b = start_engine(dirs[2])
        assert served == b.collective_rpc("dcr_param_digests")[0], "parameters differ from a fresh load"
        out = b.generate([{"prompt_token_ids": PROMPT}], vllm.SamplingParams(max_tokens=6, temperature=0),
                         use_tqdm=False)
        assert tokens == list(out[0].outputs[0].token_ids), "the served completion differs from a fresh load"
        stop_engine(b)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    assert rc == 128 + signal.SIGTERM
    with pytest.raises(OSError):  # the server went with it
        urllib.request.urlopen(base + "/health", timeout=5)
