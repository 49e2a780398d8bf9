"""A rank's upload (protocol/upload.py: RankWriter): parts ramp up in size so that bytes start
crossing the link early, and the manifest names them all."""

from __future__ import annotations

from nemo_dcr_callback.protocol import commit, upload
from nemo_dcr_callback.transport.store import FileStore


def test_parts_ramp_up_from_a_sixteenth(tmp_path):
    """Bytes start crossing the link after a sixteenth of a full part's encoding; each next
    part is twice the last, up to full size; the manifest names them all."""
    store = FileStore(tmp_path)
    w = upload.RankWriter(store, 1, 0, 0, 1, part_bytes=2 << 20)
    for _ in range(100):
        w.add(b"x" * (64 << 10))
    m = w.finish(0, 0, {})
    sizes = [p["bytes"] >> 10 for p in m["parts"]]
    assert sizes[:5] == [128, 256, 512, 1024, 2048] and all(s == 2048 for s in sizes[5:-1])
    assert sum(sizes) == 100 * 64
    assert [k for k in store.list(commit.vdir(1)) if k.endswith(".dcr")] == [p["key"] for p in m["parts"]]
