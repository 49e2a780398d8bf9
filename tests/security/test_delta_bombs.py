"""Issue 46, finding 6: a delta's manifest is a zstd frame, and python-zstandard allocates
whatever size a frame declares (its max_output_size is ignored then): a 34 KB delta inflated to
1 GiB in `stats` (2.4 GB resident, 9 s), and one declaring 1 TiB ended in a MemoryError
traceback. Now the frame must declare its size, at most 64 MiB of JSON and at most 256 times
its stored size (plus 1 MiB), or the file is refused before anything is inflated."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CLI = str(Path(sys.executable).parent / "nemo-dcr")
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
