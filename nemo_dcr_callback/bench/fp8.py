"""Block-FP8 serving weights under BF16 deltas (issue 37): per version, how many 128x128 blocks
and FP8 bytes change, the bytes shipped against dense FP8, and the sparse requantizing apply
against a dense requantize.

Pairs: synthetic (Llama-shaped linear weights, a fraction of the values moved by one BF16 ulp,
the commonest optimizer step on BF16 weights) and real-gradient (a transformers LlamaForCausalLM
trained by AdamW on fp32 master weights; the last step's learning rate is searched so that
the BF16 copy changes in 1, 3 and 5% of its values). Each pair goes through the real path: a
BF16 checkpoint, `fp8-init`, a published version (TensorSender, FileStore, joint commit), an
Fp8DirTarget applying it; the result is checked against the dense cast before it is timed.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nemo_dcr_callback.bench.results import machine, write_json
from nemo_dcr_callback.core import fp8

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def synthetic_base(hidden: int = 1536, inter: int = 4096, kv: int = 512, layers: int = 2,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, hidden),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    out = {}
    for i in range(layers):
        for p, shape in shapes.items():
            part = "self_attn" if p in LINEAR[:4] else "mlp"
            out[f"model.layers.{i}.{part}.{p}.weight"] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    return out


def ulp_step(state: dict[str, torch.Tensor], rate: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """A fraction `rate` of the values moved one BF16 ulp up or down (magnitude +-1)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        b = t.clone().view(torch.int16).reshape(-1)
        m = torch.rand(b.numel(), generator=g) < rate
        step = torch.where(torch.rand(int(m.sum()), generator=g) < 0.5, 1, -1).to(torch.int16)
        mag = b[m] & 0x7FFF
        b[m] = (b[m] & -0x8000) | (mag + torch.where(mag == 0, 1, step).to(torch.int16))  # (0 only grows)
        out[k] = b.view(torch.bfloat16).view(t.shape)
    return out


def real_gradient_pairs(rates: tuple[float, ...], steps: int = 6, seed: int = 0) -> dict[float, tuple]:
    """(old, new, last lr, rate) of the BF16 linear weights of a small transformers Llama after
    `steps` AdamW steps on fp32 master weights (bench/corpus.py), per target change rate."""
    from transformers import LlamaConfig

    from nemo_dcr_callback.bench import corpus

    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=2000, max_position_embeddings=128)
    got = corpus.pairs("llama", rates, steps, seed, names_filter=lambda n: any(f".{p}." in n for p in LINEAR),
                       config=cfg)
    return {p.target: (p.old, p.new, p.lr, p.rate) for p in got}


def _blocks_changed(old: dict, new: dict) -> tuple[int, int]:
    changed = total = 0
    for n, t in old.items():
        m, k = t.shape
        gm, gn = fp8.grid((m, k))
        d = (t.view(torch.int16) != new[n].view(torch.int16))
        pad = torch.zeros((gm * fp8.BLOCK, gn * fp8.BLOCK), dtype=torch.bool)
        pad[:m, :k] = d
        changed += int(pad.view(gm, fp8.BLOCK, gn, fp8.BLOCK).any(dim=(1, 3)).sum())
        total += gm * gn
    return changed, total


