"""Issue 46, findings 5 and 9: what `nemo-dcr patch` checks before it spends memory or
deletes anything.

5. A chunk's header claims its tensor's element count and its number of changes; decoding
   allocates by them. `patch` decoded first and checked the target after: a 13 KB delta
   claiming 2^27 elements for a 256-element tensor reached 1.9 GB resident before its
   refusal. Now every tensor a chunk holds is checked against its target (or, for a batched
   chunk's other members, the manifest's record) before anything is decoded.
9. `patch --force -o <the folder holding BASE>` replaced OUT whole: BASE, the delta and every
   other file there were deleted. Now OUT may not be, hold or lie inside BASE, nor hold the
   delta, even with --force.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import xxhash

from nemo_dcr_callback import codec
from nemo_dcr_callback.core.rawbits import BITS_DTYPE
from nemo_dcr_callback.tools.delta_manifest import dump_manifest
from nemo_dcr_callback.tools.deltafile import _FOOT, _HEAD, DeltaFile
from tests.helpers import GOLDEN
from tests.helpers.cli import CLI

CLAIM = 1 << 24  # changes the forged chunk claims: decoding them takes a few hundred MB


def _forge_chunk_claim(dst: Path) -> None:
    """The golden delta with its batched chunk (several small tensors' changes) replaced by one
    whose first member claims CLAIM changes of a CLAIM-element tensor (it has far fewer), its
    offsets and manifest redone. A batch is decoded whole before its members are split."""
    src = GOLDEN / "delta_v2.dcr"
    d = DeltaFile(src)
    m = d.manifest
    data = src.read_bytes()
    lengths = m["chunk_lengths"]
    off = [_HEAD.size]
    for n in lengths:
        off.append(off[-1] + n)
    k = next(i for i in range(len(lengths)) if codec.parse_header(data[off[i]:off[i + 1]]).batched)
    first = codec.parse_header(data[off[k]:off[k + 1]]).members[0]
    ones = torch.ones(CLAIM, dtype=BITS_DTYPE[first.dtype.width])
    forged = codec.encode_batch(first.dtype.torch, [(first.name, CLAIM, torch.arange(CLAIM), ones, ones)])
    assert len(forged) < 1 << 20  # a small file, a large claim
    shift = len(forged) - lengths[k]
    body = data[:off[k]] + forged + data[off[k + 1]:d.data_end]
    m["chunk_lengths"] = [*lengths[:k], len(forged), *lengths[k + 1:]]
    for o in m["other_files"]:
        if "blob" in o:
            o["blob"][0] += shift
    mb = dump_manifest(m)
    dst.write_bytes(body + mb + _FOOT.pack(len(body), len(mb), xxhash.xxh3_64_intdigest(mb), b"DCRDEND\x00"))


def _peak_mb(args: list[str]) -> tuple[int, float, str]:
    """Run `nemo-dcr ARGS` in a fresh interpreter; (exit status, its peak resident MB, stderr)."""
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so it shows this test's own peak
    code = ("import sys; from nemo_dcr_callback.cli import main; rc = main(sys.argv[1:]); "
            "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0]; "
            "print(int(hwm.split()[1]) / 1024, file=sys.stderr); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300)
    lines = p.stderr.strip().splitlines()
    return p.returncode, float(lines[-1]), "\n".join(lines[:-1])


def test_a_chunk_claiming_more_than_its_tensor_is_refused_before_decoding(tmp_path):
    forged = tmp_path / "forged.dcr"
    _forge_chunk_claim(forged)
    rc0, base_mb, _ = _peak_mb(["stats", GOLDEN / "delta_v2.dcr"])  # the same process doing nothing much
    assert rc0 == 0
    rc, peak_mb, err = _peak_mb(["patch", GOLDEN / "old", forged, "-o", tmp_path / "out"])
    assert rc == 2 and f"spans {CLAIM} elements" in err and "Traceback" not in err, err
    assert peak_mb < base_mb + 64, (peak_mb, base_mb)  # decoding the claim took hundreds of MB
    assert not (tmp_path / "out").exists()


def _tree(p: Path) -> dict[str, str]:
    return {str(f.relative_to(p)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(p.rglob("*"))
            if f.is_file()}


def test_patch_never_replaces_a_folder_holding_base_or_the_delta(tmp_path):
    work = tmp_path / "work"
    shutil.copytree(GOLDEN / "old", work / "base")
    shutil.copy(GOLDEN / "delta_v2.dcr", work / "delta.dcr")
    (work / "notes.txt").write_text("unrelated")
    before = _tree(tmp_path)
    for out in (work, work / "base", work / "base" / "inner", tmp_path):
        p = subprocess.run([*CLI, "patch", work / "base", work / "delta.dcr", "-o", out, "--force"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (out, p.stdout + p.stderr)
        assert "BASE" in p.stderr or "delta" in p.stderr, p.stderr
        assert _tree(tmp_path) == before, out
    p = subprocess.run([*CLI, "patch", work / "base", work / "delta.dcr", "-o", tmp_path / "new", "--force"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert _tree(tmp_path / "new") == _tree(GOLDEN / "new")
