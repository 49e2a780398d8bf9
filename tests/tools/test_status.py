"""`nemo-dcr status` and `nemo-dcr gc` on a real file store: every state a version can be in
(committed, aborted, sealed and waiting for acks, still being written), receivers live and
stale, what gc would delete (and that --dry-run deletes nothing), and a wrong path refused."""

from __future__ import annotations

import json

from nemo_dcr_callback.cli import main
from nemo_dcr_callback.protocol import commit, upload
from nemo_dcr_callback.testing.tensor_sender import TensorSender
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers import versions


def _store(tmp_path):
    store = FileStore(tmp_path / "store")
    states = versions.chain(store, steps=2)  # 1, 2 committed
    commit.write_keyframe(store, 0, states[0])
    s = TensorSender(states[2])
    s.tensors = versions.model(seed=5)
    s.write(store, 3, 2, s.take())
    commit.seal_version(store, 3, 2, 1, timeout=5)
    commit.decide(store, 3, 2, "abort", [], ["rx-b"], "no quorum: 0/1 (need 1)")  # 3 aborted
    s.write(store, 4, 2, s.take())
    commit.seal_version(store, 4, 2, 1, timeout=5)  # 4 sealed, undecided
    upload.write_rank(store, 5, 4, 0, 2, [], 0, 0)  # 5: one of two ranks wrote its manifest
    commit.register(store, "rx-a", 2)
    commit.register(store, "rx-b", 1)
    reg = json.loads(store.get(commit.receiver_key("rx-b")))
    reg["time"] -= 3600  # rx-b last seen an hour ago
    store.put(commit.receiver_key("rx-b"), json.dumps(reg).encode())
    return store


def test_status_shows_every_version_state_and_receivers(tmp_path, capsys):
    store = _store(tmp_path)
    assert main(["status", "--store", store.url]) == 0
    out = capsys.readouterr().out
    rows = {int(ln.split()[0]): ln.split()[2] for ln in out.splitlines() if ln.split() and ln.split()[0].isdigit()}
    assert rows == {1: "commit", 2: "commit", 3: "abort", 4: "sealed", 5: "open"}
    assert "no quorum" in out and "lagging rx-b" in out
    assert "rx-a" in out and "holds 2" in out and "rx-b" in out and "1 behind" in out and "not live" in out
    assert main(["status", "--store", store.url, "--json", "--last", "2"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert [r["version"] for r in st["rows"]] == [4, 5] and st["newest"] == 5 and st["keyframes"] == [0]
    assert [r["live"] for r in st["receivers"]] == [True, False]


def test_gc_dry_run_deletes_nothing_then_gc_deletes_what_it_listed(tmp_path, capsys):
    store = _store(tmp_path)
    before = set(store.list(""))
    assert main(["gc", "--store", store.url, "--dry-run"]) == 0
    listed = [ln.split(" ", 2)[2] for ln in capsys.readouterr().out.splitlines() if ln.startswith("would delete ")]
    assert listed and set(store.list("")) == before  # nothing deleted
    assert all(k.startswith("versions/0000000003/") for k in listed)  # the aborted version only (rx-a holds 2)
    assert main(["gc", "--store", store.url]) == 0
    assert set(store.list("")) == before - set(listed)
    assert "deleted" in capsys.readouterr().out


def test_status_of_a_missing_store_is_an_error(tmp_path, capsys):
    for cmd in ("status", "gc"):
        assert main([cmd, "--store", f"file://{tmp_path}/nowhere"]) == 2
        assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()
