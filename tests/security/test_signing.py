"""Issue 38, item 4: deltas signed with a key (HMAC-SHA256) for deltas passed between parties.
The manifest checksum and chunk checksums are unkeyed, so they prove only that nothing broke
by accident; with --verify-key-env, patch takes only a delta signed with that key, checked over
the whole file before anything is written. Real CLI processes on the golden checkpoints."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CLI = str(Path(sys.executable).parent / "nemo-dcr")
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
