"""Issue 38, finding 7: a secret inside a URL is never printed or raised.

Real CLI processes; the endpoint is a closed loopback port, so nothing listens (no S3 server
is needed to show what the messages say).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from nemo_dcr_callback.protocol.store import redact
from tests.helpers.cli import EXE as CLI

SECRET = "S3CR3Tvalue42"


@pytest.mark.parametrize("url,says", [
    (f"s3://AKIDX:{SECRET}@bucket/run", "credentials inside the store URL are not accepted"),
    (f"s3://bucket/run?endpoint=http://AKIDX:{SECRET}@127.0.0.1:9", "unreachable"),
    (f"ftp://user:{SECRET}@host/x", "unsupported store URL scheme"),
    ("file:///nonexistent-nemo-dcr-store-q7", "no store"),
])
def test_status_never_prints_a_secret(url, says):
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "AKIDX", "AWS_SECRET_ACCESS_KEY": "fromenv",
           "AWS_MAX_ATTEMPTS": "1"}
    p = subprocess.run([CLI, "status", "--store", url], capture_output=True, text=True, env=env, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert says in out
    assert SECRET not in out and "fromenv" not in out
    assert "Traceback" not in out


def test_redact_masks_user_info_only():
    assert redact(f"see http://u:{SECRET}@h:9/p?x=1 and s3://k:{SECRET}@b/p") == \
        "see http://***@h:9/p?x=1 and s3://***@b/p"
    assert redact("s3://bucket/prefix?endpoint=http://127.0.0.1:9000") == \
        "s3://bucket/prefix?endpoint=http://127.0.0.1:9000"
    assert redact("a@b.c, not a URL") == "a@b.c, not a URL"
