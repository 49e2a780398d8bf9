"""The worker's copy of the new bits, for context coding (codec/context.py) off the trainer.

Context coding reads, for every position of a chunk's range, the exponent of the value the
receivers hold. The trainer's baselines have them, but they live in the trainer (on the GPU,
for CUDA shards) and the next step rewrites them while the worker still encodes. So the
worker keeps its own copy, in canonical coordinates, of each canonical run this rank owns
whole (a tensor, or one contiguous part of it: a data-parallel slice), and moves it with
every version it encodes. Runs this rank shares with others (row-parallel tensor shards) are
not kept: their chunks are coded plain.

Versions can be undone (an abort, a failed upload): each one's old bits at its changed
positions are kept until its commit, so the copy can go back to any base the trainer rebases
on. A base it cannot reach turns context coding off (said once), never codes from wrong bits.
"""

from __future__ import annotations

import sys

import torch

Key = tuple[str, str]  # (Megatron parameter, canonical tensor)
Record = tuple[Key, torch.Tensor, torch.Tensor]  # positions in the run, old bits there


class Mirror:
    """runs: (parameter, canonical tensor) -> (where the run starts in the tensor, its bits);
    `version`: the version those bits are."""

    def __init__(self, runs: dict[Key, tuple[int, torch.Tensor]], version: int):
        self.runs = runs
        self.version = version
        self._log: dict[int, tuple[int, list[Record]]] = {}  # version -> (its base, its records)
        self._open: tuple[int, int, list[Record]] | None = None  # the version being encoded

    def get(self, param: str, canon: str) -> tuple[int, torch.Tensor] | None:
        return self.runs.get((param, canon))

    def begin(self, version: int, base: int) -> None:
        """Before encoding `version`: back to its base (undoing later versions, newest first)."""
        while self.version != base and self.version in self._log:
            b, records = self._log.pop(self.version)
            self._undo(records)
            self.version = b
        if self.version != base and self.runs:
            print(f"nemo-dcr publisher: the context copy holds version {self.version}, not {base}: context "
                  "coding is off from here on", file=sys.stderr, flush=True)
            self.runs = {}
        self._open = (version, base, [])

    def advance(self, key: Key, rel: torch.Tensor, new_bits: torch.Tensor) -> None:
        """The new bits at positions `rel` of run `key` (the version being encoded)."""
        run = self.runs[key][1]
        self._open[2].append((key, rel, run[rel].clone()))
        run[rel] = new_bits

    def end(self, ok: bool) -> None:
        """The version is encoded (ok) or failed part way (its changes are taken back)."""
        version, base, records = self._open
        self._open = None
        if ok:
            self._log[version] = (base, records)
            self.version = version
        else:
            self._undo(records)

    def settle(self, version: int, decision: str) -> None:
        """A committed version's undo, and any older, is no longer needed."""
        if decision == "commit":
            for v in [v for v in self._log if v <= version]:
                del self._log[v]

    def _undo(self, records: list[Record]) -> None:
        for key, rel, old in reversed(records):
            if key in self.runs:
                self.runs[key][1][rel] = old
