"""`make soak-seeds` (tests/soak/seeds.py): its seeds are fresh, and its table counts what each
soak's report holds; the soaks themselves run in `make soak-seeds`, not here."""

from __future__ import annotations

from tests.soak import seeds


def _report(seed: int, violations: list[str]) -> dict:
    return {"seed": seed, "wall_s": 181.7, "versions": {"committed": 61, "aborted": 9}, "faults": {"fired": 15},
            "violations": violations, "trainer_starts": 2, "convergence": {"newest": 70},
            "exits": [{"cause": "fault"}, {"cause": "fault"}, {"cause": None}, {"cause": "soak"}]}


def test_fresh_seeds_are_not_the_tuned_one_and_not_a_fixed_list():
    a, b = seeds.fresh_seeds(20), seeds.fresh_seeds(20)
    assert 1 not in a and a != b and all(s >= 2 for s in a)


def test_the_table_has_a_row_per_seed_with_exits_by_cause_and_the_first_violation():
    rows = [seeds.row(_report(7, [])), seeds.row(_report(9, ["rx-dir exited with rc 2 at t+40.0s"]))]
    assert rows[0]["exits"] == {"fault": 2, "unexplained": 1, "soak": 1}
    text = seeds.table(rows).splitlines()
    assert len(text) == 4
    assert text[2].startswith("| 7 | 182 s | 61 | 9 | 15 | 2 fault, 1 soak, 1 unexplained | 0 |")
    assert text[3].endswith("| 1: rx-dir exited with rc 2 at t+40.0s |")
