"""Context-coded chunks (codec/context.py: positions coded by classes of the old value's
exponent) on the refit path: the sender codes them from its baseline, and every receiver
decodes them from the bits it holds, ending bit-exact with the dense state (the oracle: the
tensors the sender published, saved or cast whole). A receiver that cannot read its bits
refuses by name with nothing applied, and a decoder given other old bits than the sender's
decodes other positions, which the version record's digests refuse."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.core import fp8
from nemo_dcr_callback.core.delta import take_delta
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol import commit, upload
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.receiver.targets import CheckpointDirTarget, LoaderTarget, StateDictTarget
from nemo_dcr_callback.receiver.targets.fp8_dir import Fp8DirTarget, convert
from nemo_dcr_callback.sender.named import NamedPublisher
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.tensors import adam_like, same_bits, same_fp8

# A small Llama layer's shapes: wide enough for context coding to win, FP8-quantizable (128-blocks).
LAYOUT = {"model.layers.0.self_attn.q_proj.weight": (256, 256), "model.layers.0.self_attn.o_proj.weight": (256, 256),
          "model.layers.0.mlp.down_proj.weight": (256, 384), "model.layers.0.mlp.up_proj.weight": (384, 256),
          "model.layers.0.input_layernorm.weight": (256,)}


def _chain(n: int, lr: float = 4e-5, seed: int = 0, layout=None) -> list[dict[str, torch.Tensor]]:
    """States 0..n: fp32 masters of mixed magnitude moved by about lr each step (Adam-like),
    BF16 copies: small values change far more often than large ones, as context coding expects."""
    g = torch.Generator().manual_seed(seed)
    masters = {}
    for k, s in (layout or LAYOUT).items():
        m = torch.Size(s).numel()
        masters[k] = (torch.randn(m, generator=g) * torch.logspace(-3, 0, m)[torch.randperm(m, generator=g)]).reshape(s)
    out = [{k: t.to(torch.bfloat16) for k, t in masters.items()}]
    for _ in range(n):
        for t in masters.values():
            t += lr * torch.sign(torch.randn(t.shape, generator=g))
        out.append({k: t.to(torch.bfloat16) for k, t in masters.items()})
    return out


def _context_chunks(store, v: int) -> int:
    return sum(codec.parse_header(c).classes > 0 for k in store.list(commit.vdir(v)) if k.endswith(".dcr")
               for c in codec.split_chunks(store.get(k)))


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """Versions 1..3 published by NamedPublisher (context coding on, its default)."""
    store = FileStore(tmp_path_factory.mktemp("store"))
    states = _chain(3)
    pub = NamedPublisher(store, states[0], context="on")  # (a file store never has an upload backlog)
    for s in states[1:]:
        assert pub.publish(s)["committed"]
    assert all(_context_chunks(store, v) > 0 for v in (1, 2, 3))
    return store, states


def test_the_sender_context_codes_from_its_baseline_and_saves_bytes(tmp_path):
    states = _chain(1)
    sizes = {}
    for ctx in ("on", "off", "auto"):
        store = FileStore(tmp_path / ctx)
        pub = NamedPublisher(store, states[0], context=ctx)
        sizes[ctx] = pub.publish(states[1])["bytes"]
        assert (_context_chunks(store, 1) > 0) == (ctx == "on")  # auto: a file store is never behind
    assert sizes["on"] < 0.9 * sizes["off"] and sizes["auto"] == sizes["off"]


def test_a_state_dict_receiver_decodes_with_its_own_bits(published):
    store, states = published
    held = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, held)
    f.follow(until=3, timeout=30)
    assert same_bits(held, states[3])


def test_an_early_applying_receiver_decodes_with_its_own_bits(published):
    store, states = published
    held = {k: t.clone() for k, t in states[0].items()}
    Follower(store, held, early=True).follow(until=3, timeout=30)
    assert same_bits(held, states[3])


def test_a_checkpoint_directory_decodes_with_its_own_bits(published, tmp_path):
    store, states = published
    save_file(states[0], str(tmp_path / "model.safetensors"))
    t = CheckpointDirTarget(tmp_path)
    f = Follower(store, t, version=t.version)
    for v in (1, 2, 3):
        f.apply_version(v)
        assert same_bits(load_file(str(tmp_path / "model.safetensors")), states[v])
    t.close()


def _fp8_differs(d, state) -> list[str]:
    """Names whose FP8 bytes and scales (or plain bits) differ from the dense cast of state."""
    got = load_file(str(d / "model.safetensors"))
    bad = []
    for name, t in state.items():
        if name + "_scale_inv" in got:
            q, s = fp8.quantize(t, "vllm")
            if not (same_fp8(got[name], q) and same_bits({0: got[name + "_scale_inv"]}, {0: s})):
                bad.append(name)
        elif not same_bits({0: got[name]}, {0: t}):
            bad.append(name)
    return bad


def test_an_fp8_directory_decodes_through_its_bf16_shadow(published, tmp_path):
    store, states = published
    src = tmp_path / "bf16"
    src.mkdir()
    save_file(states[0], str(src / "model.safetensors"))
    d = tmp_path / "fp8"
    assert convert(src, d)["quantized"] > 0
    t = Fp8DirTarget(d)
    f = Follower(store, t, version=t.version)
    for v in (1, 2, 3):
        f.apply_version(v)
        assert _fp8_differs(d, states[v]) == []
    t.close()


class _Fused(torch.nn.Module):
    """A vLLM-style layer of LAYOUT's layer 1 plus q/k/v: its loader fuses q, k, v into one
    parameter and renames the rest."""

    def __init__(self):
        super().__init__()
        z = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.bfloat16), requires_grad=False)  # noqa: E731
        self.qkv = z(sum(LOADED[k][0] for k in QKV), LOADED[QKV[0]][1])
        self.down, self.up = z(*LOADED[DOWN]), z(*LOADED[UP])

    def load_weights(self, weights):
        for name, w in weights:
            if name in QKV:
                off = sum(LOADED[k][0] for k in QKV[:QKV.index(name)])
                self.qkv.data.narrow(0, off, w.shape[0]).copy_(w)
            else:
                (self.down if name == DOWN else self.up).data.copy_(w)


QKV = [f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv"]
DOWN, UP = "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight"
LOADED = {QKV[0]: (256, 256), QKV[1]: (128, 256), QKV[2]: (128, 256), DOWN: (256, 384), UP: (384, 256)}


def test_a_model_behind_its_loader_decodes_with_the_bits_it_holds(tmp_path):
    """The old bits are read back through the loader's copies, in canonical coordinates."""
    store = FileStore(tmp_path)
    states = _chain(3, layout=LOADED)
    pub = NamedPublisher(store, states[0], context="on")
    for s in states[1:]:
        assert pub.publish(s)["committed"]
    assert _context_chunks(store, 1) > 0
    model = _Fused()
    model.load_weights(list(states[0].items()))
    t = LoaderTarget(model, model.load_weights, {k: (torch.Size(s), torch.bfloat16) for k, s in LOADED.items()})
    Follower(store, t).follow(until=3, timeout=30)
    want = states[3]
    got = {"qkv": torch.cat([want[k] for k in QKV]), "down": want[DOWN], "up": want[UP]}
    assert same_bits({"qkv": model.qkv, "down": model.down, "up": model.up}, got)


