"""A vLLM engine (the CPU build) refitted three ways, per version (issue 33): DCR (fetch and
decode in the worker's background, then the in-place apply through the model's load_weights:
the pause), a dense in-place reload of the same weights through load_weights, and vLLM's own
load_checkpoint_weight_patches (NaN-masked sparse patches) on the same versions. On CPU vLLM
repacks linear weights after each; that time is its own column (a GPU has none). `lines` is
the share of 64-byte cache lines of the weights that hold a change: an in-place apply reads
and writes each of them, so on a CPU, where the dense copy runs at the same memory's speed,
the apply costs about what a copy of that share does. Run in .venv-vllm (make test-vllm builds it):

    .venv-vllm/bin/nemo-dcr bench vllm --json benchmarks/results/vllm.json
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nemo_dcr_callback.bench.results import machine, write_json

EXT = "nemo_dcr_callback.integrations.vllm.DCRWorkerExtension"


def _vllm_patch(worker, patches: list[tuple]) -> dict:
    """Worker side (collective_rpc): vLLM's own sparse patch path, then the CPU repack."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    ps = [CheckpointWeightPatch(n, shape, torch.bfloat16,
                                torch.frombuffer(bytearray(vals), dtype=torch.int16).view(torch.bfloat16),
                                torch.frombuffer(bytearray(idx), dtype=torch.int64))
          for n, shape, vals, idx in patches]
    t0 = time.perf_counter()
    with torch.no_grad():
        load_checkpoint_weight_patches(worker.model_runner.model, ps)
    load_s = time.perf_counter() - t0
    return {"load_s": load_s, "repack_s": worker._dcr_w.repack({p.name for p in ps})}


def _model(tmp: Path, hidden: int, layers: int, vocab: int):
    """Version 0 (its tensors and checkpoint folder), and the environment the engine needs."""
    from transformers import LlamaConfig, LlamaForCausalLM  # optional: only where the bench runs

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, vocab_size=vocab,
                      max_position_embeddings=256, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    d = tmp / "v0"
    m.save_pretrained(d)
    return {k: v.clone() for k, v in m.state_dict().items()}, d


