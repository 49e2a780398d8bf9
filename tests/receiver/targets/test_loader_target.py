"""Applying versions through a model's own loader: a vLLM-style model whose load_weights()
fuses q/k/v into qkv_proj and gate/up into gate_up_proj must end on exactly the fused layout
of the new canonical tensors (the oracle: torch.cat of the expected tensors), with XOR, ulp
and overwrite (residual) chunks all placed by the model's code."""

from __future__ import annotations

import pytest
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.core import delta
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.protocol import commit, upload
from nemo_dcr_callback.protocol.rebuild import read_version
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.receiver.targets import LoaderTarget
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.tensors import perturb, random_tensor

H, Q, KV, F = 32, 32, 16, 48
SHAPES = {
    "model.layers.0.self_attn.q_proj.weight": (Q, H), "model.layers.0.self_attn.k_proj.weight": (KV, H),
    "model.layers.0.self_attn.v_proj.weight": (KV, H), "model.layers.0.self_attn.o_proj.weight": (H, Q),
    "model.layers.0.mlp.gate_proj.weight": (F, H), "model.layers.0.mlp.up_proj.weight": (F, H),
    "model.layers.0.mlp.down_proj.weight": (H, F), "model.layers.0.input_layernorm.weight": (H,),
}
STACKED = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", Q), ("qkv_proj", "v_proj", Q + KV),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", F)]


class FusedModel(torch.nn.Module):
    """Parameters the way vLLM lays them out; load_weights renames, fuses and splits."""

    def __init__(self, transform: bool = False):
        super().__init__()
        z = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.bfloat16), requires_grad=False)  # noqa: E731
        self.qkv_proj, self.o_proj = z(Q + 2 * KV, H), z(H, Q)
        self.gate_up_proj, self.down_proj, self.norm = z(2 * F, H), z(H, F), z(H)
        self.transform = transform

    def load_weights(self, weights):
        for name, w in weights:
            for fused, part, off in STACKED:
                if f".{part}." in name:
                    getattr(self, fused).data.narrow(0, off, w.shape[0]).copy_(w)
                    break
            else:
                short = {"o_proj": "o_proj", "down_proj": "down_proj", "input_layernorm": "norm"}
                key = next(v for k, v in short.items() if f".{k}." in name)
                src = w * 1.0 if self.transform and key == "norm" else w  # a value transform
                getattr(self, key).data.copy_(src)


def fused(state):
    p = "model.layers.0."
    return {"qkv_proj": torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            "o_proj": state[p + "self_attn.o_proj.weight"], "down_proj": state[p + "mlp.down_proj.weight"],
            "gate_up_proj": torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]),
            "norm": state[p + "input_layernorm.weight"]}


def _publish(store, v, old, new):
    chunks = []
    for n in sorted(old):
        d = delta.take_delta(new[n], old[n].clone(), keep_new=True)
        if "layernorm" in n:  # the residual way: overwrite chunks
            chunks += codec.encode_overwrite(n, new[n], d.positions)
        else:
            chunks += codec.encode_delta(n, d)
    headers = [codec.parse_header(c) for c in chunks]
    upload.write_rank(store, v, v - 1, 0, 1, chunks, sum(t.numel() for t in old.values()),
                      sum(h.count for h in headers), digests={n: digest.sum64(t) for n, t in new.items()})
    rec = commit.seal_version(store, v, v - 1, 1, timeout=5)
    commit.run_commit(store, rec, commit.CommitPolicy())


def _states(n=3):
    g = torch.Generator().manual_seed(3)
    states = [{k: random_tensor(s, torch.bfloat16, g, specials=False) for k, s in SHAPES.items()}]
    for _ in range(n):
        states.append({k: perturb(t, 0.1, g) for k, t in states[-1].items()})
    return states


def _chain(tmp_path, n=3):
    """A file store holding versions 1..n of _states(n), committed."""
    store = FileStore(tmp_path)
    states = _states(n)
    for v in range(1, n + 1):
        _publish(store, v, states[v - 1], states[v])
    return store, states


SHAPES_BF16 = {k: (torch.Size(s), torch.bfloat16) for k, s in SHAPES.items()}


