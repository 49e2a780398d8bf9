"""Issue 66, findings 10 and 11: the vLLM server's doors.

10. `receive --vllm` refused `--host`, `--port` and `--uds` inside --vllm-args by their exact
    spelling only, while argparse takes any unambiguous prefix (`--hos 0.0.0.0`, `--por`,
    `--ud`), and vLLM's parser `_` for `-`, `--opt.key` as a part of `--opt`, and `--config
    FILE` as more options: every prefix of the bind flags (and of --config) is refused now.
11. With no NEMO_DCR_VLLM_STORE pin, a caller of the dev-mode routes
    (`init_weight_transfer_engine({"store": "relay://<caller>"})`, /collective_rpc's
    dcr_attach) made the engine send the relay token to the caller's relay, and
    `init_info.model_dir` named any folder (another one failed with a bare KeyError). Now a
    dev-mode server with no pin takes no relay off this machine (the operator's
    NEMO_DCR_VLLM_ANY_STORE=1 lifts it), and model_dir must be the served model's folder.

vLLM is not installed in the base environment these tests run in. The worker extension's
methods run on stand-in workers (they refuse before touching an engine). The `dcr`
weight-transfer engine (integrations/vllm_transfer.py) derives from vLLM's classes, so it is
imported against `_fake_vllm`: stand-in modules with those base classes and factories, and
nothing else; its init is then called on a stand-in engine (`_Engine`) with the attributes it
reads. The checks refuse before any of vLLM would be used.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import types

import pytest

from nemo_dcr_callback.integrations import vllm as dcr_vllm
from nemo_dcr_callback.integrations import vllm_serve
from nemo_dcr_callback.integrations.vllm import DCRWorkerExtension
from tests.helpers.cli import EXE as CLI

DEV = "VLLM_SERVER_DEV_MODE"


# ------------------------------------------------------------------ 10: bind flags under any prefix
def _prefixes(flag: str) -> list[str]:
    return [flag[:n] for n in range(3, len(flag) + 1)]


BIND = [p for f in ("--host", "--port", "--uds") for p in _prefixes(f)]


@pytest.mark.parametrize("flag", BIND + _prefixes("--config"))
def test_every_prefix_of_a_bind_flag_is_refused(flag):
    for args in ([flag, "0.0.0.0"], [f"{flag}=0.0.0.0"], ["--max-model-len", "64", flag, "1"],
                 [f"{flag}.x", "1"]):
        with pytest.raises(vllm_serve.ServeError, match="may not set --(host|port|uds|config)"):
            vllm_serve.check_bind("127.0.0.1", args)


def test_argparse_resolves_these_prefixes_to_the_bind_flags():
    """Why prefixes: a parser with vLLM's neighbouring options takes `--hos`, `--por`, `--ud`
    as the bind flags (allow_abbrev), and every token it resolves so is refused."""
    ap = argparse.ArgumentParser(exit_on_error=False)
    for opt in ("--host", "--port", "--uds", "--headless", "--hf-config-path", "--data-parallel-supervisor-port",
                "--config", "--max-model-len"):
        ap.add_argument(opt)
    assert ap.parse_args(["--hos", "0.0.0.0", "--por", "1", "--ud", "/s"]).host == "0.0.0.0"
    for flag in BIND:
        try:
            ns = ap.parse_args([flag, "x"])
        except (argparse.ArgumentError, SystemExit):
            continue  # ambiguous to argparse: no bind either way
        if "x" in (ns.host, ns.port, ns.uds, ns.config):
            with pytest.raises(vllm_serve.ServeError):
                vllm_serve.check_bind("127.0.0.1", [flag, "x"])


@pytest.mark.parametrize("args", [["--max-model-len", "64"], ["--headless"], ["--data-parallel-supervisor-port", "1"],
                                  ["--hf-config-path", "x"], ["--port-x", "1"], ["--", "--x"], ["-tp", "2"],
                                  ["--tensor-parallel-size=2"]])
def test_other_vllm_arguments_pass(args):
    vllm_serve.check_bind("127.0.0.1", args)


@pytest.mark.parametrize("extra,says", [
    (["--vllm-args", "--hos 0.0.0.0"], "may not set --host (as '--hos')"),
    (["--vllm-args", "--max-model-len 64 --ud=/tmp/s"], "may not set --uds (as '--ud')"),
    (["--hos", "0.0.0.0"], "binds to loopback only"),  # our own --host under argparse's prefix
])
def test_receive_vllm_refuses_prefixed_bind_flags(tmp_path, extra, says):
    p = subprocess.run([CLI, "receive", "--store", f"file://{tmp_path}/store", "--vllm", str(tmp_path), *extra],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stdout + p.stderr


# ------------------------------------------------------------------ 11: the store pin by default
class _Worker:
    """A stand-in vLLM worker: its model_runner names the served model; no engine behind it
    (an AttributeError past the checks means they let the call through)."""

    def __init__(self, model: str):
        self.model_runner = types.SimpleNamespace(model_config=types.SimpleNamespace(model=model))


@pytest.fixture
def dev(monkeypatch):
    """A server exposing the dev-mode routes, started with no store pin."""
    monkeypatch.setenv(DEV, "1")
    for env in (vllm_serve.STORE_ENV, vllm_serve.ANY_STORE_ENV, vllm_serve.SERVED_DIR_ENV):
        monkeypatch.delenv(env, raising=False)


@pytest.mark.parametrize("store", ["relay://attacker.example:7000", "relays://10.0.0.9:443",
                                   "relay://127.0.0.1:7000,relay://attacker.example:7000", "relay://[::]:7000",
                                   "relay://0.0.0.0:7000", "relay://[::1", "RELAY://attacker.example:7000"])
def test_a_dev_mode_server_without_a_pin_sends_the_token_to_no_relay_off_this_machine(tmp_path, dev, store):
    with pytest.raises(PermissionError, match="no relay off this machine") as got:
        DCRWorkerExtension.dcr_attach(_Worker(str(tmp_path)), store)
    assert f"{vllm_serve.STORE_ENV}=" in str(got.value)


@pytest.mark.parametrize("store", ["relay://127.0.0.1:7000", "relay://localhost:7000", "relay://[::1]:7000",
                                   "file:///tmp/store", "s3://bucket/run"])
def test_a_dev_mode_server_without_a_pin_follows_local_relays_and_other_stores(tmp_path, dev, store):
    with pytest.raises(AttributeError):  # past the checks: the stand-in has no engine
        DCRWorkerExtension.dcr_attach(_Worker(str(tmp_path)), store)


def test_the_operator_and_the_in_process_engine_are_not_pinned(tmp_path, dev, monkeypatch):
    far = "relay://rollout-relay.example:7000"
    monkeypatch.setenv(vllm_serve.ANY_STORE_ENV, "1")
    with pytest.raises(AttributeError):
        DCRWorkerExtension.dcr_attach(_Worker(str(tmp_path)), far)
    monkeypatch.delenv(vllm_serve.ANY_STORE_ENV)
    monkeypatch.delenv(DEV)  # an `LLM` in its own process: no routes, its caller is the program
    with pytest.raises(AttributeError):
        DCRWorkerExtension.dcr_attach(_Worker(str(tmp_path)), far)


def test_a_pinned_server_follows_only_its_store(tmp_path, dev, monkeypatch):
    monkeypatch.setenv(vllm_serve.STORE_ENV, "relay://rollout-relay.example:7000")
    with pytest.raises(AttributeError):
        DCRWorkerExtension.dcr_attach(_Worker(str(tmp_path)), "relay://rollout-relay.example:7000")
    with pytest.raises(PermissionError, match="only the store it was started for"):
        DCRWorkerExtension.dcr_attach(_Worker(str(tmp_path)), "relay://127.0.0.1:7000")


def test_model_dir_is_the_served_folder_only(tmp_path, dev):
    served, other = tmp_path / "model", tmp_path / "other"
    served.mkdir()
    other.mkdir()
    w = _Worker(str(served))
    with pytest.raises(PermissionError) as got:
        DCRWorkerExtension.dcr_attach(w, "relay://127.0.0.1:7000", model_dir=str(other))
    assert str(other) in str(got.value) and str(served) in str(got.value)
    with pytest.raises(PermissionError, match="only the folder it serves"):
        DCRWorkerExtension.dcr_reload_dense(w, str(other), 0)  # (no NEMO_DCR_VLLM_MODEL_DIR: the engine's model)
    with pytest.raises(AttributeError):
        DCRWorkerExtension.dcr_attach(w, "relay://127.0.0.1:7000", model_dir=str(served / ".." / "model"))


def test_an_engine_in_its_own_program_reloads_any_export(tmp_path, dev, monkeypatch):
    monkeypatch.delenv(DEV)  # (a resync from a newer dense export: the program is the caller)
    with pytest.raises(AttributeError):  # past the check
        DCRWorkerExtension.dcr_reload_dense(_Worker(str(tmp_path / "model")), str(tmp_path / "export-7"), 7)


def test_a_hub_served_model_takes_a_folder_only_outside_dev_mode(dev, monkeypatch, tmp_path):
    with pytest.raises(PermissionError, match=vllm_serve.SERVED_DIR_ENV):
        dcr_vllm.check_model_dir(str(tmp_path), "Qwen/Qwen2-0.5B")
    monkeypatch.delenv(DEV)
    assert dcr_vllm.check_model_dir(str(tmp_path), "Qwen/Qwen2-0.5B") == str(tmp_path)


# ------------------------------------------------------------------ 11: the `dcr` weight-transfer engine
def _generic(name: str) -> type:
    return type(name, (), {"__class_getitem__": classmethod(lambda cls, item: cls),
                           "__init__": lambda self, *a, **k: None})


@pytest.fixture
def _fake_vllm(monkeypatch):
    """Stand-ins for the vLLM modules integrations/vllm_transfer.py imports (vLLM is not in
    this environment): the base classes it derives from and the factories its import
    registers with. Yields the module imported against them; it is forgotten afterwards."""
    wt = types.ModuleType("vllm.distributed.weight_transfer")

    class _Factory:
        @staticmethod
        def register_engine(*args):
            pass

    wt.WeightTransferEngineFactory = wt.WeightTransferTrainerFactory = _Factory
    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    for name in ("TrainerInitInfo", "TrainerWeightTransferEngine", "VLLMWeightSyncClient", "WeightSource",
                 "WeightTransferEngine", "WeightTransferInitInfo", "WeightTransferUpdateInfo"):
        setattr(base, name, _generic(name))
    clients = types.ModuleType("vllm.distributed.weight_transfer.clients")
    clients.HTTPVLLMWeightSyncClient = _generic("HTTPVLLMWeightSyncClient")
    clients.RayVLLMWeightSyncClient = _generic("RayVLLMWeightSyncClient")
    mods = {"vllm": types.ModuleType("vllm"), "vllm.distributed": types.ModuleType("vllm.distributed"),
            "vllm.distributed.weight_transfer": wt, "vllm.distributed.weight_transfer.base": base,
            "vllm.distributed.weight_transfer.clients": clients}
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    name = "nemo_dcr_callback.integrations.vllm_transfer"
    monkeypatch.delitem(sys.modules, name, raising=False)
    mod = importlib.import_module(name)
    yield mod
    sys.modules.pop(name, None)
    import nemo_dcr_callback.integrations as pkg

    pkg.__dict__.pop("vllm_transfer", None)


class _Engine:
    """A stand-in for vLLM's engine object: the attributes init_transfer_engine reads."""

    def __init__(self, model: str):
        self.model_config = types.SimpleNamespace(model=model)
        self.parallel_config = types.SimpleNamespace(data_parallel_size=1)
        self.model = None
        self.weights = None


def test_init_weight_transfer_engine_sends_the_token_to_no_relay_off_this_machine(_fake_vllm, dev, tmp_path):
    info = _fake_vllm.DCRInitInfo(store="relay://attacker.example:7000", receiver_id="r")
    with pytest.raises(PermissionError, match="no relay off this machine"):
        _fake_vllm.DCRWeightTransferEngine.init_transfer_engine(_Engine(str(tmp_path)), info)


def test_init_weight_transfer_engine_reads_only_the_served_folder(_fake_vllm, dev, tmp_path):
    served, other = tmp_path / "model", tmp_path / "other"
    served.mkdir()
    other.mkdir()
    info = _fake_vllm.DCRInitInfo(store="relay://127.0.0.1:7000", model_dir=str(other))
    with pytest.raises(PermissionError) as got:
        _fake_vllm.DCRWeightTransferEngine.init_transfer_engine(_Engine(str(served)), info)
    assert f"init_info.model_dir {str(other)!r}" in str(got.value) and str(served) in str(got.value)