def run(rates=(0.01, 0.03, 0.05), hidden: int = 1024, layers: int = 8, vocab: int = 32000,
        json_path: str | None = None, reps: int = 3) -> dict:
    """`reps` versions at each rate (every figure also as the median per rate: one run on a
    shared 2-core machine varies by tens of percent)."""
    import vllm
    from safetensors.torch import save_file

    from nemo_dcr_callback.bench.fp8 import ulp_step
    from nemo_dcr_callback.testing.tensor_sender import publish
    from nemo_dcr_callback.transport.store import FileStore

    rows = []
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        s0, d0 = _model(tmp, hidden, layers, vocab)
        params = sum(t.numel() for t in s0.values())
        print(f"vLLM {vllm.__version__}, Llama {params / 1e6:.0f}M parameters (hidden {hidden}, {layers} layers)",
              flush=True)
        llm = vllm.LLM(model=str(d0), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                       max_model_len=128, worker_extension_cls=EXT, gpu_memory_utilization=0.1)
        store = FileStore(tmp / "store")
        llm.collective_rpc("dcr_attach", args=(store.url,))
        print(f"{'change':>6} {'lines':>6} {'fetch+decode':>12} {'DCR load':>9} {'dense load':>10} "
              f"{'vLLM patches':>12} {'repack':>7} {'load/dense':>10} {'pause/dense':>11}", flush=True)
        states = [s0]
        for v, rate in enumerate([r for r in rates for _ in range(reps)], start=1):
            states.append(ulp_step(states[-1], rate, seed=v))
            old, new = states[-2], states[-1]
            publish(store, v, v - 1, old, new)
            # as a serving loop does: at each step boundary apply what the background has ready
            while not (dcr := llm.collective_rpc("dcr_update", kwargs={"wait": False})[0])["applied"]:
                time.sleep(0.05)
            assert dcr["version"] == v and dcr["refused"] is None, dcr
            dv = tmp / f"dense-{v}"
            dv.mkdir()
            save_file(new, str(dv / "model.safetensors"))
            dense = llm.collective_rpc("dcr_reload_dense", args=(str(dv), v))[0]
            touched = sum(int(torch.unique(torch.nonzero(
                t.view(torch.int16).reshape(-1) != old[n].view(torch.int16).reshape(-1)).reshape(-1) // 32).numel())
                for n, t in new.items())
            lines = sum((t.numel() + 31) // 32 for t in new.values())
            patches = []
            for n, t in new.items():
                idx = torch.nonzero(t.view(torch.int16).reshape(-1) != old[n].view(torch.int16).reshape(-1)).reshape(-1)
                # (raw bytes: vLLM's RPC encodes tensors as buffers that its pickle fallback refuses)
                patches.append((n, tuple(t.shape), t.reshape(-1)[idx].view(torch.int16).numpy().tobytes(),
                                idx.numpy().tobytes()))
            vp = llm.collective_rpc(_vllm_patch, args=(patches,))[0]
            row = {"version": v, "rate": rate, "params": params, "lines_touched": touched / lines,
                   "fetch_decode_s": dcr["fetch_decode_s"],
                   "dcr_load_s": dcr["load_s"], "dcr_repack_s": dcr["repack_s"], "dense_read_s": dense["read_s"],
                   "dense_load_s": dense["load_s"], "dense_repack_s": dense["repack_s"],
                   "vllm_patch_load_s": vp["load_s"], "vllm_patch_repack_s": vp["repack_s"],
                   "load_vs_dense": dcr["load_s"] / dense["load_s"],
                   "pause_vs_dense": (dcr["load_s"] + dcr["repack_s"]) / (dense["load_s"] + dense["repack_s"])}
            rows.append(row)
            print(_line(row), flush=True)
        llm.llm_engine.engine_core.shutdown()
    keys = ["lines_touched", "fetch_decode_s", "dcr_load_s", "dcr_repack_s", "dense_load_s", "dense_repack_s",
            "vllm_patch_load_s", "vllm_patch_repack_s", "load_vs_dense", "pause_vs_dense"]
    return _finish(rows, rates, keys, _line, reps, json_path, vllm.__version__)


def _line(m: dict) -> str:
    return (f"{100 * m['rate']:5.0f}% {100 * m['lines_touched']:5.0f}% {m['fetch_decode_s']:11.3f}s "
            f"{m['dcr_load_s']:8.3f}s {m['dense_load_s']:9.3f}s {m['vllm_patch_load_s']:11.3f}s "
            f"{m['dcr_repack_s']:6.3f}s {m['load_vs_dense']:10.2f} {m['pause_vs_dense']:11.2f}")


def _finish(rows: list[dict], rates, keys: list[str], line, reps: int, json_path: str | None, version: str) -> dict:
    """The medians per rate, printed with `line`, and the results written."""
    medians = [{"rate": r, **{k: statistics.median(x[k] for x in rows if x["rate"] == r) for k in keys}}
               for r in rates]
    print("medians:")
    for m in medians:
        print(line(m), flush=True)
    res = {"rows": rows, "medians": medians, "reps": reps, "vllm": version, "machine": machine()}
    if json_path:
        write_json(json_path, res)
    return res


# ------------------------------------------------------------------ the `dcr` weight-transfer backend
def _dense_load(worker, model_dir: str, version: int) -> dict:
    """Worker side: the baseline without NCCL on CPU, a dense checkpoint loaded in place through
    load_weights and repacked (EngineWeights.reload_dense, as `run`'s dcr_reload_dense), the
    backend's follower going on from `version`."""
    return worker.weight_transfer_engine.weights.reload_dense(model_dir, version)


def _backend_last(worker) -> dict:
    """Worker side: the figures of the backend's last update (pause, fetch+decode)."""
    return worker.weight_transfer_engine.last


def _adam_like(masters: dict[str, torch.Tensor], rate: float, seed: int) -> dict[str, torch.Tensor]:
    """An Adam-like step of fp32 masters (every value moved by lr, in place) calibrated to move
    about `rate` of the BF16 copy: small values change far more often than large ones (what
    context coding exploits; ulp_step's uniform positions have no such dependence)."""
    g = torch.Generator().manual_seed(seed)
    sample = torch.cat([m.reshape(-1)[::max(1, m.numel() >> 16)] for m in masters.values()])  # strided
    signs = torch.sign(torch.randn(sample.shape, generator=g))
    lo, hi = 1e-9, 1.0
    for _ in range(40):  # the lr that moves `rate` of the sample's BF16 values (bisection on a log scale)
        lr = (lo * hi) ** 0.5
        moved = float(((sample + lr * signs).to(torch.bfloat16) != sample.to(torch.bfloat16)).float().mean())
        lo, hi = (lr, hi) if moved < rate else (lo, lr)
    for m in masters.values():
        m += lr * torch.sign(torch.randn(m.shape, generator=g))
    return {k: m.to(torch.bfloat16) for k, m in masters.items()}


def run_backend(rates=(0.01, 0.03, 0.05), hidden: int = 1024, layers: int = 8, vocab: int = 32000,
                json_path: str | None = None, reps: int = 3, deltas: str = "ulp", context: str = "auto") -> dict:
    """vLLM's weight-transfer API with backend `dcr` (LLM(weight_transfer_config=...) and the
    trainer engine through vLLM's factory): per version, the bytes sent against the dense
    checkpoint's, and the engine's pause (the apply, with the CPU repack) against a dense
    in-place load_weights of the same weights. deltas: ulp (uniform positions, one ulp) or
    adamw (_adam_like); context: the sender's dcr.context."""
    import vllm
    from safetensors.torch import save_file
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from nemo_dcr_callback.bench.fp8 import ulp_step
    from nemo_dcr_callback.integrations.vllm_transfer import DCRTrainerInitInfo, LLMClient
    from nemo_dcr_callback.transport.store import FileStore

    rows = []
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        s0, d0 = _model(tmp, hidden, layers, vocab)
        params = sum(t.numel() for t in s0.values())
        dense_bytes = sum(t.numel() * t.element_size() for t in s0.values())
        print(f"vLLM {vllm.__version__}, weight-transfer backend dcr, Llama {params / 1e6:.0f}M parameters "
              f"(hidden {hidden}, {layers} layers)", flush=True)
        llm = vllm.LLM(model=str(d0), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                       max_model_len=128, weight_transfer_config={"backend": "dcr"}, gpu_memory_utilization=0.1)
        store = FileStore(tmp / "store")
        info = DCRTrainerInitInfo(store=store.url, rank=0, receiver_id="bench", context=context)
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=_States(s0))
        print(f"{'change':>6} {'sent':>10} {'dense':>10} {'dense/sent':>10} {'send':>8} {'fetch+decode':>12} "
              f"{'DCR pause':>9} {'dense pause':>11} {'pause/dense':>11}", flush=True)
        state = s0
        masters = {k: t.float() for k, t in s0.items()} if deltas == "adamw" else None
        for v, rate in enumerate([r for r in rates for _ in range(reps)], start=1):
            state = ulp_step(state, rate, seed=v) if masters is None else _adam_like(masters, rate, seed=v)
            t0 = time.perf_counter()
            d = trainer.send_weights(state.items())
            send_s = time.perf_counter() - t0
            assert d["committed"] and d["version"] == v, d
            last = llm.collective_rpc(_backend_last)[0]
            dv = tmp / f"dense-{v}"
            dv.mkdir()
            save_file(state, str(dv / "model.safetensors"))
            dense = llm.collective_rpc(_dense_load, args=(str(dv), v))[0]
            dense_pause = dense["load_s"] + dense["repack_s"]
            row = {"version": v, "rate": rate, "params": params, "sent_bytes": d["bytes"], "dense_bytes": dense_bytes,
                   "dense_vs_sent": dense_bytes / d["bytes"], "send_s": send_s, "publish_s": d["publish_s"],
                   "fetch_decode_s": last["fetch_decode_s"], "dcr_pause_s": last["pause_s"],
                   "dense_pause_s": dense_pause, "pause_vs_dense": last["pause_s"] / dense_pause,
                   "context_chunks": _context_chunks(store, v), "deltas": deltas, "context": context,
                   "change_rate": d.get("changed", 0) / params}
            rows.append(row)
            print(_backend_line(row), flush=True)
        llm.llm_engine.engine_core.shutdown()
    keys = ["sent_bytes", "dense_bytes", "dense_vs_sent", "send_s", "fetch_decode_s", "dcr_pause_s", "dense_pause_s",
            "pause_vs_dense"]
    return _finish(rows, rates, keys, _backend_line, reps, json_path, vllm.__version__)


def _context_chunks(store, v: int) -> int:
    from nemo_dcr_callback import codec
    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.protocol.keys import is_part

    return sum(codec.parse_header(c).classes > 0 for k in store.list(commit.vdir(v)) if is_part(k)
               for c in codec.split_chunks(store.get(k)))


def _backend_line(m: dict) -> str:
    return (f"{100 * m['rate']:5.0f}% {m['sent_bytes'] / 1e6:8.2f}MB {m['dense_bytes'] / 1e6:8.2f}MB "
            f"{m['dense_vs_sent']:10.1f} {m['send_s']:7.3f}s {m['fetch_decode_s']:11.3f}s "
            f"{m['dcr_pause_s']:8.3f}s {m['dense_pause_s']:10.3f}s {m['pause_vs_dense']:11.2f}")

class _States:
    """A vLLM WeightSource over a dict of named tensors (the trainer's initial weights)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __iter__(self):
        return iter(self.tensors.items())