def test_loader_path_fuses_and_splits(tmp_path):
    store, states = _chain(tmp_path)
    model = FusedModel()
    model.load_weights(states[0].items())  # the dense start
    target = LoaderTarget(model, model.load_weights, SHAPES_BF16)
    assert all(target.plain.values())
    kinds = set()
    f = Follower(store, target)
    assert not f.unchecked  # every tensor digested through the loader's copies
    while f.version < 3:
        v = f.version + 1
        kinds |= {codec.parse_header(c).value_mode for c in read_version(store, v)[1]}
        assert f.apply_version(v).digest_checked
        want = fused(states[v])
        for k, t in want.items():
            assert torch.equal(bits(getattr(model, k).data), bits(t)), (v, k)
    assert codec.ValueMode.ULP in kinds  # the ulp path went through the dispatch mode too


def test_transforming_loader_is_refused(tmp_path):
    store = FileStore(tmp_path)
    states = _states(1)
    _publish(store, 1, states[0], states[1])
    model = FusedModel(transform=True)
    model.load_weights(states[0].items())
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    target = LoaderTarget(model, model.load_weights, SHAPES_BF16)
    assert not target.plain["model.layers.0.input_layernorm.weight"]
    with pytest.raises(codec.ChunkError, match="transforms"):
        Follower(store, target).apply_version(1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing applied


class SplitModel(torch.nn.Module):
    """A loader that splits o_proj by rows into two parameters (each copy takes a part of the
    tensor it is given, at an offset), keeps down_proj transposed (a strided destination) and
    fuses the rest as FusedModel does."""

    def __init__(self):
        super().__init__()
        self.inner = FusedModel()
        z = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.bfloat16), requires_grad=False)  # noqa: E731
        self.o_top, self.o_bottom, self.down_t = z(H // 2, Q), z(H - H // 2, Q), z(F, H)

    def load_weights(self, weights):
        rest = []
        for name, w in weights:
            if ".o_proj." in name:
                self.o_top.data.copy_(w[: H // 2])
                self.o_bottom.data.copy_(w[H // 2:])
            elif ".down_proj." in name:
                self.down_t.data.t().copy_(w)
            else:
                rest.append((name, w))
        self.inner.load_weights(rest)

    def layout(self) -> dict[str, torch.Tensor]:
        out = {k: getattr(self.inner, k).data for k in ("qkv_proj", "gate_up_proj", "norm")}
        out["o_proj"] = torch.cat([self.o_top.data, self.o_bottom.data])
        out["down_proj"] = self.down_t.data.t()
        return out


@pytest.mark.parametrize("sparse", [True, False])
def test_loader_path_splits_rows_and_writes_strided_destinations(tmp_path, sparse):
    """Copies of a part of a tensor (row splits) take only that part's changes, at the right
    offset, without the dense scratch; a strided destination goes through the dense scratch.
    Both end on the dense layout of the new tensors (the oracle), over three versions with
    XOR, ulp and overwrite chunks."""
    store, states = _chain(tmp_path)
    model = SplitModel()
    model.load_weights(states[0].items())
    target = LoaderTarget(model, model.load_weights, SHAPES_BF16,
                          sparse=sparse)
    assert all(target.plain.values())
    f = Follower(store, target)
    assert not f.unchecked and target._segments["model.layers.0.mlp.down_proj.weight"] is None  # read densely
    while f.version < 3:
        assert f.apply_version(f.version + 1).digest_checked
        want, got = fused(states[f.version]), model.layout()
        for k, t in want.items():
            assert torch.equal(bits(got[k].contiguous()), bits(t)), (f.version, k)
    # per version: o_proj's two row copies and the fused/renamed ones sparse, down_proj's
    # transposed destination located by its strides (sparse=False: every copy dense)
    if sparse:
        assert target.copies["strided"] == 3 and target.copies["dense"] == 0 and target.copies["sparse"] >= 3 * 7
    else:
        assert target.copies["dense"] >= 3 * 8 and target.copies["sparse"] == target.copies["strided"] == 0


def test_a_model_off_the_version_is_caught_by_the_digests_read_through_its_loader(tmp_path):
    """The version's digests are checked in canonical coordinates, read where the loader put
    each element: a model that does not hold version 0 (one element of its fused qkv wrong) is
    refused before anything changes; one damaged after it started, where the next version
    changes it, is caught after that apply."""
    store = FileStore(tmp_path)
    states = _states(2)
    commit.write_keyframe(store, 0, states[0])  # version 0's digests
    for v in (1, 2):
        _publish(store, v, states[v - 1], states[v])
    shapes = SHAPES_BF16
    model = FusedModel()
    model.load_weights(states[0].items())
    bits(model.qkv_proj.data)[(Q + 3) * H + 5] ^= 1  # k_proj[3, 5], one bit
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(codec.ChunkError, match="does not hold version 0.*k_proj"):
        Follower(store, LoaderTarget(model, model.load_weights, shapes))
    assert all(torch.equal(bits(before[k]), bits(v)) for k, v in model.state_dict().items())

    model = FusedModel()
    model.load_weights(states[0].items())
    f = Follower(store, LoaderTarget(model, model.load_weights, shapes))
    assert f.apply_version(1).digest_checked
    # one bit of up_proj that version 2 changes, flipped after the check of version 1 (the
    # digests follow the changes: damage elsewhere shows only where a later version touches it)
    up = "model.layers.0.mlp.up_proj.weight"
    p = int(torch.nonzero(bits(states[1][up]).reshape(-1) != bits(states[2][up]).reshape(-1))[0])
    bits(model.gate_up_proj.data)[F * H + p] ^= 1
    with pytest.raises(codec.ChunkError, match="up_proj.*does not match"):
        f.apply_version(2)


class ColumnShardModel(torch.nn.Module):
    """A tensor-parallel rank's share of o_proj (row-parallel: columns Q/2.. of it, taken by
    narrowing the tensor it is given along dimension 1, a strided view); the rest as
    FusedModel."""

    def __init__(self):
        super().__init__()
        self.inner = FusedModel()
        self.o_shard = torch.nn.Parameter(torch.zeros(H, Q - Q // 2, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        rest = []
        for name, w in weights:
            if ".o_proj." in name:
                self.o_shard.data.copy_(w.narrow(1, Q // 2, Q - Q // 2))
            else:
                rest.append((name, w))
        self.inner.load_weights(rest)


def test_a_column_shard_takes_only_its_columns_changes(tmp_path):
    """A copy of a strided part of the tensor given (a column shard) takes exactly the changes
    in those columns, located by index, not through a dense scratch; the model holds only part
    of o_proj, so that tensor's digest cannot be read (left unchecked), the others are."""
    store, states = _chain(tmp_path)
    model = ColumnShardModel()
    model.load_weights(states[0].items())
    target = LoaderTarget(model, model.load_weights, SHAPES_BF16)
    f = Follower(store, target)
    assert f.unchecked == {"model.layers.0.self_attn.o_proj.weight"}
    o = "model.layers.0.self_attn.o_proj.weight"
    while f.version < 3:
        a = f.apply_version(f.version + 1)
        assert a.digest_checked and a.unchecked == 1  # o_proj changed, and only it is held in part
        assert torch.equal(bits(model.o_shard.data), bits(states[f.version][o][:, Q // 2:].contiguous())), f.version
        want = fused(states[f.version])
        for k in ("qkv_proj", "gate_up_proj", "down_proj", "norm"):
            assert torch.equal(bits(getattr(model.inner, k).data), bits(want[k])), (f.version, k)
    assert target.copies["strided"] == 3 and target.copies["dense"] == 0


def test_an_engine_that_changes_its_layout_after_loading_is_refused(tmp_path):
    """integrations/vllm._check_against: the model, read back through its loader's copies, must
    hold the checkpoint it was loaded from; a layout changed after loading (vLLM's CPU backend
    prepacks MoE experts) is refused by name before anything is applied."""
    from safetensors.torch import save_file

    from nemo_dcr_callback.integrations.vllm import _check_against

    g = torch.Generator().manual_seed(0)
    ck = {"a.weight": torch.randn(8, 4, generator=g).bfloat16(), "b.weight": torch.randn(6, generator=g).bfloat16()}
    save_file(ck, str(tmp_path / "model.safetensors"))
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(ck["a.weight"].clone(), requires_grad=False)
    model.b = torch.nn.Parameter(ck["b.weight"].clone(), requires_grad=False)
    params = {"a.weight": model.a, "b.weight": model.b}

    def load(items):
        for n, t in items:
            params[n].data.copy_(t)

    target = LoaderTarget(model, load, {n: (t.shape, t.dtype) for n, t in ck.items()})
    _check_against(target, str(tmp_path))  # holds what it loaded: accepted
    with torch.no_grad():
        model.a.data.copy_(model.a.data.flip(0))  # "prepacked": the same values, another layout
    with pytest.raises(ValueError, match="does not hold 'a.weight' as its loader wrote it"):
        _check_against(target, str(tmp_path))
