"""transport/patient.py: a store's calls retried through an outage, up to the patience.

The store underneath is a real FileStore; the outage is injected by a thin wrapper that raises
StoreError on the first calls (a fake, named: a file store cannot be made to fail on demand,
and the real outage, S3 answering 500 for 10 s under a training job, is
tests/faults/test_trainer_outage.py). The clock is fake so that the patience runs out at once."""

from __future__ import annotations

import pytest

from nemo_dcr_callback.protocol.store import ImmutableError, StoreError, put_once
from nemo_dcr_callback.safe_io import TooLarge
from nemo_dcr_callback.transport.patient import PatientStore
from nemo_dcr_callback.transport.store import FileStore


class Flaky:
    """FileStore calls, the first `fails` of them raising StoreError (the injected outage)."""

    def __init__(self, store, fails: int):
        self.store, self.fails, self.calls = store, fails, 0
        self.url = store.url

    def __getattr__(self, op):
        real = getattr(self.store, op)

        def call(*a, **kw):
            self.calls += 1
            if self.calls <= self.fails:
                raise StoreError(f"{self.url} answered 500 (injected)")
            return real(*a, **kw)
        return call


class Clock:
    def __init__(self):
        self.t, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_an_outage_shorter_than_the_patience_is_ridden_out(tmp_path, capsys):
    clock = Clock()
    flaky = Flaky(FileStore(tmp_path), fails=6)
    s = PatientStore(flaky, 60, clock=clock, sleep=clock.sleep)
    s.put("a/b", b"x")
    assert FileStore(tmp_path).get("a/b") == b"x"  # written once the store answered
    assert flaky.calls == 7 and s.outages == 1
    assert clock.slept == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0]  # backing off, at most 5 s a pause
    err = capsys.readouterr().err
    assert err.count("failing") == 1 and err.count("answering again after 12.8 s") == 1


def test_past_the_patience_the_error_names_the_store_and_the_patience(tmp_path):
    clock = Clock()
    flaky = Flaky(FileStore(tmp_path), fails=10 ** 6)
    s = PatientStore(flaky, 30, clock=clock, sleep=clock.sleep)
    with pytest.raises(StoreError, match=r"answered 500 \(injected\).*30 s of the store's patience"):
        s.list("")
    assert clock.t == pytest.approx(30.0) and flaky.calls < 20


@pytest.mark.parametrize("why", ["missing", "immutable", "too large"])
def test_what_is_not_an_outage_is_raised_at_once(tmp_path, why):
    clock = Clock()
    base = FileStore(tmp_path)
    base.put("k", b"12345")
    s = PatientStore(base, 60, clock=clock, sleep=clock.sleep)
    if why == "missing":
        with pytest.raises(KeyError):
            s.get("absent")
    elif why == "immutable":
        with pytest.raises(ImmutableError):
            put_once(s, "k", b"other")
    else:
        with pytest.raises(TooLarge):
            s.get("k", limit=2)
    assert clock.slept == []


def test_zero_patience_fails_on_the_first_error_and_negative_is_refused(tmp_path):
    s = PatientStore(Flaky(FileStore(tmp_path), fails=1), 0)
    with pytest.raises(StoreError, match="0 s of the store's patience"):
        s.exists("k")
    with pytest.raises(ValueError, match="patience"):
        PatientStore(FileStore(tmp_path), -1)
