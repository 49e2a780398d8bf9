"""tests/soak/accounting.py and fleet.Proc.explains: the soak's exit and gc rules (invariants 6
and 7 of docs/FAULTS.md), on recorded exits and gc rows; the soak itself is test_soak.py."""

from __future__ import annotations

import time
from pathlib import Path

from tests.soak import accounting
from tests.soak.fleet import Exit, Proc


class Watch:
    """The part of invariants.Watch the rules use: its clock, gc rows and violations."""

    def __init__(self, gc_runs=()):
        self.t0, self.gc_runs, self.violations = 0.0, list(gc_runs), []

    def violate(self, msg: str) -> None:
        self.violations.append(msg)


def test_an_exit_is_explained_only_by_a_fault_on_that_instance(tmp_path: Path):
    p = Proc("rx-dir", None, tmp_path / "log")
    p.instances.append({"t0": time.monotonic(), "rss": []})
    assert p.explains() is None  # nothing aimed at it
    p.hit()
    assert p.explains() == "fault"
    p.instances.append({"t0": time.monotonic() + 1, "rss": []})  # restarted since the fault
    assert p.explains() is None
    p.wanted = False
    assert p.explains() == "soak"


def test_unexplained_exits_are_violations_and_explained_ones_are_not():
    w = Watch()
    accounting.check_exits(w, [Exit(5.0, "trainer", 1, "fault", "killed"), Exit(6.0, "rx", 2, "soak", ""),
                               Exit(7.0, "rx-vllm", -1, "start", ""),
                               Exit(9.0, "rx-dir", 2, None, "ok\nnemo-dcr receive: error: No space left\n")])
    assert len(w.violations) == 1 and "rx-dir exited with rc 2" in w.violations[0] and "No space" in w.violations[0]


def test_gc_fails_only_where_s3_was_under_a_fault_and_never_times_out():
    fired = [{"target": "s3", "fired_at": 100.0, "end_at": 104.0}, {"target": "rx-hf", "fired_at": 200.0,
                                                                   "end_at": 210.0}]
    w = Watch([{"t": 50.0, "rc": 0, "s": 1.0}, {"t": 110.0, "rc": 2, "s": 3.0, "error": "S3 answered 500"},
               {"t": 205.0, "rc": 2, "s": 1.0, "error": "boom"}, {"t": 300.0, "rc": None}])
    accounting.check_gc(w, fired)
    assert len(w.violations) == 2
    assert "t+205s failed" in w.violations[0] and "timed out" in w.violations[1]
