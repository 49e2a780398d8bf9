"""Issue 46, finding 6: a delta's manifest is a zstd frame, and python-zstandard allocates
whatever size a frame declares (its max_output_size is ignored then): a 34 KB delta inflated to
1 GiB in `stats` (2.4 GB resident, 9 s), and one declaring 1 TiB ended in a MemoryError
traceback. Now the frame must declare its size, at most 64 MiB of JSON and at most 256 times
its stored size (plus 1 MiB), or the file is refused before anything is inflated."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
import xxhash

from tests.helpers.cli import EXE as CLI

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
_FOOT = struct.Struct("<QQQ8s")


def _frame(declared: int | None, payload: bytes = b"x" * 100) -> bytes:
    """A zstd frame whose header declares `declared` bytes (None: no size), holding one RLE
    block: the declaration is what a reader allocates from, whatever the blocks hold."""
    if declared is None:
        fhd, fcs = 0x00, b""  # no content size, a window descriptor follows
        head = bytes([fhd, 0x58])  # window 2^(10+11) bytes
    else:
        fhd, fcs = 0xE0, struct.pack("<Q", declared)  # 8-byte content size, single segment
        head = bytes([fhd]) + fcs
    block = ((len(payload) << 3) | (1 << 1) | 1).to_bytes(3, "little") + payload[:1]  # last, RLE
    return b"\x28\xb5\x2f\xfd" + head + block


def _with_manifest(src: Path, dst: Path, manifest: bytes) -> None:
    data = src.read_bytes()
    moff, mlen, _, end = _FOOT.unpack(data[-_FOOT.size:])
    dst.write_bytes(data[:moff] + manifest + _FOOT.pack(moff, len(manifest), xxhash.xxh3_64_intdigest(manifest), end))


@pytest.mark.parametrize("declared,says", [
    (1 << 40, "declares 1099511627776 bytes"),  # 1 TiB: a MemoryError traceback before
    (1 << 30, "declares 1073741824 bytes"),  # 1 GiB from a few bytes: 2.4 GB resident before
    (None, "does not declare its size"),
])
def test_a_manifest_frame_claiming_too_much_is_refused_before_inflating(tmp_path, declared, says):
    bomb = tmp_path / "bomb.dcr"
    _with_manifest(GOLDEN / "delta_v2.dcr", bomb, _frame(declared))
    for args in (["stats", bomb], ["patch", GOLDEN / "old", bomb, "-o", tmp_path / "out"]):
        p = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_a_manifest_naming_chunks_over_and_over_is_refused(tmp_path):
    """Finding 7: every chunk reference of the manifest's tensor table becomes a record entry;
    an 851-byte manifest with 300 tensors naming 20,000 chunks each cost 1.36 GB and 13 s
    before it was refused. Honest references number at most the chunks plus the tensors."""
    from nemo_dcr_callback.tools.deltafile import DeltaFile, dump_manifest

    d = DeltaFile(GOLDEN / "delta_v2.dcr")
    m = d.manifest
    n = 200_000
    m["chunk_lengths"] = m["chunk_lengths"] + [1] * n  # (never read: refused before)
    m["tensors"]["chunks"] = [[0, len(m["chunk_lengths"])] for _ in m["tensors"]["chunks"]]
    bomb = tmp_path / "refs.dcr"
    _with_manifest(GOLDEN / "delta_v2.dcr", bomb, dump_manifest(m))
    for args in (["stats", bomb], ["patch", GOLDEN / "old", bomb, "-o", tmp_path / "out"]):
        p = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "chunk references" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("blob", ["zz", [1], [-5, 3], None])
def test_a_malformed_blob_entry_is_a_clear_error(tmp_path, blob):
    """Finding 13: `"blob": "zz"` in a manifest gave a TypeError traceback."""
    from nemo_dcr_callback.tools.deltafile import DeltaFile, dump_manifest

    m = DeltaFile(GOLDEN / "delta_v2.dcr").manifest
    m["other_files"][0]["blob"] = blob
    bad = tmp_path / "blob.dcr"
    _with_manifest(GOLDEN / "delta_v2.dcr", bad, dump_manifest(m))
    p = subprocess.run([CLI, "patch", GOLDEN / "old", bad, "-o", tmp_path / "out"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "malformed" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_a_member_table_whose_names_expand_too_far_is_refused():
    """Finding 13: a batched chunk's member table front-codes its names; 65,536 members of 4 KB
    names took about 300 MB from a 10 KB chunk before the chunk was refused. Names may now
    expand at most 16 times the raw table (plus 64 KiB) and 32 MiB in all; the raw table is
    at most 16 MiB."""
    import torch

    from nemo_dcr_callback import codec

    stem = "m" * 4000
    members = [(f"{stem}.{i:06d}", 4, torch.tensor([1]), torch.tensor([1], dtype=torch.int16),
                torch.tensor([3], dtype=torch.int16)) for i in range(4096)]
    chunk = codec.encode_batch(torch.bfloat16, members)
    assert len(chunk) < 64 << 10  # 16 MB of names from a chunk of a few KB
    with pytest.raises(codec.ChunkError, match="expand past"):
        codec.parse_header(chunk).parts()
    honest = [(f"model.layers.{i // 8}.mlp.experts.{i % 8}.down_proj.weight", 4, torch.tensor([1]),
               torch.tensor([1], dtype=torch.int16), torch.tensor([3], dtype=torch.int16)) for i in range(4096)]
    assert len(codec.parse_header(codec.encode_batch(torch.bfloat16, honest)).parts()) == 4096
