"""Issue 46, findings 11 and 12: symlinks that lead out of where a command may write or read.

11. FileStore confined reads, listings and deletes to the store, but `put` followed a linked
    folder: a key under a version folder that is a link to elsewhere was written there.
12. `diff` copies NEW's non-tensor files into the delta verbatim: one that is a link leading
    out of NEW's folder put whatever it pointed at (a key file, say) into the delta.
"""

from __future__ import annotations

import shutil

import pytest

from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers import GOLDEN
from tests.helpers.cli import run


def test_a_store_write_through_a_linked_folder_is_refused(tmp_path):
    root, outside = tmp_path / "store", tmp_path / "outside"
    store = FileStore(root)
    outside.mkdir()
    (root / "versions").mkdir(parents=True)
    (root / "versions" / "0000000001").symlink_to(outside)
    for write in (lambda: store.put("versions/0000000001/DECISION.json", b"{}"),
                  lambda: store.put_if_absent("versions/0000000001/rank-00000.json", b"{}"),
                  lambda: store.put("versions/0000000001/acks/rx.json", b"{}")):
        with pytest.raises(StoreError, match="link leading out of the store"):
            write()
    assert list(outside.iterdir()) == []
    store.put("versions/0000000002/DECISION.json", b"{}")  # an ordinary folder: written
    assert store.get("versions/0000000002/DECISION.json") == b"{}"


def test_diff_refuses_a_file_of_new_that_links_out_of_its_folder(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("a private key")
    new = tmp_path / "new"
    shutil.copytree(GOLDEN / "new", new)
    (new / "config.json").unlink()
    (new / "config.json").symlink_to(secret)
    p = run("diff", GOLDEN / "old", new, "-o", tmp_path / "d.dcr", ok=False)
    assert p.returncode == 2 and "link leading out of" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "d.dcr").exists()
    (new / "config.json").unlink()
    shutil.copy(GOLDEN / "new" / "config.json", new / "config.json")
    (new / "extra.txt").symlink_to(new / "config.json")  # a link inside the folder is fine
    assert run("diff", GOLDEN / "old", new, "-o", tmp_path / "d.dcr", "-q").returncode == 0
