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

from nemo_dcr_callback.recipes import synthetic
from nemo_dcr_callback.tools import delta_patch, deltafile


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
        delta_patch.patch(current, delta, rebuilt, quiet=True)
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


def run_training_demo(steps: int, tp: int, pp: int, workdir: str | None) -> int:
    """The main job: torchrun runs the training recipe (recipes/train.py) (Lightning + megatron-core GPT, TP x PP on
    CPU) with the DCR callback publishing every step to a file:// store; a receiver process
    follows with a transformers model and checks every version bit for bit against the dense
    export the callback writes in verify mode."""
    import subprocess
    import sys
    import threading

    from nemo_dcr_callback.launcher import torchrun_cmd
    from nemo_dcr_callback.protocol import commit, keys
    from nemo_dcr_callback.transport.store import open_store

    root = (Path(workdir) if workdir else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    store_dir = root / "dcr-store"
    store_dir.mkdir(parents=True, exist_ok=True)
    url = "file://" + str(store_dir)
    print(f"nemo-dcr demo: the training recipe on {tp * pp} CPU ranks (TP {tp} x PP {pp}), {steps} steps, "
          f"DCR callback -> {url}, a receiver process following", flush=True)
    exe = Path(sys.executable).parent
    receiver = subprocess.Popen([str(exe / "nemo-dcr"), "receive", "--store", url, "--follow", "--until",
                                 str(steps), "--verify", "--timeout", "300"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def pump():
        for line in receiver.stdout:
            if line.startswith("receiver:") or "error" in line:
                print("  " + line.rstrip(), flush=True)
                lines.append(line)

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    t0 = time.perf_counter()
    trainer = subprocess.Popen(
        torchrun_cmd(tp * pp, ["-m", "nemo_dcr_callback.recipes.train", f"parallel.tensor_model_parallel_size={tp}",
                               f"parallel.pipeline_model_parallel_size={pp}", f"trainer.max_steps={steps}",
                               f"dcr.store={url}", "dcr.verify=true", f"hydra.run.dir={root}"]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in trainer.stdout:
        tail = (tail + [line])[-40:]
        if line.startswith("dcr:"):
            print("  trainer " + line.rstrip(), flush=True)
    if trainer.wait() != 0:
        receiver.kill()
        print("".join(tail))
        print("demo FAILED: the trainer exited with an error")
        return 1
    rc = receiver.wait(timeout=300)
    th.join(timeout=5)
    if rc != 0:
        print("demo FAILED: the receiver exited with an error")
        return 1
    store = open_store(url)
    stats = [s for k in store.list(keys.STATS) for s in commit.read_json(store, k) or []]
    applied = {int(x.split()[2]): x for x in lines if x.startswith("receiver: version ")}
    print(f"\n{'step':>4} {'changed':>9} {'delta':>10} {'dense':>10} {'ratio':>7} {'publish ms':>10} "
          f"{'apply ms':>9}  check")
    for v in range(1, steps + 1):
        rec = commit.read_json(store, keys.version_record(v))
        publish_ms = 1e3 * max(s["kernel_s"] + s["encode_s"] + s["upload_s"] + s["seal_s"]
                               for s in stats if s["version"] == v)
        line = applied.get(v, "")
        apply_ms = float(line.split("apply ")[1].split(" ms")[0]) if "apply " in line else float("nan")
        dense = 2 * rec["params"]
        print(f"{v:>4} {rec['changed'] / rec['params']:9.2%} {rec['bytes'] / 1e3:8.1f}kB {dense / 1e6:8.2f}MB "
              f"{dense / max(rec['bytes'], 1):6.1f}x {publish_ms:10.1f} {apply_ms:9.1f}  "
              f"{'bit-exact' if 'bit-exact' in line else 'MISSING'}")
    ok = len(applied) == steps and all("bit-exact" in x for x in applied.values())
    print(f"demo ok in {time.perf_counter() - t0:.0f} s: every version the receiver applied is bit-exact with the "
          "dense export" if ok else "demo FAILED: versions missing or not bit-exact")
    return 0 if ok else 1
