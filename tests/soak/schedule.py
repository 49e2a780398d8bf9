"""The soak's fault schedule, drawn from a seed: the same seed gives the same faults, at the same
offsets, on the same targets, held as long (FoundationDB's rule: every failure replays from
its seed). What the real processes do in between is not replayed, only what is done to them.

Faults arrive as a Poisson process; each is held for a while, so faults overlap, and with
`pair_p` a second one lands at the same moment (a relay and a receiver behind it, S3 and the
trainer mid-upload)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

RECEIVERS = ("rx-hf", "rx-s3", "rx-dir", "rx-fp8")
RELAYS = ("relay-root", "relay-region")

# kind -> (weight, targets). kill: SIGKILL, restarted by the supervisor; stop: SIGSTOP past the
# timeouts, then SIGCONT; diskfull: the checkpoint-directory receiver's tmpfs filled; cut: the
# region relay's link to its parent dropped (refused or black-holed); truncate / delay / throttle:
# S3 responses cut short, late, or 503 SlowDown (the fault proxy in front of SeaweedFS).
KINDS: dict[str, tuple[float, tuple[str, ...]]] = {
    "kill": (5.0, ("trainer", "s3", *RELAYS, "receiver")),
    "stop": (2.0, ("s3", *RELAYS, "receiver")),
    "diskfull": (1.0, ("rx-dir",)),
    "cut": (1.0, ("relay-region",)),
    "truncate": (1.0, ("s3",)),
    "delay": (1.0, ("s3",)),
    "throttle": (1.0, ("s3",)),
}


@dataclass
class Fault:
    at: float  # seconds after the faults start
    kind: str
    target: str
    hold_s: float  # how long it lasts (kill: the time until the restart)
    detail: str = ""

    def describe(self) -> str:
        return f"t+{self.at:7.2f}s {self.kind:8s} {self.target:12s} {self.hold_s:5.1f}s {self.detail}"


def draw(seed: int, n: int, mean_gap_s: float, ack_timeout: float, pair_p: float = 0.3,
         trainer_gap_s: float = 45.0, receivers: tuple[str, ...] = RECEIVERS) -> list[Fault]:
    """n faults. Trainer kills are at least trainer_gap_s apart (its restart takes ~20 s, and a
    trainer that never gets to publish proves nothing); stops last past the ack timeout.
    "receiver" in KINDS stands for each of `receivers` (the same seed and receivers: the same
    schedule)."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    weights = [KINDS[k][0] for k in kinds]
    out: list[Fault] = []
    t, last_trainer = 0.0, -1e9
    while len(out) < n:
        t += rng.expovariate(1.0 / mean_gap_s)
        for _ in range(2 if rng.random() < pair_p else 1):
            if len(out) >= n:
                break
            kind = rng.choices(kinds, weights)[0]
            targets = [x for k in KINDS[kind][1] for x in (receivers if k == "receiver" else (k,))]
            target = rng.choice(targets)
            if target == "trainer":
                if t - last_trainer < trainer_gap_s:
                    target = rng.choice(receivers)
                else:
                    last_trainer = t
            out.append(_fault(rng, round(t, 2), kind, target, ack_timeout))
    return out


def _fault(rng: random.Random, t: float, kind: str, target: str, ack_timeout: float) -> Fault:
    if kind == "kill":
        return Fault(t, kind, target, round(rng.uniform(0.2, 4.0), 2))
    if kind == "stop":
        return Fault(t, kind, target, round(rng.uniform(1.2, 2.5) * ack_timeout, 2))
    if kind == "diskfull":
        return Fault(t, kind, target, round(rng.uniform(3.0, 12.0), 2))
    if kind == "cut":
        return Fault(t, kind, target, round(rng.uniform(3.0, 15.0), 2), rng.choice(["refuse", "blackhole"]))
    if kind == "truncate":
        return Fault(t, kind, target, 0.0, f"{rng.randint(1, 4)} GET bodies")
    if kind == "delay":
        return Fault(t, kind, target, round(rng.uniform(2.0, 8.0), 2), f"{rng.uniform(0.3, 2.5):.2f}s")
    return Fault(t, kind, target, round(rng.uniform(1.0, 5.0), 2), "503 SlowDown")


def as_json(faults: list[Fault]) -> list[dict]:
    return [asdict(f) for f in faults]
