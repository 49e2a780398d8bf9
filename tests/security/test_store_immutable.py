"""Issue 38, findings 3 and 10 at the store backends: committed history is create-only on
every backend (not only through the relay), and a file:// store serves only its own files (no
folders, no symlinks leading out of it), also through a relay. Real SeaweedFS for S3."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

import pytest

from nemo_dcr_callback.protocol import keys
from nemo_dcr_callback.protocol.store import ImmutableError
from nemo_dcr_callback.transport.store import FileStore

COMMITTED = [keys.decision_key(1), keys.version_record(1), keys.part_key(1, 0, 0), keys.rank_manifest(1, 0),
             keys.rank_sums(1, 0), keys.keyframe_model(1)]


@pytest.mark.parametrize("key", COMMITTED)
def test_file_store_refuses_to_replace_committed_objects(tmp_path, key):
    s = FileStore(tmp_path)
    s.put(key, b'{"decision": "commit"}')
    s.put(key, b'{"decision": "commit"}')  # a retry with the same bytes stands
    with pytest.raises(ImmutableError, match="history and immutable"):
        s.put(key, b'{"decision": "abort"}')
    assert s.get(key) == b'{"decision": "commit"}'
    assert not [p for p in tmp_path.rglob("*.part")]  # no staging file left behind


def test_file_store_still_rewrites_registrations_and_acks(tmp_path):
    s = FileStore(tmp_path)
    for k in (keys.receiver_key("r0"), keys.ack_key(1, "r0")):
        s.put(k, b"1")
        s.put(k, b"2")
        assert s.get(k) == b"2"


def test_s3_store_refuses_to_replace_committed_objects(tmp_path):
    from nemo_dcr_callback.transport.s3 import S3Store
    from nemo_dcr_callback.transport.seaweed import SeaweedS3

    with SeaweedS3(tmp_path / "seaweed") as s3:
        s = s3.store("immutable")
        s.put(keys.decision_key(1), b"commit")
        s.put(keys.decision_key(1), b"commit")
        with pytest.raises(ImmutableError):
            s.put(keys.decision_key(1), b"abort")
        assert s.get(keys.decision_key(1)) == b"commit"
        # above the multipart size (a large part or keyframe)
        big = S3Store(s.url, access_key=s3.access_key, secret_key=s3.secret_key, multipart_bytes=5 << 20)
        blob = os.urandom(6 << 20)
        big.put(keys.keyframe_model(1), blob)
        big.put(keys.keyframe_model(1), blob)
        with pytest.raises(ImmutableError):
            big.put(keys.keyframe_model(1), os.urandom(6 << 20))
        assert big.get(keys.keyframe_model(1)) == blob
        s.put(keys.receiver_key("r0"), b"1")
        s.put(keys.receiver_key("r0"), b"2")
        assert s.get(keys.receiver_key("r0")) == b"2"


def _store_with_links(tmp_path):
    secret = tmp_path / "outside" / "id_rsa"
    secret.parent.mkdir()
    secret.write_bytes(b"PRIVATE KEY")
    root = tmp_path / "store"
    (root / "versions" / "0000000001").mkdir(parents=True)
    os.symlink(secret, root / "versions" / "0000000001" / "VERSION.json")
    os.symlink(secret.parent, root / "keyframe")
    return FileStore(root), root


def test_file_store_serves_no_folder_and_no_link_out_of_it(tmp_path):
    s, _ = _store_with_links(tmp_path)
    for key in (keys.version_record(1), "keyframe/id_rsa", "versions", keys.vdir(1)):
        with pytest.raises(KeyError):
            s.get(key)
        assert not s.exists(key)
    assert s.list("") == []


def test_a_relay_serves_no_folder_and_no_link_out_of_its_store(tmp_path):
    """Through a real relay process: 404, with no path of the store in the answer (a 503 made
    failover clients think the relay was down, and showed where the store lives)."""
    import subprocess
    import sys

    s, root = _store_with_links(tmp_path)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NEMO_DCR_RELAY")},
           "NEMO_DCR_RELAY_TOKEN": "links-token"}
    p = subprocess.Popen([sys.executable, "-m", "nemo_dcr_callback.cli", "relay", "--parent", s.url],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = p.stdout.readline()
        url = "http://" + line.split("listening on relay://")[1].split()[0]
        for key in (keys.version_record(1), "keyframe/id_rsa", "versions", keys.vdir(1)):
            req = urllib.request.Request(f"{url}/o/{key}", headers={"Authorization": "Bearer links-token"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            body = e.value.read()
            assert e.value.code == 404 and b"PRIVATE" not in body and str(root).encode() not in body, \
                (key, e.value.code, body)
    finally:
        p.kill()
        p.wait()
