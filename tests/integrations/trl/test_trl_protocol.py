"""DCRWeightTransfer against a stand-in for vLLM's HTTP routes (no vLLM, no TRL: runs in
`make test`): what it asks the server, in which order, with which arguments, and what it does
when the server refuses. test_trl.py runs it for real with TRL's trainer and vLLM's server."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from nemo_dcr_callback.integrations.trl import DCRWeightTransfer, SyncError
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.transport.store import FileStore


class FakeServer:
    """Records every call as (method, path, query, body) and answers as vLLM 0.32 does;
    `resets` are the successive answers of /reset_prefix_cache, `fail` the routes that answer 500."""

    def __init__(self, backend: str = "dcr") -> None:
        self.calls: list[tuple[str, str, dict, dict | None]] = []
        self.resets: list[bool] = []
        self.fail: set[str] = set()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                url = urllib.parse.urlsplit(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.calls.append((method, url.path, dict(urllib.parse.parse_qsl(url.query)), body))
                if url.path in fake.fail:
                    self.send_response(500)
                    self.end_headers()
                    return
                out = {}
                if url.path == "/server_info":
                    out = {"vllm_config": {"weight_transfer_config": {"backend": backend}}}
                elif url.path == "/reset_prefix_cache":
                    out = {"success": fake.resets.pop(0) if fake.resets else True}
                raw = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:  # noqa: N802 (http.server's names)
                self._answer("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._answer("POST")

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def routes(self) -> list[str]:
        return [path for _, path, _, _ in self.calls]

    def take(self) -> list[tuple[str, str, dict, dict | None]]:
        out, self.calls = self.calls, []
        return out


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.httpd.shutdown()


def _weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(128, generator=g)}
    for t in w.values():
        t[: 8 * step] += 1.0  # each step moves a few values
    return {n: t.to(torch.bfloat16) for n, t in w.items()}


def _sync(transfer: DCRWeightTransfer, step: int) -> None:
    """What TRL's main process does each sync."""
    transfer.pause()
    transfer.send_weights(iter(_weights(step).items()))
    transfer.resume()


def test_pauses_only_to_apply_a_published_version(tmp_path, server):
    store = FileStore(tmp_path / "store")
    t = DCRWeightTransfer(store.url, server.url, engine_store="file:///relay/run")
    assert t.receiver_id == "vllm-127.0.0.1-" + server.url.rsplit(":", 1)[1]  # one id per server
    t.init_weight_transfer()
    assert server.routes() == ["/health", "/server_info"]
    server.take()
    _sync(t, 0)  # the cold sync: keyframe 0 and the engine pointed at it, nothing paused
    assert server.take() == [
        ("POST", "/init_weight_transfer_engine", {},
         {"init_info": {"store": "file:///relay/run", "receiver_id": t.receiver_id, "version": 0}}),
        ("POST", "/update_weight_version", {}, {"new_version": "0"})]
    for v in (1, 2):
        _sync(t, v)
        calls = server.take()
        assert [c[1] for c in calls] == ["/pause", "/start_weight_update", "/update_weights",
                                         "/finish_weight_update", "/reset_prefix_cache", "/resume"]
        assert calls[0][2] == {"mode": "keep"}
        assert calls[2][3] == {"update_info": {"version": v, "timeout_s": 600.0}}
        assert calls[3][3] == {"weight_version": str(v)}
        assert calls[4][2] == {"reset_running_requests": "true"}
        assert (commit.read_decision(store, v) or {}).get("decision") == "commit"
        d = t.history[-1]
        assert d["version"] == v and d["committed"] and 0 < d["changed"] < d["params"]
        assert 0 <= d["apply_s"] <= d["pause_s"] <= d["paused_total_s"]
    t.destroy()
    assert server.take() == []  # (nothing left paused)


def test_reset_is_checked_and_retried(tmp_path, server):
    t = DCRWeightTransfer(FileStore(tmp_path / "store").url, server.url, pause_mode="wait", reset_tries=3)
    _sync(t, 0)
    server.resets = [False, True]
    _sync(t, 1)
    calls = server.take()
    assert [c[1] for c in calls].count("/reset_prefix_cache") == 2 and calls[-1][1] == "/resume"
    assert next(c[2] for c in calls if c[1] == "/pause") == {"mode": "wait"}
    server.resets = [False] * 3
    t.pause()
    with pytest.raises(SyncError, match="version 2 applied.*refused to reset its prefix cache 3 times"):
        t.send_weights(iter(_weights(2).items()))
    assert server.take()[-1][1] == "/reset_prefix_cache"
    t.destroy()  # TRL's train end after the error: the server generates again
    assert server.routes() == ["/resume"]


def test_a_refused_update_ends_the_session_and_raises(tmp_path, server):
    t = DCRWeightTransfer(FileStore(tmp_path / "store").url, server.url)
    _sync(t, 0)
    server.take()
    server.fail = {"/update_weights"}
    t.pause()
    with pytest.raises(SyncError, match="/update_weights .*HTTP 500"):
        t.send_weights(iter(_weights(1).items()))
    calls = server.take()
    assert [c[1] for c in calls] == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert calls[-1][3] is None  # (no weight version: none was applied)
    t.destroy()
    assert server.routes() == ["/resume"]


def test_refuses_a_server_without_the_dcr_backend(tmp_path):
    s = FakeServer(backend="nccl")
    try:
        with pytest.raises(SyncError, match="backend 'nccl'"):
            DCRWeightTransfer(FileStore(tmp_path / "store").url, s.url).init_weight_transfer()
    finally:
        s.httpd.shutdown()
    with pytest.raises(ValueError, match="pause_mode"):
        DCRWeightTransfer("file:///x", s.url, pause_mode="drain")


def test_resumes_on_a_store_with_history(tmp_path, server):
    """A restarted trainer: the engine is pointed at the store's newest committed version, and
    the trainer's weights go out as the next one."""
    store = FileStore(tmp_path / "store")
    first = DCRWeightTransfer(store.url, server.url)
    _sync(first, 0)
    _sync(first, 1)
    server.take()
    again = DCRWeightTransfer(store.url, server.url)
    _sync(again, 3)
    calls = server.take()
    assert calls[0][3]["init_info"]["version"] == 1
    assert [c[1] for c in calls][2:] == ["/pause", "/start_weight_update", "/update_weights",
                                         "/finish_weight_update", "/reset_prefix_cache", "/resume"]
    assert calls[4][3]["update_info"]["version"] == 2 and again.history[-1]["changed"] > 0
