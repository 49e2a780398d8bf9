"""What ends in the soak, accounted for: process exits (fleet.Exit) and gc runs (invariants 6
and 7 of docs/FAULTS.md; Watch.report calls them at the end of a run), and the receivers late
to converge (invariant 3; Watch.converge asks)."""

from __future__ import annotations


def check_exits(watch, exits) -> None:
    """Every exit that no fault aimed at that process explains is a violation (fleet.Exit):
    a receiver that ends on a store error, a trainer that ends on an S3 restart. A kill or
    stop of the process explains its instance's exit however long the tear-down takes; a
    fault elsewhere explains nothing."""
    for e in exits:
        if e.cause is None:
            last = next((ln for ln in reversed(e.tail.strip().splitlines()) if ln.strip()), "")
            watch.violate(f"{e.name} exited with rc {e.rc} at t+{e.t - watch.t0:.1f}s, no fault aimed at it: "
                      f"{last[-300:]}")

def check_gc(watch, fired: list[dict]) -> None:
    """A gc run that timed out is a violation; one that failed is, unless S3 itself was under
    a fault while it ran (gc is a one-shot command: failing clearly on a dead store is right)."""
    s3 = [(f["fired_at"] - 1.0, (f["end_at"] if f["end_at"] is not None else f["fired_at"]) + 30.0)
          for f in fired if f["target"] == "s3"]
    for g in watch.gc_runs:
        if g["rc"] == 0:
            continue
        t0, t1 = g["t"], g["t"] + g.get("s", 120.0)
        if g["rc"] is None:
            watch.violate(f"gc at t+{t0:.0f}s timed out")
        elif not any(a <= t1 and t0 <= b for a, b in s3):
            watch.violate(f"gc at t+{t0:.0f}s failed (rc {g['rc']}) with S3 under no fault: "
                         f"{g.get('error', '')[-200:]}")


# A receiver whose current instance has not said ready yet (a vLLM engine starting: 60-80 s on a
# quiet 2-core machine, over 5 minutes on a loaded one) is waited for this long after the
# trainer's stop; once ready, it gets the usual converge_s from its ready. The convergence rule
# then judges the receivers, not the machine's speed (issue 68: one fresh seed failed on an
# engine still starting 90 s after the stop, beside other work).
START_LIMIT_S = 600.0


def late_to_converge(watch, behind: dict[str, int], t_stop: float, converge_s: float,
                     now: float) -> dict[str, str]:
    """Of the receivers behind the newest version, those past their deadline, each with why."""
    late = {}
    for r, held in behind.items():
        p = watch.procs.get(r)
        ready = p.instances[-1].get("ready") if p is not None and p.instances else None
        if ready is None and now - t_stop > START_LIMIT_S:
            late[r] = f"holds {held}, still starting {START_LIMIT_S:.0f} s after the trainer stopped"
        elif ready is not None and now - max(t_stop, ready) > converge_s:
            late[r] = f"holds {held}, {now - max(t_stop, ready):.0f} s after " + (
                "the trainer stopped" if ready <= t_stop else "it said ready")
    return late
