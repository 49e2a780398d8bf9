"""Fault-injection suite fixtures: a real SeaweedFS, the fault proxy in front of it, and the
fault table each test adds a row to (written by `make faults`, see docs/FAULTS.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nemo_dcr_callback.bench.results import machine

ROWS: list[dict] = []


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    from nemo_dcr_callback.transport.seaweed import SeaweedS3

    with SeaweedS3(tmp_path_factory.mktemp("seaweed-faults")) as s3:
        yield s3


@pytest.fixture
def proxy(seaweed):
    from tests.faults.faultproxy import FaultProxy

    with FaultProxy(seaweed.endpoint) as p:
        yield p


@pytest.fixture
def stores(seaweed, proxy, request):
    """(through the fault proxy, direct to the server) on one fresh prefix."""
    from nemo_dcr_callback.transport.s3 import S3Store

    prefix = request.node.name.replace("[", "-").replace("]", "")
    via = S3Store(f"s3://{seaweed.bucket}/{prefix}?endpoint={proxy.endpoint}", access_key=seaweed.access_key,
                  secret_key=seaweed.secret_key, read_timeout=2.0, connect_timeout=2.0, max_attempts=5)
    return via, seaweed.store(prefix)


@pytest.fixture
def table():
    """Add a row: fault, outcome, time to recover (s), bytes resent."""

    def add(fault: str, outcome: str, recover_s: float | None, resent: int | None) -> None:
        ROWS.append({"fault": fault, "outcome": outcome, "recover_s": recover_s, "resent_bytes": resent})

    return add


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    out = os.environ.get("NEMO_DCR_FAULT_TABLE")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"machine": machine(), "rows": ROWS}, indent=2) + "\n")
    tr = terminalreporter
    tr.write_line("")
    tr.write_line("| fault | outcome | time to recover | bytes resent |")
    tr.write_line("| --- | --- | --- | --- |")
    for r in ROWS:
        rec = "-" if r["recover_s"] is None else f"{r['recover_s']:.2f} s"
        res = "-" if r["resent_bytes"] is None else f"{r['resent_bytes']:,}"
        tr.write_line(f"| {r['fault']} | {r['outcome']} | {rec} | {res} |")
