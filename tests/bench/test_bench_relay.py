"""`nemo-dcr bench relay --rounds N`: the rounds of a scenario merge into one result (medians
over every round's versions, each round's median kept). The bench itself needs root and
network namespaces (`make bench-relay`); this checks its bookkeeping only."""

from __future__ import annotations

import pytest

from nemo_dcr_callback.bench.relay import _merge_rounds


def _result(name: str, lasts: list[float], link: float, exact: bool = True) -> dict:
    rows = [{"version": v + 1, "last_s": t, "first_s": t - 0.01, "receiver_cpu_s": 0.5, "delta_bytes": 100}
            for v, t in enumerate(lasts)]
    return {"scenario": name, "receivers": 8, "rows": rows, "bit_exact": exact,
            "time_s": sorted(lasts)[len(lasts) // 2], "first_s": 0.0, "receiver_cpu_s": 0.5, "bytes_per_version": 100,
            "link_bytes_per_version": {"a": link, "b": link}, "link_x_payload": {"a": link / 100, "b": link / 100}}


def test_rounds_merge_into_medians_over_every_version():
    merged = _merge_rounds([_result("dcr-relay", [0.9, 0.7, 0.8], 104),
                            _result("dcr-relay-1", [0.4, 0.5, 0.45], 103),
                            _result("dcr-relay", [0.6, 0.65, 0.62], 106),
                            _result("dcr-relay-1", [0.44, 0.46, 0.45], 105)])
    assert [r["scenario"] for r in merged] == ["dcr-relay", "dcr-relay-1"]
    relay = merged[0]
    assert len(relay["rows"]) == 6 and {row["round"] for row in relay["rows"]} == {0, 1}
    assert relay["time_s"] == pytest.approx(0.675)  # the median of all six versions, not of the two rounds' medians
    assert relay["round_time_s"] == [0.8, 0.62]
    assert relay["link_bytes_per_version"] == {"a": 105, "b": 105} and relay["link_x_payload"]["a"] == 1.05


def test_a_round_that_was_not_bit_exact_makes_the_scenario_not_bit_exact():
    merged = _merge_rounds([_result("dcr-relay", [0.7], 104), _result("dcr-relay", [0.7], 104, exact=False)])
    assert merged[0]["bit_exact"] is False


def test_a_single_round_is_kept_as_it_was():
    one = _result("dcr-relay", [0.7, 0.8], 104)
    merged = _merge_rounds([one])
    assert merged == [{**one, "round_time_s": [one["time_s"]]}]


def test_the_loopback_trial_is_served_by_a_real_relay(tmp_path):
    """The loopback trial (no root needed) against a real `nemo-dcr relay`: it broke once a
    relay served only the protocol's keys, and `make bench-relay` found it only at its end."""
    import os

    from nemo_dcr_callback.bench.relay import TOKEN_ENV, relay_throughput

    env = {**os.environ, TOKEN_ENV: "t" * 32, "PYTHONUNBUFFERED": "1"}
    got = relay_throughput(tmp_path, env, parts=3, part_mb=1, clients=2, reps=1, trials_n=1,
                           start_delay_s=2.0)
    assert got["trials"][0]["bytes"] == 2 * 3 * (1 << 20) and got["MB_per_s"] > 0
