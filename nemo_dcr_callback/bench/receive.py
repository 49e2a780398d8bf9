"""`nemo-dcr bench receive`: what applying a version costs a receiver, per kind of target.

A synthetic Llama-shaped policy (synthetic.py: Adam-like steps at a chosen BF16 change rate)
publishes a chain of versions to a file:// store; then, side by side in one process, each
kind of receiver starts from version 0 and applies the chain:

- state-dict:   canonical tensors in memory (StateDictTarget; the refit and relay
                benchmarks' receivers), apply and digest check in one pass;
- loader:       a transformers LlamaForCausalLM through its own load_state_dict
                (LoaderTarget, `nemo-dcr receive --hf-model`), sparse where the copies allow;
- loader-dense: the same model with every copy through the dense scratch (how LoaderTarget
                placed changes before 2026-12-02), for comparison;
- checkpoint-dir: a safetensors directory patched in place with its redo log
                (CheckpointDirTarget, `nemo-dcr receive --model-dir`), fsyncs included.

Each apply is timed from the decision to the weights holding the version (Applied.apply_s:
the bytes are already fetched and verified), and every receiver is compared, after every
version, with the sender's dense BF16 tensors (the oracle). Kinds run in turn, in rounds, so
the host's drift spreads over all of them.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

KINDS = ("state-dict", "loader", "loader-dense", "checkpoint-dir")


def _llama_config(shapes: dict[str, tuple[int, ...]]):
    """The transformers LlamaConfig whose model has exactly these names and shapes
    (synthetic.layer_shapes: no GQA, MLP width 2x hidden, untied head)."""
    from transformers import LlamaConfig

    vocab, hidden = shapes["model.embed_tokens.weight"]
    layers = sum(1 for n in shapes if n.endswith("input_layernorm.weight"))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                       tie_word_embeddings=False)


def _llama(cfg, shapes: dict[str, tuple[int, ...]]):
    """A LlamaForCausalLM of cfg in BF16, checked to hold exactly these tensors."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if got != {k: tuple(s) for k, s in shapes.items()}:
        raise RuntimeError("the transformers model's tensors do not match the synthetic policy's")
    return model


def _publish(store, states: list[dict[str, torch.Tensor]]) -> list[int]:
    """Versions 1..n of the chain, committed (no receivers registered); changes per version."""
    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.testing.tensor_sender import TensorSender

    s = TensorSender(states[0])
    changed = []
    for v in range(1, len(states)):
        s.tensors = states[v]
        m = s.write(store, v, v - 1, s.take())
        s.settle()
        commit.run_commit(store, commit.seal_version(store, v, v - 1, 1, timeout=60), commit.CommitPolicy())
        changed.append(m["changed"])
    return changed


def _receiver(kind: str, states0: dict[str, torch.Tensor], cfg, workdir: Path):
    """(target or tensors for the Follower, a function giving the held tensors, cleanup)."""
    from safetensors.torch import load_file, save_file

    from nemo_dcr_callback.receiver.targets import CheckpointDirTarget, LoaderTarget

    if kind == "state-dict":
        tensors = {k: v.clone() for k, v in states0.items()}
        return tensors, lambda: tensors, lambda: None
    if kind in ("loader", "loader-dense"):
        model = _llama(cfg, {k: tuple(v.shape) for k, v in states0.items()})
        model.load_state_dict(states0)
        shapes = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
        target = LoaderTarget(model, lambda items: model.load_state_dict(dict(items), strict=False), shapes,
                              sparse=kind == "loader")
        return target, model.state_dict, lambda: None
    d = workdir / "ckpt"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in states0.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(cfg.to_json_string())
    target = CheckpointDirTarget(d)
    return target, lambda: load_file(str(d / "model.safetensors")), target.close


def _same(held: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str | None:
    """The first tensor whose bits differ from the oracle's, or None."""
    from nemo_dcr_callback.core.rawbits import bits

    for k, t in want.items():
        if k not in held or not torch.equal(bits(held[k].contiguous()), bits(t)):
            return k
    return None


def run(params: int = 1 << 25, rate: float = 0.03, versions: int = 5, rounds: int = 3, kinds=KINDS,
        json_path: str | None = None, seed: int = 0) -> dict:
    from nemo_dcr_callback.bench.results import machine, write_json
    from nemo_dcr_callback.receiver import Follower
    from nemo_dcr_callback.recipes.synthetic import make_policy
    from nemo_dcr_callback.transport.store import FileStore

    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown receiver kind {bad[0]!r} (one of {', '.join(KINDS)})")
    t_start = time.time()
    print(f"nemo-dcr bench receive: a {params / 1e6:.0f}M-param policy, {versions} versions at {rate:.1%} changed, "
          f"{rounds} round(s) of {', '.join(kinds)}", flush=True)
    policy = make_policy(params, seed=seed)
    lr = policy.lr_for_rate(rate)
    states = [policy.bf16()]
    for _ in range(versions):
        policy.step(lr)
        states.append(policy.bf16())
    del policy
    cfg = _llama_config({k: tuple(v.shape) for k, v in states[0].items()})
    work = Path(tempfile.mkdtemp(prefix="nemo-dcr-bench-receive."))
    try:
        store = FileStore(work / "store")
        changed = _publish(store, states)
        print(f"  published {versions} versions: {min(changed) / 1e6:.2f}-{max(changed) / 1e6:.2f}M changes each",
              flush=True)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        checked: dict[str, bool] = {k: True for k in kinds}
        for r in range(rounds):
            for kind in kinds:
                target, held, close = _receiver(kind, states[0], cfg, work)
                try:
                    f = Follower(store, target, version=0)
                    for v in range(1, versions + 1):
                        a = f.apply_version(v)
                        times[kind].append(a.apply_s)
                        checked[kind] &= a.digest_checked
                        wrong = _same(held(), states[v])
                        if wrong is not None:
                            raise RuntimeError(f"{kind}: after version {v}, tensor {wrong!r} differs from the sender's")
                finally:
                    close()
                ms = [1e3 * x for x in times[kind][-versions:]]
                print(f"  round {r + 1}, {kind}: apply {statistics.median(ms):.1f} ms per version "
                      f"(min {min(ms):.1f}, max {max(ms):.1f}); bit-exact with the sender after every version",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = {k: {"apply_ms_median": statistics.median(1e3 * x for x in v), "apply_ms_min": 1e3 * min(v),
                "apply_ms_max": 1e3 * max(v), "samples": len(v), "digests_checked": checked[k], "bit_exact": True}
            for k, v in times.items()}
    n = sum(t.numel() for t in states[0].values())
    print(f"\n{'receiver':<16} {'apply ms':>9} {'min':>7} {'max':>7}  digests  per change")
    for k, row in rows.items():
        per = 1e6 * row["apply_ms_median"] / statistics.median(changed)
        print(f"{k:<16} {row['apply_ms_median']:9.1f} {row['apply_ms_min']:7.1f} {row['apply_ms_max']:7.1f}  "
              f"{'checked' if row['digests_checked'] else 'no':<8} {per:6.1f} ns")
    out = {"benchmark": "receive", "params": n, "rate": rate, "versions": versions, "rounds": rounds,
           "changed_per_version": changed, "kinds": rows, "machine": machine(), "wall_s": time.time() - t_start}
    if json_path:
        write_json(json_path, out)
    return out


if __name__ == "__main__":
    print(json.dumps(run(params=1 << 22, versions=2, rounds=1), indent=1))