class _NoBits:
    """A target that applies chunks but cannot read back what it holds (no flat views, no
    canonical read): it must refuse context-coded chunks by name."""

    def __init__(self, tensors):
        self.inner = StateDictTarget(tensors)

    def check(self, h):
        self.inner.check(h)

    def apply(self, decoded):
        self.inner.apply(decoded)

    def names(self):
        return self.inner.names()


def test_a_receiver_that_cannot_read_its_bits_refuses_by_name(published):
    store, states = published
    held = {k: t.clone() for k, t in states[0].items()}
    f = Follower(store, _NoBits(held), check_digests=False)
    with pytest.raises(codec.ChunkError, match="is context-coded, and this receiver \\(_NoBits\\) cannot read"):
        f.apply_version(1)
    assert same_bits(held, states[0])  # nothing applied


def test_other_old_bits_decode_other_positions_and_the_digests_refuse_them(tmp_path):
    """Decoded with the sender's old bits, the chunks give the new tensor; with a receiver's
    bits that differ (one value), positions shift and the applied result misses the record's
    digest: the check every receiver runs after an apply refuses it."""
    store = FileStore(tmp_path)
    old, new = adam_like(1 << 15, 3e-4, 1)
    commit.write_keyframe(store, 0, {"w": old})
    base = old.clone()
    d = take_delta(new, base, keep_new=True)
    terms = [0, 0]
    chunks = codec.encode_delta("w", d, span=1 << 13, terms=terms, current=new)
    assert sum(codec.parse_header(c).classes > 0 for c in chunks) > 0
    w = upload.RankWriter(store, 1, 0, 0, 1)
    for c in chunks:
        w.add(c)
    w.finish(d.numel, d.count, {"w": digest.move(digest.sum64(old), terms)})
    commit.run_commit(store, commit.seal_version(store, 1, 0, 1, timeout=10), commit.CommitPolicy())
    rec = commit.read_record(store, 1)

    def applied(held: torch.Tensor) -> torch.Tensor:
        out = held.clone()
        for c in chunks:
            for dc in codec.decode_parts(c, old=lambda h: held):
                codec.apply_decoded(dc, out.view(-1))
        return out

    right = applied(old)
    assert torch.equal(bits(right), bits(new))
    assert digest.hexd(digest.sum64(right)) == rec["digests"]["w"]
    drifted = old.clone()
    big = int(torch.argmax(old.abs()))  # a large value becomes a tiny one: its exponent class moves
    drifted[big] = torch.tensor(1e-6, dtype=torch.bfloat16)
    wrong = applied(drifted)
    assert digest.hexd(digest.sum64(wrong)) != rec["digests"]["w"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("native", ["bitmap walk", "rank walk", None])
def test_exponent_bytes_decode_as_the_bits_do(dtype, native, monkeypatch):
    """A GPU receiver hands the decoder its old tensors' exponent bytes (computed on the device,
    half of BF16's bytes cross to the host): the same changes come out as from the bits, with
    the compiled walk and without it; and exponent_bytes reads exactly the exponent field (signs,
    zeros, infinities and NaNs included)."""
    from nemo_dcr_callback.codec import context
    from nemo_dcr_callback.core import kernels

    if not native:
        monkeypatch.setattr(kernels, "native", lambda: None)
    monkeypatch.setenv("NEMO_DCR_BITMAP" if native == "bitmap walk" else "NEMO_DCR_NO_BITMAP", "1")
    old, new = adam_like((1 << 15) + 37, 3e-4, 1)  # (not whole 64-position blocks: the scalar tail too)
    old, new = old.to(dtype), new.to(dtype)
    old[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    new[:4] = old[:4]
    d = take_delta(new, old.clone(), keep_new=True)
    chunks = codec.encode_delta("w", d, span=1 << 13, current=new)
    assert sum(codec.parse_header(c).classes > 0 for c in chunks) > 0
    ex = context.exponent_bytes(old)
    for t in (old, old.float()):
        want = context.exponents(bits(t), context._NAMES[t.dtype])
        assert torch.equal(context.exponent_bytes(t), torch.from_numpy(want))
    by_bits, by_exp = old.clone(), old.clone()
    for c in chunks:
        for dc in codec.decode_parts(c, old=lambda h: old):
            codec.apply_decoded(dc, by_bits.view(-1))
        for dc in codec.decode_parts(c, old=lambda h: ex):
            codec.apply_decoded(dc, by_exp.view(-1))
    assert torch.equal(bits(by_bits), bits(new)) and torch.equal(bits(by_exp), bits(new))


def test_a_loader_target_on_the_host_reads_old_bits_on_the_host():
    """LoaderTarget.device names a GPU model's device (the follower then reads exponent bytes
    there); a host model has none, and canonical() reads to the host either way."""
    model = _Fused()
    model.load_weights(list(_chain(0, layout=LOADED)[0].items()))
    t = LoaderTarget(model, model.load_weights, {k: (torch.Size(s), torch.bfloat16) for k, s in LOADED.items()})
    assert t.device is None
    assert torch.equal(bits(t.canonical(DOWN, device=torch.device("cpu"))), bits(t.canonical(DOWN)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (issue 51's device run)")
def test_a_receiver_on_a_gpu_decodes_from_exponent_bytes(published):
    """A state dict on a GPU: the follower reads each context-coded tensor's exponent bytes on
    the device (context.exponent_bytes), decodes on the host, applies with the CUDA scatter."""
    store, states = published
    held = {k: t.clone().cuda() for k, t in states[0].items()}
    Follower(store, held).follow(until=3, timeout=60)
    assert same_bits({k: t.cpu() for k, t in held.items()}, states[3])
