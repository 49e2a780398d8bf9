"""Issue 38, findings 4 and 8: garbage in the store never stops training or the tools.

Receivers write registrations and acks with a shared token, so a malformed one is skipped with
a warning naming its key; a malformed record the publisher would have written (a decision, a
version record) gives status and gc a clear error naming the key, not a KeyError traceback.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from nemo_dcr_callback.launcher import torchrun_cmd
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.cli import EXE as CLI

ROOT = Path(__file__).resolve().parents[2]
JUNK = {"garbage.json": b"garbage", "empty.json": b"{}", "badtime.json": b'{"receiver":"x","version":1,"time":"soon"}',
        "list.json": b"[1, 2]", "boolversion.json": b'{"receiver":"y","version":true,"time":1.0}',
        # issue 46, finding 2: Python's json raises a plain ValueError past 4,300 digits and a
        # RecursionError on deep nesting; each stopped the training commit, status and gc
        "bigint.json": b'{"receiver":"b","version":' + b"9" * 5000 + b',"time":1.0}',
        "deep.json": b"[" * 200_000 + b"]" * 200_000,
        "huge.json": b'{"receiver":"' + b"h" * (1 << 20) + b'","version":1,"time":1.0}',
        "inftime.json": b'{"receiver":"i","version":1,"time":1e999}',  # live for ever: gc kept everything
        "negversion.json": b'{"receiver":"n","version":-5,"time":1.0}'}


def plant_junk(store: FileStore) -> None:
    for name, body in JUNK.items():
        store.put(f"receivers/{name}", body)


def test_junk_registrations_are_skipped_with_their_keys_named(tmp_path, capsys):
    store = FileStore(tmp_path)
    plant_junk(store)
    commit.register(store, "good", 3)
    regs = commit.receivers(store)
    assert list(regs) == ["good"] and regs["good"]["version"] == 3
    err = capsys.readouterr().err
    for name in JUNK:
        assert f"receivers/{name}" in err


def test_junk_acks_are_skipped(tmp_path):
    store = FileStore(tmp_path)
    store.put("versions/0000000001/acks/evil.json", b"not json")
    store.put("versions/0000000001/acks/half.json", b'{"receiver":"h"}')
    store.put("versions/0000000001/acks/deep.json", b"[" * 200_000)
    store.put("versions/0000000001/acks/bigint.json", b'{"version":' + b"1" * 5000 + b"}")
    commit.write_ack(store, 1, "good", 0)
    assert list(commit.read_acks(store, 1)) == ["good"]
    assert list(commit.read_acks(store, 1, expected=["good", "evil"])) == ["good"]
    assert list(commit.read_acks(store, 1, expected=["good", "deep", "bigint"])) == ["good"]


def test_a_junk_ack_named_by_a_relay_does_not_stop_the_commit(tmp_path):
    """The committer reads acks a relay's long-poll names without listing: those went
    unchecked, and a junk one raised in the commit (issue 46, finding 2)."""
    from nemo_dcr_callback.config import CommitPolicy
    from nemo_dcr_callback.protocol.upload import write_rank

    class Named(FileStore):
        """A relay's news feed, played by a file store (no relay can be made to name a key
        without serving it): the acks arrive during the first wait, and its answer names them."""

        long_polls = True

        def wait_keys(self, token, limit, data_only=False):
            if token == 0:
                self.put("versions/0000000001/acks/evil.json", b"[" * 200_000)
                commit.write_ack(self, 1, "good", 0)
            return token + 1, self.list("versions/0000000001/acks")

    store = Named(tmp_path)
    commit.register(store, "good", 0)
    write_rank(store, 1, 0, 0, 1, [], 0, 0)
    rec = commit.seal_version(store, 1, 0, 1)
    d = commit.run_commit(store, rec, CommitPolicy("wait", timeout=10))
    assert d["decision"] == "commit" and d["acked"] == ["good"]


@pytest.mark.parametrize("key,body,says,tools", [
    ("versions/0000000001/DECISION.json", b"garbage", "DECISION.json: not JSON", ("status", "gc")),
    ("versions/0000000001/DECISION.json", b'{"decision":"commit"}', "not a decision record", ("status", "gc")),
    ("versions/0000000001/VERSION.json", b'{"version":1}', "not a version record", ("status",)),
])
def test_status_and_gc_name_the_bad_key(tmp_path, key, body, says, tools):
    store = FileStore(tmp_path)
    commit.register(store, "good", 0)
    store.put(key, body)
    for tool in ("status", "gc"):
        cmd = [tool, "--dry-run"] if tool == "gc" else [tool]
        p = subprocess.run([CLI, *cmd, "--store", f"file://{tmp_path}"], capture_output=True, text=True)
        out = p.stdout + p.stderr
        assert "Traceback" not in out
        if tool in tools:  # gc never reads version records: it just runs
            assert p.returncode == 2, (cmd, out)
            assert key in out and says in out, (cmd, out)
        else:
            assert p.returncode == 0, (cmd, out)
    assert store.get(key) == body  # nothing rewritten


def _decision(v: int, decision: str) -> bytes:
    return json.dumps({"version": v, "base": v - 1, "decision": decision, "acked": [], "lagging": [],
                       "reason": "test", "time": 1.0}).encode()


def test_a_file_or_a_link_where_a_version_folder_should_be(tmp_path):
    """Finding 8: a file named like a version folder gave "Not a directory"; a version folder
    that is a symlink stopped gc half-way (rmtree refuses links), and a link leading out of
    the store let gc and the relay reach what it points at. Now a file there is a version
    without objects, a link out of the store is no version at all, and gc deletes around both."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    store = FileStore(root)
    commit.register(store, "good", 0)
    store.put("versions/0000000001/DECISION.json", _decision(1, "abort"))
    store.put("versions/0000000004/DECISION.json", _decision(4, "abort"))
    (root / "versions" / "0000000002").write_bytes(b"not a folder")
    outside.mkdir()
    (outside / "DECISION.json").write_bytes(_decision(3, "abort"))
    (outside / "precious.bin").write_bytes(b"keep me")
    (root / "versions" / "0000000003").symlink_to(outside)
    (root / "versions" / "0000000005").mkdir()
    (root / "versions" / "0000000005" / "DECISION.json").symlink_to(outside / "DECISION.json")
    st = subprocess.run([CLI, "status", "--store", f"file://{root}"], capture_output=True, text=True)
    assert st.returncode == 0 and "Traceback" not in st.stdout + st.stderr, st.stdout + st.stderr
    gc = subprocess.run([CLI, "gc", "--store", f"file://{root}"], capture_output=True, text=True)
    assert gc.returncode == 0 and "Traceback" not in gc.stdout + gc.stderr, gc.stdout + gc.stderr
    assert not (root / "versions" / "0000000001").exists() and not (root / "versions" / "0000000004").exists()
    assert (outside / "precious.bin").read_bytes() == b"keep me" and (outside / "DECISION.json").exists()


def test_junk_registration_during_a_real_publish(tmp_path):
    """The trainer (Lightning + megatron-core, 1 rank) publishes two versions to a store that
    already holds junk registrations: training ends normally, naming each junk key once."""
    store_dir = tmp_path / "store"
    plant_junk(FileStore(store_dir))
    cmd = torchrun_cmd(1, ["-m", "nemo_dcr_callback.recipes.train", f"hydra.run.dir={tmp_path}",
                           "trainer.max_steps=2", "model.num_layers=2", "model.hidden_size=64",
                           "model.ffn_hidden_size=176", "model.num_attention_heads=4", "model.num_query_groups=2",
                           "model.vocab_size=256", "model.seq_length=16", f"dcr.store=file://{store_dir}"])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "publisher failed" not in out
    for name in JUNK:
        assert out.count(f"receivers/{name}") >= 1, out[-3000:]
    decided = [json.loads((store_dir / "versions" / f"{v:010d}" / "DECISION.json").read_text())["decision"]
               for v in (1, 2)]
    assert decided == ["commit", "commit"]
