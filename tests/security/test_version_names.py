"""Issue 46, finding 4: version folder names were parsed with str.isdigit(), which takes
Arabic-Indic and superscript digits. A receivers'-token holder could create, through the relay,
`versions/<Arabic-Indic digits>/acks/...` (int() reads them as a number) and
`versions/99999999999999999999/`: status, gc, followers and the trainer's resume then failed or
resumed at version 10^20 + 1, and a superscript digit gave a 500 with a traceback in the relay.
Now a version folder is exactly 10 ASCII digits: anything else is no version, ignored by every
reader and refused by the relay with 400."""

from __future__ import annotations

import json
import subprocess
from urllib.parse import quote

import pytest

from nemo_dcr_callback.protocol import commit, keys
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.cli import EXE as CLI
from tests.helpers.relay_process import PUB, RECV, request, start_relay

ARABIC = "\u0661" * 10  # ten Arabic-Indic ones: str.isdigit() and int() take them
JUNK = [ARABIC, "9" * 20, "\u00b2" * 10, "000000001", "+000000001", "0000000001 "]


@pytest.mark.parametrize("name", JUNK)
def test_a_junk_folder_name_is_no_version(name):
    assert keys.version_of(name) is None
    assert keys.kind(f"versions/{name}/DECISION.json") is None
    assert keys.kind(f"versions/{name}/acks/rx.json") is None
    assert keys.receiver_record(f"versions/{name}/acks/rx.json") is None
    assert keys.kind(f"keyframe/{name}/model.safetensors") is None
    assert keys.version_of("0000000042") == 42 and keys.kind(commit.decision_key(42)) == "decision"


def test_readers_ignore_junk_version_folders(tmp_path):
    store = FileStore(tmp_path)
    commit.decide(store, 3, 2, "commit", [], [], "test")
    for name in JUNK[:3]:
        store.put(f"versions/{name}/DECISION.json", json.dumps(
            {"version": 10**20, "base": 0, "decision": "commit", "acked": [], "lagging": [], "reason": "x",
             "time": 1.0}).encode())
        store.put(f"versions/{name}/acks/rx.json", b"{}")
    assert commit.list_versions(store) == [3]
    assert commit.resume_point(store) == (3, 3, [])  # not version 10^20 + 1
    for cmd in (["status"], ["gc", "--dry-run"], ["gc"]):
        p = subprocess.run([CLI, *cmd, "--store", f"file://{tmp_path}"], capture_output=True, text=True)
        assert p.returncode == 0 and "Traceback" not in p.stdout + p.stderr, (cmd, p.stdout + p.stderr)


def test_the_relay_refuses_junk_version_folders_with_400(tmp_path):
    origin = tmp_path / "origin"
    FileStore(origin).put("versions/0000000001/VERSION.json", b"{}")
    p, url = start_relay(origin, {"NEMO_DCR_RELAY_TOKEN": PUB, "NEMO_DCR_RELAY_RECEIVER_TOKEN": RECV})
    try:
        assert p.poll() is None, url
        ack = json.dumps({"version": 1, "receiver": "rx", "base": 0, "ok": True, "error": None,
                          "time": 1.0}).encode()
        for name in JUNK:
            for token in (RECV, PUB):
                key = quote(f"versions/{name}/acks/rx.json")  # (as a client sends non-ASCII names)
                status, body = request(url, "PUT", key, token, ack)
                assert status == 400, (name, status, body[:200])
        status, _ = request(url, "PUT", "versions/0000000001/acks/rx.json", RECV, ack)
        assert status in (200, 201, 204)
    finally:
        p.kill()
        p.wait()
    assert [c.name for c in (origin / "versions").iterdir()] == ["0000000001"]
