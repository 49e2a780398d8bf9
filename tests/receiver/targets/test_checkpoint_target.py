"""A Hugging Face checkpoint directory as receiver: safetensors files patched in place, and a
crash in the middle of a version completed on the next open (redo log), never half-applied.
The oracle: the new tensors, loaded back with the safetensors library."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.receiver.targets import CheckpointDirTarget
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers import versions
from tests.helpers.tensors import perturb


def _dir(tmp_path, state):
    d = tmp_path / "ckpt"
    d.mkdir()
    names = sorted(state)
    save_file({k: state[k] for k in names[:2]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[2:]}, str(d / "model-00002-of-00002.safetensors"))
    return d


def _load(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_checkpoint_dir_patched_in_place(tmp_path):
    store = FileStore(tmp_path / "store")
    states = versions.chain(store, steps=3)
    d = _dir(tmp_path, states[0])
    t = CheckpointDirTarget(d)
    Follower(store, t, version=t.version).follow(until=3, timeout=5)
    t.close()
    got = _load(d)
    assert all(torch.equal(bits(got[k]), bits(states[3][k])) for k in states[3])
    t2 = CheckpointDirTarget(d)  # the directory remembers the version it holds
    assert t2.version == 3
    t2.close()


def test_crash_mid_version_is_completed_on_reopen(tmp_path):
    store = FileStore(tmp_path / "store")
    states = versions.chain(store, steps=2)
    d = _dir(tmp_path, states[0])
    t = CheckpointDirTarget(d)
    Follower(store, t, version=t.version).apply_version(1)
    writes = []

    def crash():
        writes.append(1)
        if len(writes) == 2:
            raise KeyboardInterrupt("simulated crash between two writes")

    t._crash_point = crash
    with pytest.raises(KeyboardInterrupt):
        Follower(store, t, version=t.version).apply_version(2)
    t.close()
    half = _load(d)
    assert not all(torch.equal(bits(half[k]), bits(states[2][k])) for k in half)  # really half-applied
    t = CheckpointDirTarget(d)  # reopen: the redo log completes version 2
    assert t.version == 2
    t.close()
    got = _load(d)
    assert all(torch.equal(bits(got[k]), bits(states[2][k])) for k in states[2])


def test_receive_cli_model_dir(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    store = FileStore(tmp_path / "store")
    states = versions.chain(store, steps=2)
    d = _dir(tmp_path, states[0])
    exe = Path(sys.executable).parent / "nemo-dcr"
    p = subprocess.run([str(exe), "receive", "--store", f"file://{tmp_path / 'store'}", "--model-dir", str(d)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "version 2 (base 1)" in p.stdout
    got = _load(d)
    assert all(torch.equal(bits(got[k]), bits(states[2][k])) for k in states[2])


def test_a_directory_that_is_not_a_checkpoint_is_refused_untouched(tmp_path):
    """A missing directory and one without safetensors files are refused by name, and nothing
    is written into the latter (no journal folder left behind)."""
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CheckpointDirTarget(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(Exception, match="safetensors"):
        CheckpointDirTarget(empty)
    assert sorted(p.name for p in empty.iterdir()) == ["notes.txt"]


def test_sparse_and_dense_records_both_land(tmp_path):
    """A version with two changes per tensor far apart (written through the file's map) and a
    dense one (spans patched in a copy and written with pwrite): the files end on the
    sender's bits after each (the oracle: the states themselves), with the digests checked."""
    store = FileStore(tmp_path / "store")
    states = [versions.model()]
    sparse = {k: t.clone() for k, t in states[0].items()}
    for t in sparse.values():
        b = bits(t).view(-1)
        b[0] ^= 1
        b[-1] ^= 1
    states.append(sparse)
    g = torch.Generator().manual_seed(9)
    states.append({k: perturb(t, 0.05, g) for k, t in sparse.items()})
    for v in (1, 2):
        versions.publish(store, v, v - 1, states[v - 1], states[v])
    d = _dir(tmp_path, states[0])
    t = CheckpointDirTarget(d)
    f = Follower(store, t, version=t.version)
    for v in (1, 2):
        assert f.apply_version(v).digest_checked
        got = _load(d)
        assert all(torch.equal(bits(got[k]), bits(states[v][k])) for k in states[v]), v
    t.close()


def test_receive_stops_at_until_and_reports_json_lines(tmp_path):
    """`nemo-dcr receive --until V` holds V even when later versions are there (it applied all
    of them); `--json` prints one object per line; a second run goes on from the directory's
    version."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    store = FileStore(tmp_path / "store")
    states = versions.chain(store, steps=3)
    d = _dir(tmp_path, states[0])
    exe = Path(sys.executable).parent / "nemo-dcr"
    url = f"file://{tmp_path / 'store'}"
    p = subprocess.run([str(exe), "receive", "--store", url, "--model-dir", str(d), "--until", "2", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(ln) for ln in p.stdout.splitlines()]
    assert [x["event"] for x in lines] == ["ready", "applied", "applied"]
    assert [x["version"] for x in lines[1:]] == [1, 2] and all(x["digests_checked"] for x in lines[1:])
    assert all(x["digests_unchecked"] == 0 for x in lines[1:])  # a checkpoint directory holds every tensor whole
    got = _load(d)
    assert all(torch.equal(bits(got[k]), bits(states[2][k])) for k in states[2])
    p = subprocess.run([str(exe), "receive", "--store", url, "--model-dir", str(d)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "holds version 2" in p.stdout and "version 3 (base 2)" in p.stdout
    got = _load(d)
    assert all(torch.equal(bits(got[k]), bits(states[3][k])) for k in states[3])


def test_a_full_disk_holds_the_version_and_retries(tmp_path):
    """Issue 67: a checkpoint-directory receiver whose disk filled up exited 2 (ENOSPC, twice in
    the long soak). It now holds its version, says why once, and applies once there is room:
    a real tmpfs, filled to the last byte, freed after a few seconds; the oracle is the
    version's tensors loaded back."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.soak.fleet import Tmpfs, can_mount_tmpfs

    if not can_mount_tmpfs():
        pytest.skip("needs root to mount a small tmpfs (a real full disk)")
    store = FileStore(tmp_path / "store")
    states = versions.chain(store, steps=2)
    disk = Tmpfs(tmp_path / "disk", 8)
    try:
        d = _dir(disk.path, states[0])
        disk.fill()
        exe = Path(sys.executable).parent / "nemo-dcr"
        rx = subprocess.Popen([str(exe), "receive", "--store", store.url, "--model-dir", str(d), "--follow",
                               "--until", "2", "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        time.sleep(6)
        assert rx.poll() is None, rx.communicate()  # held, not ended
        disk.free()
        out, err = rx.communicate(timeout=120)
        assert rx.returncode == 0, (out, err)
        assert err.count("the disk is full") == 1 and "holding version 0" in err, err
        got = _load(d)
        assert all(torch.equal(bits(got[k]), bits(states[2][k])) for k in states[2])
    finally:
        disk.umount()
