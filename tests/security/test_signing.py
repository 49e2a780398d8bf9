"""Issue 38, item 4: deltas signed with a key (HMAC-SHA256) for deltas passed between parties.
The manifest checksum and chunk checksums are unkeyed, so they prove only that nothing broke
by accident; with --verify-key-env, patch takes only a delta signed with that key, checked over
the whole file before anything is written. Real CLI processes on the golden checkpoints."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
from pathlib import Path

import pytest
import xxhash

from tests.helpers.cli import EXE as CLI

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
KEY = "a-shared-key-of-32-bytes-0123456"
_FOOT = struct.Struct("<QQQ8s")


def run(*args, key: str | None = KEY):
    env = {k: v for k, v in os.environ.items() if k != "DCR_KEY"}
    if key is not None:
        env["DCR_KEY"] = key
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, env=env)


def tree(p: Path) -> dict[str, str]:
    return {str(f.relative_to(p)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(p.rglob("*"))
            if f.is_file()}


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    d = tmp_path_factory.mktemp("signed")
    p = run("diff", GOLDEN / "old", GOLDEN / "new", "-o", d / "signed.dcr", "--sign-key-env", "DCR_KEY", "-q")
    assert p.returncode == 0, p.stderr
    return d / "signed.dcr"


def test_a_signed_delta_patches_with_its_key_and_without_one(signed, tmp_path):
    p = run("patch", GOLDEN / "old", signed, "-o", tmp_path / "a", "--verify-key-env", "DCR_KEY")
    assert p.returncode == 0 and "signature verified" in p.stdout, p.stderr
    assert tree(tmp_path / "a") == tree(GOLDEN / "new")
    p = run("patch", GOLDEN / "old", signed, "-o", tmp_path / "b", key=None)  # no key: not checked
    assert p.returncode == 0 and tree(tmp_path / "b") == tree(GOLDEN / "new")
    assert run("stats", signed).returncode == 0


def _flip_chunk_byte(src: Path, dst: Path) -> None:
    data = bytearray(src.read_bytes())
    data[100] ^= 0x01  # inside the first chunk (the chunk's own checksum catches this too)
    dst.write_bytes(bytes(data))


def _edit_manifest(src: Path, dst: Path) -> None:
    """An honest-looking edit: the manifest changed and its unkeyed checksum recomputed."""
    data = src.read_bytes()
    moff, mlen, _, end = _FOOT.unpack(data[-_FOOT.size:])
    from nemo_dcr_callback.tools.deltafile import dump_manifest, load_manifest
    obj = load_manifest(data[moff:moff + mlen])
    obj["removed"].append("x")
    m = dump_manifest(obj)
    dst.write_bytes(data[:moff] + m + data[moff + mlen:-_FOOT.size] + _FOOT.pack(moff, len(m),
                                                                               xxhash.xxh3_64_intdigest(m), end))


@pytest.mark.parametrize("how,key,says", [
    ("chunk", KEY, "signature does not match"),
    ("manifest", KEY, "signature does not match"),
    ("unsigned", KEY, "not signed"),
    ("as is", "another-key-of-32-bytes-abcdefghi", "signature does not match"),
    ("as is", "short", "at least 16 bytes"),
    ("as is", None, "empty or unset"),
])
def test_patch_with_a_key_refuses_what_that_key_did_not_sign(signed, tmp_path, how, key, says):
    delta = tmp_path / "d.dcr"
    if how == "chunk":
        _flip_chunk_byte(signed, delta)
    elif how == "manifest":
        _edit_manifest(signed, delta)
    elif how == "unsigned":
        delta = GOLDEN / "delta_v2.dcr"
    else:
        delta = signed
    before = tree(tmp_path)
    p = run("patch", GOLDEN / "old", delta, "-o", tmp_path / "out", "--verify-key-env", "DCR_KEY", key=key)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert tree(tmp_path) == before  # nothing written


def test_a_footer_re_pointed_at_a_hidden_manifest_is_refused(tmp_path):
    """Issue 46, finding 1. NEW's non-tensor files are copied verbatim into the delta, so
    whoever supplies one can hide a zstd manifest in it; re-pointing the footer at it, with the
    manifest's end unchanged, left the bytes the MAC covered as they were, and the manifest
    reader ignored the real manifest trailing after the hidden frame: `patch` said "signature
    verified". The MAC now covers the footer, and a manifest with data after its frame is
    refused, with or without a key. Nothing is written either way."""
    import shutil

    from nemo_dcr_callback.tools.deltafile import dump_manifest, load_manifest

    honest = tmp_path / "honest.dcr"
    assert run("diff", GOLDEN / "old", GOLDEN / "new", "-o", honest, "--sign-key-env", "DCR_KEY", "-q").returncode == 0
    data = honest.read_bytes()
    moff, mlen, _, _ = _FOOT.unpack(data[-_FOOT.size:])
    hidden = dump_manifest(load_manifest(data[moff:moff + mlen]))  # a manifest these chunks satisfy
    new = tmp_path / "new"
    shutil.copytree(GOLDEN / "new", new)
    (new / "notes.bin").write_bytes(hidden)  # an innocent-looking file of NEW's folder
    carrier = tmp_path / "carrier.dcr"
    assert run("diff", GOLDEN / "old", new, "-o", carrier, "--sign-key-env", "DCR_KEY", "-q").returncode == 0
    data = carrier.read_bytes()
    moff, mlen, _, end = _FOOT.unpack(data[-_FOOT.size:])
    blob = data.find(hidden)
    assert 0 < blob < moff
    forged = tmp_path / "forged.dcr"
    region = data[blob:moff + mlen]
    forged.write_bytes(data[:-_FOOT.size] + _FOOT.pack(blob, len(region), xxhash.xxh3_64_intdigest(region), end))
    before = tree(tmp_path)
    for key, says in ((KEY, "signature does not match"), (None, "data after its zstd frame")):
        args = ["--verify-key-env", "DCR_KEY"] if key else []
        p = run("patch", GOLDEN / "old", forged, "-o", tmp_path / "out", *args, key=key)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stdout + p.stderr
        assert tree(tmp_path) == before


def test_a_delta_signed_with_the_old_scheme_is_refused_by_name(signed, tmp_path):
    """Deltas signed before the footer was covered ("DCRDSIG\\0") are refused, saying why."""
    data = signed.read_bytes()
    old = tmp_path / "old-scheme.dcr"
    old.write_bytes(data[:-8] + b"DCRDSIG\x00")
    for args in (["--verify-key-env", "DCR_KEY"], []):
        p = run("patch", GOLDEN / "old", old, "-o", tmp_path / "out", *args)
        assert p.returncode == 2 and "old scheme" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()
