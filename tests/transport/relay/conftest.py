"""The relay tests' fixtures: relay processes stopped after each test, and the token every
relay and client here uses."""

from __future__ import annotations

import pytest

from tests.helpers.relay import TOKEN, RelayProc


@pytest.fixture
def relays():
    procs: list[RelayProc] = []

    def start(*a, **kw) -> RelayProc:
        procs.append(RelayProc(*a, **kw))
        return procs[-1]

    yield start
    for p in procs:
        p.stop()


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv("NEMO_DCR_RELAY_TOKEN", TOKEN)
