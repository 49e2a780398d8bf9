"""transport/store.py: the file:// store (create-only writes, one winner of a race, keys that
escape refused), open_store's URLs, and the process helpers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.transport.store import FileStore, open_store
from tests.helpers.stores import race

SCRIPT = """
import gc
from nemo_dcr_callback.transport.store import freeze_long_lived, open_store
store = open_store("relay://127.0.0.1:9,s3://bucket/prefix?endpoint=http://127.0.0.1:9")  # opens nothing yet
before = len(gc.get_objects())
freeze_long_lived()
print(before, len(gc.get_objects()), gc.get_freeze_count())
"""


def test_a_store_chain_reaching_s3_is_frozen_out_of_the_collectors_scans():
    """A chain with S3 in it holds boto3's service model (about 70K tracked objects; with torch,
    which every long-lived process imports, about 220K, and a full collection scanning them
    took about 120 ms of CPU in relays and receivers). After freeze_long_lived() a collection
    scans none of them. In a fresh interpreter: freezing is process-wide. (The relay client no
    longer imports the relay server, and with it aiohttp and torch: this chain alone holds
    boto3's objects only.)"""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    before, after, frozen = map(int, out.split())
    assert before > 50_000, before  # (what makes it worth doing)
    assert after < 1000 and frozen >= before - 1000, (before, after, frozen)


def test_store_put_if_absent_one_winner(tmp_path):
    store = FileStore(tmp_path)
    wins = race(lambda i: store.put_if_absent("x/rec", str(i).encode()), 8)
    assert wins.count(True) == 1
    assert store.get("x/rec").decode() in {str(i) for i in range(8)}
    assert store.list("x") == ["x/rec"]
    with pytest.raises(ValueError):
        store.put("../escape", b"")
    with pytest.raises(KeyError):
        store.get("missing")
    with pytest.raises(StoreError, match="unsupported"):
        open_store("ftp://host/x")
    with pytest.raises(StoreError, match="s3://"):
        open_store("s3:///nobucket")
    with pytest.raises(StoreError, match="unsupported"):
        open_store("ftp://host/x")
