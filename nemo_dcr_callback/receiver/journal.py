"""A redo journal for receivers whose weights outlive the applying code (a serving process
that stays up while the follower dies, weights in shared memory).

Before a version touches the weights, the new bits at every changed position are computed
(from the current bits and the chunk: XOR, ulp or overwrite) and written to
`redo-{v}.pt` in the journal directory; the apply is then an overwrite with those bits, which
is idempotent. A follower started on the same weights finds the pending redo file, replays
it (a torn apply is completed, whatever part of it had landed) and holds version v: it
resyncs from overwrite records, never by reloading the model. `state.json` records the
version held between applies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from nemo_dcr_callback import codec, faults, safe_io
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.core.bitops import scatter
from nemo_dcr_callback.core.rawbits import OP_OVERWRITE, bits

Record = tuple[str, torch.Tensor, torch.Tensor]  # tensor name, positions (sorted), new bits


class Journal:
    def __init__(self, path: str | os.PathLike, durable: bool = False):
        self.dir = Path(path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.durable = durable  # fsync: needed if the weights survive a machine crash, not a process one

    # ------------------------------------------------------------ state
    def held(self) -> int | None:
        p = self.dir / "state.json"
        return json.loads(p.read_text())["version"] if p.exists() else None

    def pending(self) -> tuple[int, Path] | None:
        redo = sorted(self.dir.glob("redo-*.pt"))
        return (int(redo[-1].stem.split("-")[1]), redo[-1]) if redo else None

    def _write(self, path: Path, write: Callable[[BinaryIO], None]) -> None:
        safe_io.write_streamed(path, write, self.durable)

    def done(self, v: int) -> None:
        self._write(self.dir / "state.json", lambda f: f.write(json.dumps({"version": v}).encode()))
        for p in self.dir.glob("redo-*.pt"):
            p.unlink()

    # ------------------------------------------------------------ applying
    @staticmethod
    def records(flat_of, decoded: list[codec.DecodedChunk]) -> list[Record]:
        """The new bits at every changed position, from the target's current bits: the chunk's
        op applied (compiled scatter) to a gathered copy of them."""
        out = []
        for d in decoded:
            pos = d.positions.contiguous()
            if d.op == OP_OVERWRITE:
                t = bits(flat_of(d.header.name))
                new = (d.values.view(t.dtype) if d.values.dtype != t.dtype else d.values).clone()
            else:
                new = torch.index_select(bits(flat_of(d.header.name)), 0, pos)
                scatter(new, torch.arange(pos.numel(), dtype=torch.int32), d.values, d.op)
            out.append((d.header.name, pos, new))
        return out

    def begin(self, v: int, recs: list[Record]) -> None:
        self._write(self.dir / f"redo-{v:010d}.pt", lambda f: torch.save(recs, f))

    @staticmethod
    def apply(flat_of, recs: list[Record]) -> dict[str, tuple[int, int]]:
        """Overwrite with the records (idempotent); per tensor, the digest terms before/after."""
        out: dict[str, tuple[int, int]] = {}
        for name, pos, new in recs:
            b, a = digest.scatter_terms(flat_of(name), pos, new, OP_OVERWRITE)
            digest.add_terms(out, name, b, a)
            faults.point("receiver.tensor_written")  # (a kill here tears the apply: replay completes it)
        return out

    def replay(self, flat_of) -> int | None:
        """Complete a pending (possibly torn) apply; the version then held, or None."""
        p = self.pending()
        if p is None:
            return None
        v, path = p
        self.apply(flat_of, torch.load(path, weights_only=True))
        self.done(v)
        return v
