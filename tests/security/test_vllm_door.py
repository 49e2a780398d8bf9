"""Issue 46, finding 3: `receive --vllm` opened vLLM's dev-mode endpoints with no
authentication. /collective_rpc calls any worker method (vLLM's --api-key guards only /v1):
whoever reached the port could attach the workers to their own store (which then got the
fleet's relay token and served their weights), reload any folder or detach the engine.

Now the server binds to loopback only (another --host, or --host/--port inside --vllm-args,
are refused before anything starts: these run without vLLM), and the workers take only the
store and the folder they were started for. The worker checks run on the extension class
itself: no engine is needed to call them, and they refuse before touching the engine."""

from __future__ import annotations

import subprocess

import pytest

from nemo_dcr_callback.integrations import vllm_serve
from nemo_dcr_callback.integrations.vllm import DCRWorkerExtension
from tests.helpers.cli import EXE as CLI


@pytest.mark.parametrize("extra,says", [
    (["--host", "0.0.0.0"], "binds to loopback only"),
    (["--host", "10.1.2.3"], "binds to loopback only"),
    (["--host", "::"], "binds to loopback only"),
    (["--vllm-args", "--host 0.0.0.0"], "may not set --host"),
    (["--vllm-args", "--max-model-len 64 --host=0.0.0.0"], "may not set --host"),
    (["--vllm-args", "--port 9999"], "may not set --port"),
])
def test_receive_vllm_refuses_to_listen_beyond_loopback(tmp_path, extra, says):
    p = subprocess.run([CLI, "receive", "--store", f"file://{tmp_path}/store", "--vllm", str(tmp_path), *extra],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stdout + p.stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "localhost", "::1"])
def test_loopback_binds_are_allowed(host):
    vllm_serve.check_bind(host, ["--max-model-len", "64"])


class _Bare:
    """No engine: the checks must refuse before the extension touches one (an AttributeError
    here would mean it got further)."""


def test_a_served_engine_attaches_only_to_its_store(monkeypatch):
    monkeypatch.setenv(vllm_serve.STORE_ENV, "relay://rollout-relay:7000")
    monkeypatch.delenv(vllm_serve.ANY_STORE_ENV, raising=False)
    with pytest.raises(PermissionError, match="only the store it was started for"):
        DCRWorkerExtension.dcr_attach(_Bare(), "relay://attacker:7000")
    monkeypatch.setenv(vllm_serve.ANY_STORE_ENV, "1")  # the operator's opt-in: the check passes
    with pytest.raises(AttributeError):
        DCRWorkerExtension.dcr_attach(_Bare(), "relay://elsewhere:7000")


def test_a_served_engine_reloads_only_its_own_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_serve.SERVED_DIR_ENV, str(tmp_path / "model"))
    with pytest.raises(PermissionError, match="only the folder it serves"):
        DCRWorkerExtension.dcr_reload_dense(_Bare(), "/etc", 0)
    with pytest.raises(PermissionError):
        DCRWorkerExtension.dcr_reload_dense(_Bare(), str(tmp_path / "model" / ".." / "other"), 0)
