"""Issue 66's probe of the delta file tools, findings 7, 8 and 13.

7. A 355 KB delta, inside every stated bound (the frame declares its size, at most 256x its
   stored size and 64 MiB of JSON), whose manifest holds millions of empty JSON objects:
   `stats` and `patch` peaked at 1.93 GB, since json.loads built them all before any check.
   Now the manifest's JSON is counted (containers and elements, a cheap byte scan) and its
   parse estimated before anything is built from it.
8. A 321-byte delta whose header claims a 1 GiB F32 tensor with `data_offsets [0, 4]`:
   `patch` peaked at 1.29 GB and wrote a 1 GB temporary file; the disk check had counted 80
   bytes. Now a header's offsets must match its tensors' shapes and dtypes and follow one
   another, the disk and memory checks count what will be written and built, and a tensor
   sent whole must have chunks that cover it before it is allocated.
13. 271 of 10,939 fuzzed manifests gave a traceback (`"other_files": null`, ...). Now every
   field's type and shape is checked, and the error names the field (the CLI exits 2).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest
import xxhash
import zstandard

from tests.helpers import GOLDEN
from tests.helpers.capped import bad_results, run_capped
from tests.helpers.cli import CLI

_HEAD = struct.Struct("<4sHH")
_FOOT = struct.Struct("<QQQ8s")
EXPECTED = ("(__import__('nemo_dcr_callback.tools.delta_manifest', fromlist=['x']).DeltaError, "
            "__import__('nemo_dcr_callback.codec', fromlist=['x']).ChunkError)")


def _golden_manifest() -> dict:
    data = (GOLDEN / "delta_v2.dcr").read_bytes()
    moff, mlen, _, _ = _FOOT.unpack(data[-_FOOT.size:])
    return json.loads(zstandard.ZstdDecompressor().decompress(data[moff:moff + mlen]))


def _with_manifest_json(dst: Path, text: bytes, level: int = 3, src: Path = GOLDEN / "delta_v2.dcr") -> None:
    """src's chunks and blobs, then `text` as its manifest (a zstd frame declaring its size)."""
    data = src.read_bytes()
    moff = _FOOT.unpack(data[-_FOOT.size:])[0]
    mb = zstandard.ZstdCompressor(level=level).compress(text)
    dst.write_bytes(data[:moff] + mb + _FOOT.pack(moff, len(mb), xxhash.xxh3_64_intdigest(mb), b"DCRDEND\x00"))


def _capped(paths: dict[str, Path], body: str) -> dict:
    """run_capped with the package imported and `paths` bound to names before the cap."""
    setup = ("import nemo_dcr_callback, torch\n"
             "from pathlib import Path\n"
             "from nemo_dcr_callback.tools.deltafile import stats\n"
             "from nemo_dcr_callback.tools.delta_patch import patch\n"
             + "".join(f"{k} = Path({str(v)!r})\n" for k, v in paths.items()))
    return run_capped(setup, body, expected=EXPECTED)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------- finding 7
def test_a_manifest_of_millions_of_empty_objects_is_refused_before_parsing(tmp_path):
    m = _golden_manifest()
    m["noise"] = os.urandom(300_000).hex()  # what keeps the frame within 256x its stored size
    head = json.dumps(m, separators=(",", ":")).encode()[:-1]
    n = ((64 << 20) - len(head) - 16) // 3
    text = head + b',"pad":[' + b"{}," * (n - 1) + b"{}]}"
    assert len(text) <= 64 << 20
    bomb = tmp_path / "objects.dcr"
    _with_manifest_json(bomb, text)
    assert bomb.stat().st_size < 400_000 and len(text) < 256 * bomb.stat().st_size  # inside the stated bounds

    got = _capped({"BOMB": bomb, "BASE": GOLDEN / "old", "OUT": tmp_path / "out"}, """
        case("stats", lambda: stats(BOMB))
        case("patch", lambda: patch(BASE, BOMB, OUT))
    """)
    assert bad_results(got) == [], got  # before: a MemoryError under the cap (1.93 GB without it)
    assert [r[1] for r in got["results"]] == ["error", "error"], got
    assert all("JSON" in r[2] and "manifest" in r[2] for r in got["results"]), got
    assert got["hwm_mb"] < 256, got
    p = _cli("patch", GOLDEN / "old", bomb, "-o", tmp_path / "out")
    assert p.returncode == 2 and "manifest" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- finding 8
