"""Issue 37: block-FP8 serving weights kept bit-exact by sparse requantization
(receiver/targets/fp8_dir.py; the cast itself is checked against the engines' in
tests/core/test_fp8.py). An FP8 checkpoint directory following BF16 versions: after each,
its FP8 bytes and scales equal the dense cast of the dense BF16 weights (the oracle: the
sender's states, quantized whole), a damaged version leaves every file as it was, and a
crash mid-apply is completed on reopen."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_dcr_callback.core import fp8
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.receiver.targets.fp8_dir import Fp8DirTarget, convert
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers import versions
from tests.helpers.tensors import perturb, same_fp8

LAYOUT = {"model.embed_tokens.weight": (320, 96), "model.layers.0.self_attn.q_proj.weight": (256, 320),
          "model.layers.0.mlp.down_proj.weight": (320, 300), "model.layers.0.mlp.gate_proj.weight": (300, 320),
          "model.layers.0.input_layernorm.weight": (320,), "lm_head.weight": (96, 320)}


def _adam_like(t: torch.Tensor, rate: float, g: torch.Generator) -> torch.Tensor:
    """About `rate` of the values moved by a small relative step, as an optimizer step does."""
    x = t.float()
    m = torch.rand(t.shape, generator=g) < rate
    x[m] *= 1 + 0.02 * torch.randn(int(m.sum()), generator=g)
    return x.to(torch.bfloat16)


def _states(n: int, rate: float = 0.03, specials: bool = False) -> list[dict[str, torch.Tensor]]:
    """Small optimizer-like steps, or (specials) perturb()'s arbitrary bit patterns: NaN, inf,
    huge values, whole blocks whose scale changes."""
    g = torch.Generator().manual_seed(3)
    s0 = {k: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for k, shape in LAYOUT.items()}
    out = [s0]
    for _ in range(n):
        out.append({k: (perturb(t, rate, g) if specials else _adam_like(t, rate, g)) for k, t in out[-1].items()})
    return out


def _fp8_dir(tmp_path, state, recipe="vllm"):
    src = tmp_path / "bf16"
    src.mkdir()
    save_file(state, str(src / "model.safetensors"))
    out = tmp_path / "fp8"
    info = convert(src, out, recipe=recipe)
    assert info["quantized"] == 3  # q_proj, down_proj, gate_proj: not embeddings, norms, lm_head
    return out


def _holds(d, state, recipe) -> list[str]:
    """The names whose FP8 bytes, scales (or plain bits) differ from the dense cast of state."""
    got = load_file(str(d / "model.safetensors"))
    shadow = load_file(str(d / ".nemo-dcr" / "shadow.safetensors"))
    bad = []
    for name, t in state.items():
        if name in shadow:
            q, s = fp8.quantize(t, recipe)
            if not (same_fp8(got[name], q) and torch.equal(bits(got[name + "_scale_inv"]), bits(s))
                    and torch.equal(bits(shadow[name]), bits(t))):
                bad.append(name)
        elif not torch.equal(bits(got[name]), bits(t)):
            bad.append(name)
    return bad


def _tree(d) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("recipe,specials,rate,path", [
    ("vllm", False, 0.03, "auto"), ("ue8m0", False, 0.03, "auto"), ("deepgemm-v1", False, 0.03, "auto"),
    ("vllm", True, 0.03, "auto"),
    ("vllm", False, 0.03, "blocks"), ("vllm", True, 0.0002, "blocks"), ("vllm", False, 0.0002, "whole")])
def test_fp8_dir_follows_versions_bit_exact_with_the_dense_cast(tmp_path, monkeypatch, recipe, specials, rate, path):
    """Both ways of requantizing: touched blocks gathered and requantized alone ("blocks"),
    or each touched weight whole ("whole"; "auto" picks by the share of blocks touched)."""
    from nemo_dcr_callback.receiver.targets import fp8_dir

    if path != "auto":
        monkeypatch.setattr(fp8_dir, "DENSE_FROM", 1 if path == "blocks" else 10**9)
    store = FileStore(tmp_path / "store")
    states = _states(4, rate, specials=specials)
    d = _fp8_dir(tmp_path, states[0], recipe)
    t = Fp8DirTarget(d)
    for v in range(1, 5):
        versions.publish(store, v, v - 1, states[v - 1], states[v])
        Follower(store, t, version=t.version).apply_version(v)
        assert t.version == v and _holds(d, states[v], recipe) == []
    t.close()


@pytest.mark.parametrize("path", ["auto", "blocks"])
def test_a_weight_in_several_chunks_is_requantized_from_all_of_them(tmp_path, monkeypatch, path):
    """A weight arrives in several chunks (one per tensor-parallel rank, or per chunk span): the
    blocks they share are requantized from every chunk's changes together. Found by the chaos
    soak (seed 1, TP 2): requantized chunk by chunk, the FP8 bytes and scales of the shared
    blocks differed from the dense cast from version 1 on."""
    from nemo_dcr_callback.protocol import commit
    from nemo_dcr_callback.receiver.targets import fp8_dir
    from nemo_dcr_callback.testing.tensor_sender import TensorSender

    if path == "blocks":
        monkeypatch.setattr(fp8_dir, "DENSE_FROM", 1)
    store = FileStore(tmp_path / "store")
    states = _states(3, 0.03)
    d = _fp8_dir(tmp_path, states[0])
    t = Fp8DirTarget(d)
    for v in range(1, 4):
        s = TensorSender(states[v - 1], 0, 1, span=10_000)  # down_proj (96,000 values): 10 chunks
        for n in s.tensors:
            s.tensors[n] = states[v][n]
        s.write(store, v, v - 1, s.take())
        commit.run_commit(store, commit.seal_version(store, v, v - 1, 1, timeout=5), commit.CommitPolicy())
        Follower(store, t, version=t.version).apply_version(v)
        assert t.version == v and _holds(d, states[v], "vllm") == []
    t.close()


def test_a_damaged_version_leaves_the_fp8_files_untouched(tmp_path):
    from nemo_dcr_callback import codec
    from nemo_dcr_callback.protocol import commit

    store = FileStore(tmp_path / "store")
    states = _states(1)
    d = _fp8_dir(tmp_path, states[0])
    versions.publish(store, 1, 0, states[0], states[1])
    part = next(k for k in store.list(commit.vdir(1)) if k.endswith(".dcr"))
    blob = bytearray(store.get(part))
    blob[len(blob) // 2] ^= 0x40
    store.delete([part])
    store.put(part, bytes(blob))
    before = _tree(d)
    t = Fp8DirTarget(d)
    with pytest.raises(codec.ChunkError):
        Follower(store, t, version=t.version).apply_version(1, wait_decision=False)
    t.close()
    assert _tree(d) == before


def test_a_crash_mid_apply_is_completed_on_reopen(tmp_path):
    store = FileStore(tmp_path / "store")
    states = _states(2)
    d = _fp8_dir(tmp_path, states[0])
    for v in (1, 2):
        versions.publish(store, v, v - 1, states[v - 1], states[v])
    t = Fp8DirTarget(d)
    Follower(store, t, version=t.version).apply_version(1)
    writes = []

    def crash():
        writes.append(1)
        if len(writes) == 8:  # past the 6 BF16 records: inside the FP8 bytes and scales
            raise KeyboardInterrupt("simulated crash between two writes")

    t._crash_point = crash
    with pytest.raises(KeyboardInterrupt):
        Follower(store, t, version=t.version).apply_version(2)
    t.close()
    assert _holds(d, states[2], "vllm")  # really torn
    t = Fp8DirTarget(d)  # reopen: the redo log completes version 2
    assert t.version == 2
    t.close()
    assert _holds(d, states[2], "vllm") == []


def test_cli_fp8_init_then_receive(tmp_path):
    """The commands a user runs: fp8-init from the BF16 checkpoint, receive --fp8-dir."""
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).parent / "nemo-dcr")
    store = FileStore(tmp_path / "store")
    states = _states(2)
    src = tmp_path / "bf16"
    src.mkdir()
    save_file(states[0], str(src / "model.safetensors"))
    p = subprocess.run([exe, "fp8-init", str(src), "-o", str(tmp_path / "fp8")], capture_output=True, text=True)
    assert p.returncode == 0 and "3 weights in block FP8" in p.stdout, p.stderr
    p = subprocess.run([exe, "fp8-init", str(src), "-o", str(tmp_path / "fp8")], capture_output=True, text=True)
    assert p.returncode == 2 and "not empty" in p.stderr  # never over an existing directory
    for v in (1, 2):
        versions.publish(store, v, v - 1, states[v - 1], states[v])
    p = subprocess.run([exe, "receive", "--store", store.url, "--fp8-dir", str(tmp_path / "fp8")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "version 2 (base 1)" in p.stdout, p.stdout + p.stderr
    assert _holds(tmp_path / "fp8", states[2], "vllm") == []
