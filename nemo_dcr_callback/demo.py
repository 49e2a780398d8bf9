"""`make demo` for now: a synthetic policy trained a few Adam-like steps, each step's
checkpoint diffed against the previous one and rebuilt from the deltas alone; the rebuilt
files are compared byte for byte with the dense checkpoints (the oracle)."""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path

from safetensors.torch import save_file

from nemo_dcr_callback import deltafile, synthetic


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _save(policy: synthetic.SyntheticPolicy, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    tensors = policy.bf16()
    names = sorted(tensors)
    half = len(names) // 2  # two shards, like a Hugging Face checkpoint directory
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    index = {"metadata": {"total_size": sum(t.numel() * 2 for t in tensors.values())}, "weight_map": {}}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / fname), metadata={"format": "pt"})
        index["weight_map"].update({k: fname for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))


def run_demo(params: int, rate: float, steps: int, workdir: str | None) -> int:
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="nemo-dcr-demo."))
    print(f"nemo-dcr demo: synthetic policy of {params / 1e6:.1f}M params, {steps} steps at ~{rate:.0%} "
          f"change, in {root}")
    policy = synthetic.make_policy(params)
    lr = policy.lr_for_rate(rate)
    _save(policy, root / "step0")
    current = root / "step0"  # what the receiver holds, rebuilt from deltas only
    print(f"{'step':>4} {'changed':>9} {'delta':>10} {'dense':>10} {'ratio':>7} {'diff s':>7} {'patch s':>7}  check")
    for step in range(1, steps + 1):
        policy.step(lr)
        dense = root / f"step{step}"
        _save(policy, dense)
        delta = root / f"delta{step - 1}to{step}.dcr"
        t0 = time.perf_counter()
        deltafile.diff(root / f"step{step - 1}", dense, delta, quiet=True)
        t1 = time.perf_counter()
        rebuilt = root / f"rebuilt{step}"
        deltafile.patch(current, delta, rebuilt, quiet=True)
        t2 = time.perf_counter()
        st = deltafile.stats(delta)
        same = all(_sha(rebuilt / p.name) == _sha(p) for p in dense.iterdir())
        print(f"{step:>4} {st['change_rate']:9.2%} {st['bytes'] / 1e6:8.2f}MB {st['dense_bytes'] / 1e6:8.1f}MB "
              f"{st['ratio_vs_dense']:6.1f}x {t1 - t0:7.2f} {t2 - t1:7.2f}  "
              f"{'bit-exact (files identical to the dense checkpoint)' if same else 'MISMATCH'}")
        if not same:
            return 1
        current = rebuilt
    print("demo ok: every step rebuilt from deltas alone, byte-identical to the dense checkpoints")
    return 0
