"""The soak's stall rule (invariant 4 of docs/FAULTS.md): a trainer step that waits longer
than ack_timeout + STALL_SLACK_S outside a trainer or S3 fault is a violation; a gap ends at
the next step, the trainer's exit, or the soak's request to stop it, whichever comes first.
The long soak of 2026-12-07 ended the last gap at the exit (the stop request was appended
after the exits were sorted) and counted the stop itself as a 17.6 s stall."""

from __future__ import annotations

from types import SimpleNamespace

from tests.soak.fleet import Exit
from tests.soak.invariants import STALL_SLACK_S, Watch


def _watch(steps, stopped_at=None) -> Watch:
    w = Watch.__new__(Watch)  # (the rules only: no store, no threads)
    w.t0, w.violations, w.steps, w.trainer_stopped_at = 0.0, [], steps, stopped_at
    w.decided_at, w.decisions = {}, {}
    w.cfg = SimpleNamespace(ack_timeout=6.0, progress_s=60.0)
    w.violate = w.violations.append
    return w


BOUND = 6.0 + STALL_SLACK_S


def test_a_stop_request_ends_the_last_gap_not_the_exit():
    steps = [(1, i, 100.0 + 2 * i) for i in range(10)]  # the last step at t=118
    exit_ = Exit(118 + BOUND + 2, "trainer", 0, "soak", "")  # it took its time to stop
    w = _watch(steps, stopped_at=118 + 9.0)  # asked 9 s after its last step
    w._check_stalls([], [exit_])
    assert not w.violations, w.violations
    assert w.stall["worst_unexcused_gap_s"] == 9.0


def test_a_step_waiting_past_the_bound_is_a_violation():
    steps = [(1, 0, 100.0), (1, 1, 102.0), (1, 2, 102.0 + BOUND + 1)]
    w = _watch(steps)
    w._check_stalls([], [])
    assert len(w.violations) == 1 and "a trainer step waited" in w.violations[0]


def test_a_hung_trainer_s_gap_ends_at_its_exit():
    steps = [(1, 0, 100.0), (1, 1, 102.0)]
    w = _watch(steps, stopped_at=102.0 + 3 * BOUND)  # the soak's stop much later
    w._check_stalls([], [Exit(102.0 + BOUND + 5, "trainer", 1, None, "")])
    assert len(w.violations) == 1 and f"waited {BOUND + 5:.1f} s" in w.violations[0]


def test_a_gap_under_an_s3_fault_is_excused():
    steps = [(1, 0, 100.0), (1, 1, 100.0 + BOUND + 5)]
    w = _watch(steps)
    w._check_stalls([{"target": "s3", "fired_at": 101.0, "end_at": 110.0}], [])
    assert not w.violations


def test_two_ranks_clock_lines_met_on_one_line_are_both_read():
    """Both ranks print the step clock to one pipe; print() wrote text and newline apart, and
    two lines once met on one ("... 62256.9994NEMO_DCR_STEP_CLOCK 33 ..."): the watch thread
    died on it (a soak failed on its own harness)."""
    w = _watch([])
    w._trainer_start = 2
    w._trainer_line("NEMO_DCR_STEP_CLOCK 33 62256.9994NEMO_DCR_STEP_CLOCK 33 62256.9995")
    w._trainer_line("NEMO_DCR_STEP_CLOCK 34 62257.5")
    assert w.steps == [(2, 33, 62256.9994), (2, 33, 62256.9995), (2, 34, 62257.5)]


def test_a_receiver_still_starting_is_judged_from_its_ready():
    """Convergence (invariant 3): a receiver whose instance has not said ready (a vLLM engine
    starting for minutes beside other work) is waited for up to START_LIMIT_S, and then gets
    converge_s from its ready; one that is ready and behind has converge_s from the stop."""
    from tests.soak import accounting
    from tests.soak.fleet import Proc

    w = _watch([])
    starting, ready_late, ready_early = (Proc(n, None, "log") for n in ("rx-vllm", "rx-a", "rx-b"))
    starting.instances.append({"t0": 0.0, "rss": []})
    ready_late.instances.append({"t0": 0.0, "rss": [], "ready": 150.0})
    ready_early.instances.append({"t0": 0.0, "rss": [], "ready": 10.0})
    w.procs = {p.name: p for p in (starting, ready_late, ready_early)}
    behind = {"rx-vllm": -1, "rx-a": 3, "rx-b": 3}
    late = accounting.late_to_converge(w, behind, t_stop=100.0, converge_s=90.0, now=200.0)
    assert set(late) == {"rx-b"} and "100 s after the trainer stopped" in late["rx-b"]
    late = accounting.late_to_converge(w, behind, t_stop=100.0, converge_s=90.0, now=250.0)
    assert set(late) == {"rx-b", "rx-a"} and "after it said ready" in late["rx-a"]
    late = accounting.late_to_converge(w, behind, t_stop=100.0, converge_s=90.0,
                                       now=101.0 + accounting.START_LIMIT_S)
    assert "still starting" in late["rx-vllm"]
