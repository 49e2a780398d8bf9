"""Fuzzing the delta file tools (issue 66): a golden delta's manifest and its chunks' headers,
mutated from a fixed seed, fed to `stats`, `patch` and the codec's chunk parsing.

Every case must end in a clear refusal (DeltaError, ChunkError: both name the problem) or be
accepted; never a traceback (KeyError, TypeError, IndexError, ...) nor a MemoryError under
tests/helpers/capped.py's cap (256 MB over the process's size once set up), and the peak
resident set must stay below that. After a refused patch, nothing is left at OUT or beside it.

Manifest mutations: a field's value swapped for another type (null, lists, objects, strings,
huge, negative and fractional numbers, NaN), keys dropped or added, values wrapped in extra
nesting, integers nudged, a carried safetensors header's entries mutated the same way, and the
JSON text itself cut, flipped or padded. Chunk mutations: bit flips in the header, the stream
table and a batch's member table, truncations, every varint of the header set to huge or off
by one values, other dtype, version and flag bytes; most with the checksum redone, so that the
parse goes past it. The chunks are the golden ones plus context-coded, ULP, sparse overwrite
and batched ones encoded here. Every fifth case of a golden chunk also goes through `patch`.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import xxhash
import zstandard

from nemo_dcr_callback.codec.format import varint
from tests.helpers.capped import bad_results, run_capped

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
SEED = 66
MANIFEST_CASES = 1200
CHUNK_CASES = 1500
_FOOT = struct.Struct("<QQQ8s")
EXPECTED = ("(__import__('nemo_dcr_callback.tools.delta_manifest', fromlist=['x']).DeltaError, "
            "__import__('nemo_dcr_callback.codec', fromlist=['x']).ChunkError)")

VALUES = [None, True, False, 0, -1, 1, 255, 2**31, 2**63 - 1, 2**63, 2**64 + 1, 10**30, -10**30, 1.5, -0.0,
          float("nan"), float("inf"), "", "zz", "NaN", "\ud800", "x" * 300, "../escape", "F32", [], [0], [0, 4],
          [-5, 3], [None], [[[[[]]]]], {}, {"a": None}, {"a": {"b": [1, {"c": []}]}}]
HUGE = [0, 1, 2**31, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**70]


# ------------------------------------------------------------------------------ manifests
def _locations(x, path=()) -> Iterator[tuple]:
    """The path of every value below x (dict keys and list indices)."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield (*path, k)
            yield from _locations(v, (*path, k))
    elif isinstance(x, list):
        for i, v in enumerate(x[:64]):  # (long lists: their first entries stand for the rest)
            yield (*path, i)
            yield from _locations(v, (*path, i))


def _parent(x, path: tuple):
    for k in path[:-1]:
        x = x[k]
    return x


