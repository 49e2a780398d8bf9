"""Issue 67: a receiver started against a failing store retries until its timeout.

`nemo-dcr receive` read the store's keyframes outside its retry loop: one 5xx at start-up
ended it (the long soak's rx-hf exited 2 on "list ... keyframe ... answered 500"). Here the
receiver's store is a real relay whose parent, another relay, is not listening for the first
10 s: every request the receiver makes answers 503 until then. It must start once the parent
is up, well within its timeout, holding the keyframe's version.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import torch

from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.cli import EXE as CLI
from tests.helpers.relay_process import start_relay

DOWN_S = 10.0


def _tiny_llama_keyframe(store: FileStore) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    commit.write_keyframe(store, 0, {k: v.contiguous() for k, v in model.state_dict().items()
                                     if k != "lm_head.weight" or not cfg.tie_word_embeddings},
                          config_json=json.dumps(cfg.to_dict()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_receiver_starts_once_its_store_recovers(tmp_path):
    origin = tmp_path / "origin"
    _tiny_llama_keyframe(FileStore(origin))
    port = _free_port()
    env = {"NEMO_DCR_RELAY_TOKEN": "retry-token"}
    # the receiver's relay: its parent (relay://...:port) answers nothing yet
    p = subprocess.Popen([sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent",
                          f"relay://127.0.0.1:{port}", "--no-prefetch"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env={**os.environ, **env})
    parent = None
    try:
        line = p.stdout.readline()
        assert "listening on" in line, line + (p.stdout.read() if p.poll() is not None else "")
        front_url = line.split("listening on ")[1].split()[0]
        t0 = time.monotonic()
        rx = subprocess.Popen([CLI, "receive", "--store", front_url, "--until", "0", "--timeout", "60"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **env})
        time.sleep(DOWN_S)
        assert rx.poll() is None, rx.communicate()  # still retrying (it exited on the first 503)
        parent, _ = start_relay(origin, env, "--listen", f"127.0.0.1:{port}")
        out, err = rx.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        for proc in (p, parent):
            if proc is not None:
                proc.kill()
                proc.wait()
    assert rx.returncode == 0, (out, err)
    assert "holding version 0" in out and "store unavailable at start-up" in err, (out, err)
    assert err.count("store unavailable") == 1, err  # said once, not once per retry
    assert DOWN_S <= took < 60, took