def _one_tensor_delta(dst: Path, header: dict, chunks: list[int] | None = None) -> None:
    """A delta of no chunks for a single-file checkpoint with this safetensors header, every
    tensor sent whole (a few hundred bytes)."""
    names = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    numel = [int(__import__("math").prod(header[k]["shape"])) for k in names]
    m = {"format": "nemo-dcr-delta", "version": 2, "layout": "file",
         "files": [{"path": "model.safetensors", "header": json.dumps(header, separators=(",", ":"))}],
         "tensors": {"mode": "f" * len(names), "changed": numel, "chunks": [[0, 0] for _ in names]},
         "chunk_lengths": chunks or [], "old_digest": xxhash.xxh3_128().hexdigest(), "new_digest": "0" * 32,
         "bound_bits": {"positions": 0, "xor": 0, "ulp": 0},
         "totals": {"params": sum(numel), "dense_bytes": 4 * sum(numel), "xor_params": 0, "full_bytes": 0},
         "other_files": [], "removed": []}
    mb = zstandard.ZstdCompressor(level=19).compress(json.dumps(m, separators=(",", ":")).encode())
    dst.write_bytes(_HEAD.pack(b"DCRD", 2, 0) + mb + _FOOT.pack(_HEAD.size, len(mb), xxhash.xxh3_64_intdigest(mb),
                                                                  b"DCRDEND\x00"))


GIB_F32 = 1 << 28  # elements: 1 GiB of F32


@pytest.mark.parametrize("offsets,says", [
    ([0, 4], ("data offsets [0, 4]",)),  # the probe's: 1.29 GB resident and a 1 GB temporary file before
    # consistent offsets, but nothing to fill them (a disk with less than 1 GiB free refuses it first)
    ([0, 4 * GIB_F32], ("cover 0 of its 268435456 elements", "GB free at")),
])
def test_a_whole_tensor_claim_is_tied_to_its_offsets_and_chunks_before_allocating(tmp_path, offsets, says):
    delta = tmp_path / "claim.dcr"
    _one_tensor_delta(delta, {"w": {"dtype": "F32", "shape": [GIB_F32], "data_offsets": offsets}})
    assert delta.stat().st_size < 400
    base = GOLDEN / "old" / "model-00002-of-00002.safetensors"
    work = tmp_path / "work"
    work.mkdir()
    got = _capped({"DELTA": delta, "BASE": base, "OUT": work / "out.safetensors"}, """
        case("patch", lambda: patch(BASE, DELTA, OUT))
    """)
    assert bad_results(got) == [], got  # before: a MemoryError under the cap
    assert got["results"][0][1] == "error" and any(x in got["results"][0][2] for x in says), got
    assert got["hwm_mb"] < 256, got
    assert list(work.iterdir()) == []  # no temporary file left, nothing at OUT
    p = _cli("patch", base, delta, "-o", work / "out.safetensors")
    assert p.returncode == 2 and any(x in p.stderr for x in says), p.stderr[-2000:]
    assert "Traceback" not in p.stderr and list(work.iterdir()) == []