def _mutate(rng: random.Random, x) -> None:
    """One mutation of the JSON value x, in place: a type swap, a drop, an addition, extra
    nesting or a nudged number at a random place."""
    locs = list(_locations(x))
    if not locs:
        return
    path = rng.choice(locs)
    up, key = _parent(x, path), path[-1]
    op = rng.random()
    if op < 0.45:
        up[key] = copy.deepcopy(rng.choice(VALUES))
    elif op < 0.6:
        del up[key]
    elif op < 0.7:
        up[key] = [up[key]] if rng.random() < 0.5 else {"v": up[key]}
    elif op < 0.8:
        target = up if isinstance(up, dict) else x
        target[rng.choice(["extra", "__metadata__", "chunks", "header", "same", "blob"])] = copy.deepcopy(
            rng.choice(VALUES))
    elif op < 0.9 and type(up[key]) is int:
        v = up[key]
        up[key] = rng.choice([v + 1, v - 1, -v, v * 2**20, 2**63 - 1, v * 4 + 4])
    elif isinstance(up[key], list) and up[key]:
        up[key].append(copy.deepcopy(up[key][0]) if rng.random() < 0.5 else up[key][0])
    elif isinstance(up[key], str):
        up[key] = rng.choice([up[key][: len(up[key]) // 2], up[key] + "x", up[key].upper(), ""])
    else:
        up[key] = copy.deepcopy(rng.choice(VALUES))


def _mutate_header(rng: random.Random, m: dict) -> None:
    """A mutation of a safetensors header the manifest carries (a string of JSON)."""
    carried = [f for f in m.get("files", []) if isinstance(f, dict) and isinstance(f.get("header"), str)]
    if not carried:
        return _mutate(rng, m)
    f = rng.choice(carried)
    h = json.loads(f["header"])
    name = rng.choice([n for n in h if n != "__metadata__"])
    e = h[name]
    op = rng.random()
    if op < 0.3:
        e["dtype"] = rng.choice(["F64", "F32", "BF16", "U16", "BOOL", "zz", "\ud800", 5, None])
    elif op < 0.55:
        e["shape"] = rng.choice([[2**28], [2**40], [0], [-1], [1, 2**62], [3, 3], "4", None, [1.5]])
    elif op < 0.8:
        b = e["data_offsets"][0]
        e["data_offsets"] = rng.choice([[b, b + 4], [0, 2**30], [b, b + 2**40], [b + 1, b], [-4, b], [b], None,
                                        [b, "9"]])
    else:
        _mutate(rng, h)
    f["header"] = json.dumps(h, separators=(",", ":"))


def _text_mutation(rng: random.Random, text: bytes) -> bytes:
    """The manifest's JSON text itself: cut, a byte changed, padding, deep nesting, a number
    of thousands of digits, a count bomb."""
    op = rng.randrange(7)
    if op == 0:
        return text[: rng.randrange(len(text))]
    if op == 1:
        i = rng.randrange(len(text))
        return text[:i] + bytes([rng.randrange(256)]) + text[i + 1:]
    if op == 2:
        return text + rng.choice([b" ", b"{}", b"\x00", b"\xff"])
    if op == 3:
        return text[:-1] + b',"deep":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    if op == 4:
        return text[:-1] + b',"big":' + b"9" * 5000 + b"}"
    if op == 5:
        return text[:-1] + b',"pad":[' + b"[]," * 1_000_000 + b"[]]}"
    return text[:-1] + b',"s":"' + b"a" * 1000 + b'\\ud83d\\ude00"}'


def manifest_cases(rng: random.Random, m: dict, n: int) -> Iterator[tuple[str, bytes]]:
    """(name, manifest JSON) for n mutations of the manifest m."""
    for i in range(n):
        mm = copy.deepcopy(m)
        kind = rng.random()
        if kind < 0.25:
            _mutate_header(rng, mm)
            yield f"manifest {i} (header)", json.dumps(mm, separators=(",", ":")).encode()
            continue
        if kind > 0.93:
            yield f"manifest {i} (text)", _text_mutation(rng, json.dumps(mm, separators=(",", ":")).encode())
            continue
        for _ in range(1 if rng.random() < 0.7 else rng.randint(2, 4)):
            _mutate(rng, mm)
        yield f"manifest {i}", json.dumps(mm, separators=(",", ":")).encode()


# --------------------------------------------------------------------------------- chunks
def _fields(c: bytes, n_streams: int) -> tuple[list[tuple[int, int, int]], int]:
    """([(start, end, value) of every varint of the chunk's header], where the payload starts)."""
    spans, off = [], 7

    def v() -> int:
        nonlocal off
        s, n, shift = off, 0, 0
        while True:
            b = c[off]
            off += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        spans.append((s, off, n))
        return n

    flags = c[5]
    for _ in range(4):
        v()
    if flags & 0x80:
        v()
    if flags & 0x40:
        v(), v()
        stored = v()
        off += 1 + stored
    else:
        off += v()
    for _ in range(n_streams):
        v(), v()
        off += 1
    return spans, off


def _resum(c: bytes) -> bytes:
    """c with its last 8 bytes the checksum of the rest (as a crafter would write it)."""
    return c[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(c[:-8])) if len(c) > 8 else c


def mutate_chunk(rng: random.Random, c: bytes, n_streams: int) -> tuple[str, bytes]:
    """One mutation of chunk c: (what, the bytes)."""
    spans, payload = _fields(c, n_streams)
    fix = rng.random() < 0.85
    op = rng.randrange(8)
    if op == 0:  # bits of the header, stream table and member table
        b = bytearray(c)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(4, payload)
            b[i] ^= 1 << rng.randrange(8)
        what, out = "flip", bytes(b)
    elif op == 1:
        what, out = "truncate", c[: rng.randrange(len(c))]
    elif op in (2, 3):  # a size or count set huge or off by one
        s, e, val = rng.choice(spans)
        new = rng.choice([*HUGE, val + 1, max(val - 1, 0), val * 2, val * 1000])
        what, out = f"varint@{s}={new}", c[:s] + varint(new) + c[e:]
    elif op == 4:
        i = rng.choice([4, 5, 6])
        what, out = f"byte@{i}", c[:i] + bytes([rng.randrange(256)]) + c[i + 1:]
    elif op == 5:  # the payload: the streams' bytes
        b = bytearray(c)
        for _ in range(rng.randint(1, 4)):
            if len(b) - 8 > payload:
                b[rng.randrange(payload, len(b) - 8)] ^= 1 << rng.randrange(8)
        what, out = "payload", bytes(b)
    elif op == 6:
        what, out = "pad", c[:-8] + bytes(rng.randrange(1, 64)) + c[-8:]
    else:  # a varint that never ends
        s, e, _ = rng.choice(spans)
        what, out = "endless varint", c[:s] + b"\xff" * rng.choice([9, 11, 40]) + c[e:]
    return what, (_resum(out) if fix else out)


def _extra_chunks() -> list[tuple[bytes, dict]]:
    """Chunks the golden delta lacks: context-coded, ULP, sparse overwrite, a wide batch; with
    BASE's tensor of each name (what context decoding reads)."""
    import torch

    from nemo_dcr_callback import codec
    from nemo_dcr_callback.core.delta import take_delta

    g = torch.Generator().manual_seed(SEED)
    old = torch.randn(1 << 14, generator=g).to(torch.bfloat16)
    out = []
    for rate in (0.01, 0.3, 0.9):
        new = old.clone()
        hit = torch.rand(old.shape, generator=g) < rate
        new[hit] = (old[hit].float() * 1.001 + 1e-3).to(torch.bfloat16)
        d = take_delta(new.clone(), old.clone(), keep_new=True)
        out += [(c, {"w": old}) for c in codec.encode_delta("w", d, old=old)]
    f32 = torch.randn(1 << 16, generator=g)
    pos = torch.unique(torch.randint(0, 1 << 16, (300,), generator=g))
    out += [(c, {"v": f32}) for c in codec.encode_overwrite("v", f32, pos.to(torch.int32))]
    members, olds = [], {}
    for i in range(40):
        name = f"model.layers.{i}.post_attention_layernorm.weight"
        t = torch.zeros(64, dtype=torch.bfloat16)
        members.append((name, 64, torch.tensor([i % 64]), torch.tensor([1 + i], dtype=torch.int16),
                        torch.tensor([3], dtype=torch.int16)))
        olds[name] = t
    out.append((codec.encode_batch(torch.bfloat16, members), olds))
    return out


class Fuzz:
    """The fuzzing session inside the capped process: the golden delta read, cases run."""

    def __init__(self, work: Path):
        from nemo_dcr_callback import codec
        from nemo_dcr_callback.codec.checkpoint import Checkpoint

        self.work = work
        self.src = (GOLDEN / "delta_v3.dcr").read_bytes()
        moff, mlen, _, _ = _FOOT.unpack(self.src[-_FOOT.size:])
        self.manifest = json.loads(zstandard.ZstdDecompressor().decompress(self.src[moff:moff + mlen]))
        self.moff = moff
        base = Checkpoint(GOLDEN / "old")
        off, self.chunks = 8, []  # (bytes, BASE's tensors by name, index in the delta or None)
        for k, n in enumerate(self.manifest["chunk_lengths"]):
            c = self.src[off:off + n]
            h = codec.parse_header(c)
            self.chunks.append((c, {p.name: base.tensor(p.name).reshape(-1) for p in h.parts()
                                    if p.name in base.where}, k))
            off += n
        self.chunks += [(c, olds, None) for c, olds in _extra_chunks()]
        (work / "d").mkdir()
        (work / "o").mkdir()
        self.delta, self.out = work / "d" / "delta.dcr", work / "o" / "out"
        self.zc = zstandard.ZstdCompressor(level=3)

    def write(self, body: bytes, manifest: bytes) -> None:
        mb = self.zc.compress(manifest)
        self.delta.write_bytes(body + mb + _FOOT.pack(len(body), len(mb), xxhash.xxh3_64_intdigest(mb),
                                                      b"DCRDEND\x00"))

    def patch(self) -> None:
        """patch into OUT; after a refusal nothing may be at OUT or beside it."""
        from nemo_dcr_callback.tools.delta_patch import patch

        try:
            patch(GOLDEN / "old", self.delta, self.out, quiet=True)
        except BaseException:
            left = list(self.out.parent.iterdir())
            if left:
                raise AssertionError(f"a refused patch left {left}") from None
            raise
        if self.out.is_dir():  # (an accepted mutation: an extra key, a field no one reads)
            shutil.rmtree(self.out)
        else:
            self.out.unlink()

    def codec_case(self, buf: bytes, original: bytes, olds: dict) -> None:
        """What patch does with a chunk: parse, check every tensor's claim against its target
        (here: the unmutated chunk's), then decode."""
        import torch

        from nemo_dcr_callback import codec

        want = {p.name: p for p in codec.parse_header(original).parts()}
        h = codec.parse_header(buf)
        for p in h.parts():
            w = want.get(p.name)
            if w is None or w.numel != p.numel or w.dtype != p.dtype:
                raise codec.ChunkError(f"chunk claims {p.name!r} of {p.numel} {p.dtype.name}")

        def old(p: codec.ChunkHeader) -> torch.Tensor:
            if p.name not in olds:
                raise codec.ChunkError(f"no base tensor {p.name!r}")
            return olds[p.name]

        codec.decode_parts(buf, h, old)

    def patched_chunk(self, k: int, buf: bytes) -> None:
        """The golden delta with chunk k replaced by buf (lengths and blob offsets redone)."""
        m = copy.deepcopy(self.manifest)
        lengths = m["chunk_lengths"]
        off = 8 + sum(lengths[:k])
        body = self.src[:off] + buf + self.src[off + lengths[k]:self.moff]
        for o in m["other_files"]:
            if "blob" in o:
                o["blob"][0] += len(buf) - lengths[k]
        lengths[k] = len(buf)
        if not buf:
            raise ValueError("(an empty chunk cannot be listed)")
        self.write(body, json.dumps(m, separators=(",", ":")).encode())
        self.patch()

    def run(self, case: Callable) -> None:
        from nemo_dcr_callback import codec
        from nemo_dcr_callback.tools.deltafile import stats

        rng = random.Random(SEED)
        body = self.src[:self.moff]
        for name, text in manifest_cases(rng, self.manifest, MANIFEST_CASES):
            self.write(body, text)
            case(name + " stats", lambda: stats(self.delta))
            case(name + " patch", self.patch)
        for i in range(CHUNK_CASES):
            c, olds, k = rng.choice(self.chunks)
            what, buf = mutate_chunk(rng, c, len(codec.parse_header(c).streams))
            case(f"chunk {i} {what}", lambda buf=buf, c=c, olds=olds: self.codec_case(buf, c, olds))
            case(f"chunk {i} {what} split", lambda buf=buf: codec.split_chunks(buf + self.chunks[0][0]))
            if k is not None and buf and i % 5 == 0:
                case(f"chunk {i} {what} patch", lambda buf=buf, k=k: self.patched_chunk(k, buf))


def test_fuzzed_manifests_and_chunk_headers_are_refused_clearly(tmp_path):
    setup = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
             "import torch, nemo_dcr_callback.tools.delta_patch, nemo_dcr_callback.tools.deltafile\n"
             "from pathlib import Path\n"
             "from tests.security.test_fuzz_delta import Fuzz\n"
             f"fuzz = Fuzz(Path({str(tmp_path)!r}))\n")
    got = run_capped(setup, "fuzz.run(case)\n", expected=EXPECTED, timeout=600)
    bad = bad_results(got)
    assert bad == [], f"{len(bad)} of {len(got['results'])} cases: " + "\n\n".join(f"{n}: {d}" for n, _, d in bad[:5])
    assert got["hwm_mb"] < 256, got["hwm_mb"]
    states = [r[1] for r in got["results"]]
    assert len(states) > 2 * (MANIFEST_CASES + CHUNK_CASES) and states.count("error") > len(states) // 2