def measure(old: dict, new: dict, workdir: Path, repeats: int = 3, recipe: str = "vllm") -> dict:
    """One pair through the real path; figures over the quantized weights."""
    import zstandard
    from safetensors.torch import save_file

    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.receiver import Follower
    from nemo_dcr_callback.receiver.targets.fp8_dir import Fp8DirTarget, convert
    from nemo_dcr_callback.testing.tensor_sender import publish
    from nemo_dcr_callback.transport.store import FileStore

    params = sum(t.numel() for t in old.values())
    changed = sum(int((old[n].view(torch.int16) != new[n].view(torch.int16)).sum()) for n in old)
    blocks_changed, blocks = _blocks_changed(old, new)
    q_old = {n: fp8.quantize(t, recipe) for n, t in old.items()}
    t0 = time.perf_counter()
    q_new = {n: fp8.quantize(t, recipe) for n, t in new.items()}
    dense_quant_s = time.perf_counter() - t0
    fp8_changed = sum(int((q_old[n][0].view(torch.uint8) != q_new[n][0].view(torch.uint8)).sum()) for n in old)
    scales_changed = sum(int((q_old[n][1].view(torch.int32) != q_new[n][1].view(torch.int32)).sum()) for n in old)
    # the other design: FP8 changes from the sender (XOR of FP8 bytes, and the changed scales), zstd-coded
    z = zstandard.ZstdCompressor(level=3)
    fp8_delta_bytes = sum(len(z.compress((q_old[n][0].view(torch.uint8) ^ q_new[n][0].view(torch.uint8))
                                         .numpy().tobytes())) for n in old) + 8 * scales_changed
    dense_fp8_bytes = params + 4 * blocks
    store = FileStore(workdir / "store")
    publish(store, 1, 0, old, new)
    version_bytes = sum(len(store.get(k)) for k in store.list(commit.vdir(1)))
    payload_bytes = sum(len(store.get(k)) for k in store.list(commit.vdir(1)) if k.endswith(".dcr"))
    src = workdir / "bf16"
    src.mkdir()
    save_file(old, str(src / "model.safetensors"))
    apply_s, dense_s = [], []
    for r in range(repeats):
        d = workdir / f"fp8-{r}"
        convert(src, d, recipe=recipe)
        t = Fp8DirTarget(d)
        t0 = time.perf_counter()
        Follower(store, t, version=0).apply_version(1)
        apply_s.append(time.perf_counter() - t0)
        bad = [n for n in new if not torch.equal(t.raw(n).view(torch.uint8).reshape(-1),
                                                  q_new[n][0].view(torch.uint8).reshape(-1))]
        t.close()
        if bad:
            raise AssertionError(f"FP8 bytes of {bad[0]} differ from the dense cast")
        t0 = time.perf_counter()  # a dense refit of the FP8 copy: quantize everything, write it
        qs = {}
        for n, w in new.items():
            q, sc = fp8.quantize(w, recipe)
            qs[n], qs[n + "_scale_inv"] = q, sc
        save_file(qs, str(workdir / f"dense-{r}.safetensors"))
        with open(workdir / f"dense-{r}.safetensors", "rb+") as f:  # durable, as the apply is
            os.fsync(f.fileno())
        dense_s.append(time.perf_counter() - t0)
    return {"params": params, "change_rate": changed / params, "blocks": blocks,
            "blocks_changed_pct": 100 * blocks_changed / blocks, "fp8_bytes_changed_pct": 100 * fp8_changed / params,
            "scales_changed_pct": 100 * scales_changed / blocks, "dense_fp8_bytes": dense_fp8_bytes,
            "shipped_bytes": version_bytes, "payload_bytes": payload_bytes,
            "shipped_vs_dense_fp8": dense_fp8_bytes / version_bytes,
            "fp8_block_delta_bytes": fp8_delta_bytes, "apply_s": statistics.median(apply_s),
            "dense_requant_write_fsync_s": statistics.median(dense_s), "dense_quantize_only_s": dense_quant_s,
            "apply_speedup": statistics.median(dense_s) / statistics.median(apply_s),
            "shadow_bytes": 2 * params}


def run(rates: tuple[float, ...] = (0.01, 0.03, 0.05), repeats: int = 3, real: bool = True,
        json_path: str | None = None) -> dict:
    rows = []
    base = synthetic_base()
    print(f"synthetic: {sum(t.numel() for t in base.values()) / 1e6:.0f}M linear params; "
          f"real: a 4-layer Llama after 6 AdamW steps", flush=True)
    pairs = [("synthetic", r, base, ulp_step(base, r), None) for r in rates]
    if real:
        pairs += [("real-gradient", r, o, n, lr) for r, (o, n, lr, _) in real_gradient_pairs(rates).items()]
    hdr = (f"{'pair':>13} {'target':>6} {'changed':>7} {'blocks':>7} {'FP8 B':>6} {'scales':>6} "
           f"{'shipped':>9} {'vs FP8':>7} {'FP8-delta':>9} {'apply':>7} {'dense':>7} {'x':>5}")
    print(hdr, flush=True)
    for kind, r, old, new, lr in pairs:
        with tempfile.TemporaryDirectory() as d:
            row = {"pair": kind, "target_rate": r, "last_lr": lr, **measure(old, new, Path(d), repeats)}
        rows.append(row)
        print(f"{kind:>13} {100 * r:5.0f}% {100 * row['change_rate']:6.2f}% {row['blocks_changed_pct']:6.1f}% "
              f"{row['fp8_bytes_changed_pct']:5.2f}% {row['scales_changed_pct']:5.1f}% "
              f"{row['shipped_bytes'] / 1e6:7.2f}MB {row['shipped_vs_dense_fp8']:6.1f}x "
              f"{row['fp8_block_delta_bytes'] / 1e6:7.2f}MB {row['apply_s']:6.2f}s "
              f"{row['dense_requant_write_fsync_s']:6.2f}s {row['apply_speedup']:4.1f}x", flush=True)
    res = {"rows": rows, "repeats": repeats, "machine": machine()}
    if json_path:
        write_json(json_path, res)
    return res
