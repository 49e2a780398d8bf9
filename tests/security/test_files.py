"""Issue 38, findings 1 and 6: crafted delta manifests and `diff -o` over its own inputs.

The manifest's checksum is unkeyed, so an attacker edits the manifest and re-signs the footer;
these tests do exactly that and require a clear refusal with every file left as it was.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import xxhash
import zstandard

from tests.helpers.cli import EXE as CLI

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
_FOOT = struct.Struct("<QQQ8s")


def run(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True)


def resign(src: Path, dst: Path, edit) -> None:
    """dst = src with its manifest passed through edit(manifest) and the footer re-signed."""
    data = src.read_bytes()
    moff, mlen, _, end = _FOOT.unpack(data[-_FOOT.size:])
    m = json.loads(zstandard.ZstdDecompressor().decompress(data[moff:moff + mlen]))
    edit(m)
    mb = zstandard.ZstdCompressor().compress(json.dumps(m, separators=(",", ":")).encode())
    dst.write_bytes(data[:moff] + mb + _FOOT.pack(moff, len(mb), xxhash.xxh3_64_intdigest(mb), end))


def digest_tree(p: Path) -> dict[str, str]:
    return {str(f.relative_to(p)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(p.rglob("*"))
            if f.is_file()}


@pytest.fixture()
def work(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(GOLDEN / "old", base)
    victim = tmp_path / "victim.safetensors"
    shutil.copy(GOLDEN / "new" / "model-00002-of-00002.safetensors", victim)
    return tmp_path, base, victim


def point_file_at(target: str):
    def edit(m):
        m["files"][0]["path"] = target
    return edit


def point_other_at(target: str):
    def edit(m):
        m["other_files"][0]["path"] = target
    return edit


@pytest.mark.parametrize("edit,what", [
    (lambda victim: point_file_at(str(victim)), "absolute file path"),
    (lambda victim: point_file_at("../victim.safetensors"), "file path with .."),
    (lambda victim: point_other_at(str(victim.with_name("planted.json"))), "absolute other_files path"),
    (lambda victim: point_other_at("../planted.json"), "other_files path with .."),
    (lambda victim: point_other_at("model-00001-of-00002.safetensors"), "a name written twice"),
])
def test_crafted_manifest_is_refused_before_any_write(work, edit, what):
    tmp, base, victim = work
    evil = tmp / "evil.dcr"
    resign(GOLDEN / "delta_v2.dcr", evil, edit(victim))
    before = digest_tree(tmp)
    p = run("patch", base, evil, "-o", tmp / "out")
    assert p.returncode == 2, (what, p.stdout, p.stderr)
    assert "manifest" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp / "out").exists()
    assert not (tmp / "planted.json").exists()
    assert digest_tree(tmp) == before  # the victim still in place, nothing left behind


@pytest.mark.parametrize("edit,says", [
    (lambda m: m["tensors"]["chunks"].__setitem__(0, [len(m["chunk_lengths"]), 1]), "refers to chunks"),
    (lambda m: m["tensors"].update(mode=m["tensors"]["mode"][:-1]), "malformed"),
    (lambda m: m["chunk_lengths"].__setitem__(0, -5), "malformed"),
])
def test_manifest_tensor_table_must_hold_together(work, edit, says):
    """A chunk index out of range, a table shorter than the headers, a negative length."""
    tmp, base, _ = work
    evil = tmp / "evil.dcr"
    resign(GOLDEN / "delta_v2.dcr", evil, edit)
    before = digest_tree(tmp)
    p = run("patch", base, evil, "-o", tmp / "out")
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert digest_tree(tmp) == before


def test_resigned_but_honest_manifest_still_patches(work):
    """The re-signing helper itself keeps a valid delta valid (so the refusals above are the checks')."""
    tmp, base, _ = work
    same = tmp / "same.dcr"
    resign(GOLDEN / "delta_v2.dcr", same, lambda m: None)
    p = run("patch", base, same, "-o", tmp / "out")
    assert p.returncode == 0, p.stderr
    assert digest_tree(tmp / "out") == digest_tree(GOLDEN / "new")


def test_diff_refuses_its_own_inputs_and_existing_outputs(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(GOLDEN / "old", old)
    shutil.copytree(GOLDEN / "new", new)
    single = tmp_path / "new.safetensors"
    shutil.copy(GOLDEN / "new" / "model-00001-of-00002.safetensors", single)
    before = digest_tree(tmp_path)
    for out in (new, old, new / "d.dcr"):
        p = run("diff", old, new, "-o", out, "--force")
        assert p.returncode == 2 and "never writes over its inputs" in p.stderr, (out, p.stderr)
    p = run("diff", single, single, "-o", single, "--force")
    assert p.returncode == 2 and "never writes over its inputs" in p.stderr
    assert digest_tree(tmp_path) == before

    other = tmp_path / "other.bin"
    other.write_bytes(b"keep me")
    p = run("diff", old, new, "-o", other, "-q")
    assert p.returncode == 2 and "--force" in p.stderr
    assert other.read_bytes() == b"keep me"
    p = run("diff", old, new, "-o", other, "-q", "--force")
    assert p.returncode == 0, p.stderr
    assert other.read_bytes() == (GOLDEN / "delta_v3.dcr").read_bytes()


def test_a_huge_claimed_tensor_is_refused_before_any_allocation(work):
    """Finding 10: a crafted full-mode tensor, consistent everywhere (numel, shape, the new
    file's header), claiming 10**12 elements: refused with the figures, nothing allocated or
    written (before, patch allocated whatever the file claimed)."""
    tmp, base, _ = work
    evil = tmp / "evil.dcr"

    def edit(m):
        # the first tensor sent whole, found by its place in the headers' offset order
        k = m["tensors"]["mode"].index("f")
        for f in m["files"]:
            if "header" not in f:  # the same header as BASE's: only its digest is in the manifest
                raw = (GOLDEN / "old" / f["path"]).read_bytes()
                h = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
                k -= len(h) - ("__metadata__" in h)
                continue
            h = json.loads(f["header"])
            names = sorted((n for n in h if n != "__metadata__"), key=lambda n: h[n]["data_offsets"][0])
            if k < len(names):
                b = h[names[k]]["data_offsets"][0]
                h[names[k]]["shape"] = [10**12]
                h[names[k]]["data_offsets"] = [b, b + 10**12 * 2]
                f["header"] = json.dumps(h)
                return
            k -= len(names)
    resign(GOLDEN / "delta_v2.dcr", evil, edit)
    before = digest_tree(tmp)
    p = run("patch", base, evil, "-o", tmp / "out")
    assert p.returncode == 2 and "refused" in p.stderr and "GB" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert digest_tree(tmp) == before