def test_a_consistent_claim_beyond_the_disk_is_refused_with_its_figures(tmp_path):
    """A header whose offsets do match a 4 TiB tensor: the disk check (which now adds up the
    spans the shapes take) refuses it with the figures before the layout and the change counts
    are looked at. A guard for the order of the checks: the previous code refused it too."""
    from nemo_dcr_callback.tools.delta_manifest import DeltaError
    from nemo_dcr_callback.tools.delta_patch import patch

    delta = tmp_path / "huge.dcr"
    n = 1 << 40
    _one_tensor_delta(delta, {"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}})
    with pytest.raises(DeltaError, match=r"takes 4398\.0 GB .* free at"):
        patch(GOLDEN / "old" / "model-00002-of-00002.safetensors", delta, tmp_path / "out.safetensors")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["huge.dcr"]


# ------------------------------------------------------------------------------ finding 13
def _set(path: str, value):
    """A mutation of the golden manifest: the field at a dotted path set to value (a missing
    value deletes it)."""
    def apply(m: dict) -> None:
        *up, last = path.split(".")
        for k in up:
            m = m[int(k)] if isinstance(m, list) else m[k]
        if value is _DROP:
            del m[last]
        elif isinstance(m, list):
            m[int(last)] = value
        else:
            m[last] = value
    return apply


_DROP = object()
MALFORMED = [
    ("other_files", None, "'other_files'"),
    ("other_files.0", "config.json", "other_files"),
    ("other_files.0.digest", None, "digest"),
    ("files", None, "'files'"),
    ("files", [], "'files'"),
    ("files.0", None, "files"),
    ("files.0.header_digest", 5, "header"),
    ("files.1.header", ["x"], "header"),
    ("tensors", None, "'tensors'"),
    ("tensors.mode", 7, "mode"),
    ("tensors.mode", "xxxxxxxxfq", "mode"),
    ("tensors.changed", None, "changed"),
    ("tensors.changed.0", -1, "changed"),
    ("tensors.changed.0", "3", "changed"),
    ("tensors.chunks.0", None, "chunks"),
    ("chunk_lengths", None, "'chunk_lengths'"),
    ("chunk_lengths.0", 1e300, "chunk_lengths"),
    ("totals", None, "'totals'"),
    ("totals.params", None, "params"),
    ("totals.params", "NaN", "params"),
    ("bound_bits", [], "'bound_bits'"),
    ("bound_bits.xor", None, "xor"),
    ("removed", None, "'removed'"),
    ("removed.0", 5, "removed"),
    ("old_digest", None, "'old_digest'"),
    ("new_digest", _DROP, "'new_digest'"),
    ("layout", _DROP, "layout"),
    ("totals", _DROP, "'totals'"),
]


def test_every_malformed_manifest_field_is_a_clear_error(tmp_path):
    """The probe's tracebacks (TypeError, KeyError, AttributeError): each field of the wrong
    type or shape is now an error naming it, in stats and patch, before anything is written."""
    paths = {}
    for i, (field, value, _) in enumerate(MALFORMED):
        m = _golden_manifest()
        _set(field, value)(m)
        paths[f"D{i}"] = tmp_path / f"bad{i}.dcr"
        _with_manifest_json(paths[f"D{i}"], json.dumps(m).encode())
    cases = "".join(f"case('stats {i}', lambda: stats(D{i}))\ncase('patch {i}', lambda: patch(BASE, D{i}, OUT))\n"
                    for i in range(len(MALFORMED)))
    got = _capped({**paths, "BASE": GOLDEN / "old", "OUT": tmp_path / "out"}, cases)
    assert bad_results(got) == [], [r for r in bad_results(got)]
    for name, state, msg in got["results"]:
        field, value, says = MALFORMED[int(name.split()[1])]
        assert state == "error" and says in msg, (field, value, name, msg)
    assert not (tmp_path / "out").exists()
    p = _cli("patch", GOLDEN / "old", paths["D0"], "-o", tmp_path / "out")
    assert p.returncode == 2 and "'other_files'" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    p = _cli("stats", paths["D0"])
    assert p.returncode == 2 and "'other_files'" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists()
