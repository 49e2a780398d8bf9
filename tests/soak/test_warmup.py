"""The soak's RSS rule (invariant 5 of docs/FAULTS.md) measures growth from each instance's
own "ready", not from its start: a process still starting on a loaded machine is not a leak
(issue 68: a vLLM engine "grew 63%" while it loaded, and flat after that)."""

from __future__ import annotations

from pathlib import Path

from tests.soak.fleet import Proc
from tests.soak.invariants import RSS_WARMUP_S, Watch

MB = 1 << 20


def _watch(procs: dict) -> Watch:
    w = Watch.__new__(Watch)  # (the rules only: no store, no threads)
    w.procs, w.t0, w.violations, w.receivers = procs, 0.0, [], ("rx-vllm",)
    w._offsets, w._log_instance = {}, {}
    w.held, w.ready, w.applied, w.verified, w.decisions = {}, {"rx-vllm": 0}, {"rx-vllm": []}, 0, {}
    w.violate = w.violations.append
    return w


def _instance(ready: float | None, curve) -> dict:
    inst = {"t0": 0.0, "rss": [(float(t), int(mb * MB)) for t, mb in curve]}
    if ready is not None:
        inst["ready"] = ready
    return inst


def test_start_up_before_ready_is_not_growth(tmp_path: Path):
    slow_start = [(t, 1900 + 1250 * min(t, 100) / 100) for t in range(0, 400, 2)]  # loads for 100 s, then flat
    p = Proc("rx-vllm", None, tmp_path / "log")
    p.instances.append(_instance(100.0, slow_start))
    w = _watch({"rx-vllm": p})
    rows = w._check_rss()
    assert not w.violations and rows["rx-vllm"][0]["growth_after_warmup"] < 0.01
    assert rows["rx-vllm"][0]["ready_s"] == 100.0


def test_growth_after_ready_is_a_violation(tmp_path: Path):
    leak = [(t, 1000 + (t - 100) if t > 100 + RSS_WARMUP_S else 1000) for t in range(0, 400, 2)]
    p = Proc("rx-vllm", None, tmp_path / "log")
    p.instances.append(_instance(100.0, leak))
    w = _watch({"rx-vllm": p})
    w._check_rss()
    assert len(w.violations) == 1 and "rx-vllm: RSS grew" in w.violations[0]


def test_an_instance_that_never_said_ready_is_not_judged(tmp_path: Path):
    p = Proc("rx-vllm", None, tmp_path / "log")
    p.instances.append(_instance(None, [(t, 1000 + t) for t in range(0, 400, 2)]))
    w = _watch({"rx-vllm": p})
    assert "growth_after_warmup" not in w._check_rss()["rx-vllm"][0] and not w.violations


def test_ready_is_read_from_each_instance_s_own_log(tmp_path: Path):
    log = tmp_path / "rx.log"
    p = Proc("rx-vllm", None, log)
    p.instances += [{"t0": 0.0, "rss": []}, {"t0": 50.0, "rss": []}]
    log.write_text('===== start 0 at 1: x\nloading\n===== start 1 at 2: x\n{"event": "ready", "version": 3}\n')
    w = _watch({"rx-vllm": p})
    w._tail()
    assert "ready" not in p.instances[0] and "ready" in p.instances[1]


def test_a_relay_may_grow_by_its_configured_cache(tmp_path: Path):
    from tests.soak.invariants import RELAY_CACHE_MB

    fill = [(t, 263 + max(0, t - 90) * 30 / 300) for t in range(0, 400, 2)]  # +30 MB after the warm-up: 11.4%
    for name, violations in (("relay-region", 0), ("rx-vllm", 1)):
        p = Proc(name, None, tmp_path / "log")
        p.instances.append(_instance(0.0, fill))
        w = _watch({name: p})
        w._check_rss()
        assert len(w.violations) == violations, (name, w.violations)
    assert RELAY_CACHE_MB >= 30
