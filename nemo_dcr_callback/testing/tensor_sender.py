"""TensorSender: a sender for canonical tensors held whole, for benchmarks and tests.

The training path is ShardSender + Publisher; this one skips placement (tensors split over
`world` senders by name, round-robin), so a link benchmark or a test can publish a synthetic
policy or a Hugging Face state dict without a Megatron model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.config import PART_BYTES, CommitPolicy
from nemo_dcr_callback.core import cuda_kernels
from nemo_dcr_callback.core.delta import Scratch, undo
from nemo_dcr_callback.core.rawbits import SparseDelta
from nemo_dcr_callback.protocol import commit, upload
from nemo_dcr_callback.sender.shard import _host, _take


class TensorSender:
    """A sender for canonical tensors held whole (a Hugging Face state dict, a synthetic
    policy): no placement, tensors split over `world` senders by name (round-robin). Used by
    the link benchmark and tests; the training path is ShardSender + Publisher."""

    def __init__(self, tensors: dict[str, torch.Tensor], rank: int = 0, world: int = 1, *,
                 span: int = codec.DEFAULT_CHUNK_SPAN, level: int = 1, baseline: str = "gpu"):
        self.tensors = {n: tensors[n] for n in sorted(tensors)[rank::world]}
        self.rank, self.world, self.span, self.level = rank, world, span, level
        self.baselines = {n: t.detach().reshape(-1).clone() for n, t in self.tensors.items()}
        cuda_kernels.check_baseline_option(baseline)
        self.baselines = {n: cuda_kernels.place_baseline(b, baseline, self.tensors[n].detach().reshape(-1))
                          if b.is_cuda else b for n, b in self.baselines.items()}
        self.digests = {n: digest.sum64(_host(b)) for n, b in self.baselines.items()}
        self._scratch = Scratch()
        self._side = cuda_kernels.SideStream()
        self._undo: list[tuple[str, SparseDelta]] = []  # every delta taken since the last settle()

    def _take_one(self, n: str, t: torch.Tensor) -> tuple[str, SparseDelta]:
        self._undo.append((n, _take(t.detach().reshape(-1), self.baselines[n], self._scratch, self._side)))
        return self._undo[-1]

    def take(self) -> list[tuple[str, SparseDelta]]:
        return [self._take_one(n, t) for n, t in self.tensors.items()]

    def stream(self, store, v: int, base: int, part_bytes: int = PART_BYTES) -> tuple[list, dict]:
        """take() and write() interleaved tensor by tensor: each tensor's chunks are encoded
        and their parts uploaded while the kernel runs over the next tensors (the refit
        starts moving bytes right after the first tensor). Returns (taken, manifest)."""
        taken: list[tuple[str, SparseDelta]] = []

        def lazily():  # a failed upload leaves what was taken in the undo log: roll_back() restores it
            for n, t in self.tensors.items():
                taken.append(self._take_one(n, t))
                yield taken[-1]

        m = self.write(store, v, base, lazily(), part_bytes=part_bytes)
        return taken, m

    def write(self, store, v: int, base: int, taken, part_bytes: int = PART_BYTES,
              after_chunk: Callable[[], None] | None = None):
        """Encode and stream one version's chunks (parts uploaded as they fill), then the
        manifest with the moved digests (kept, for the next version, by settle())."""
        w = upload.RankWriter(store, v, base, self.rank, self.world, part_bytes=part_bytes)
        dig = dict(self.digests)
        params = changed = 0
        for n, d in taken:
            params += d.numel
            changed += d.count
            if d.count:
                terms = [0, 0]
                for c in codec.encode_delta(n, d, d.new, span=self.span, level=self.level, terms=terms):
                    w.add(c)
                    if after_chunk is not None:
                        after_chunk()
                dig[n] = digest.move(dig[n], terms)
        m = w.finish(params, changed, dig)
        self._pending = dig
        return m

    def settle(self) -> None:
        """The joint commit committed the version written last: keep its digests, drop the undo."""
        self.digests = self._pending
        self._undo.clear()

    def roll_back(self, taken: list[tuple[str, SparseDelta]] | None = None) -> None:
        """Restore the baselines: of `taken`, or of everything since the last settle() (also a
        version whose upload failed half-way)."""
        ids = {id(d) for _, d in taken} if taken is not None else None
        for n, d in reversed(self._undo if taken is None else taken):
            undo(self.baselines[n], d)
        self._undo = [] if ids is None else [(n, d) for n, d in self._undo if id(d) not in ids]


def publish(store, v: int, base: int, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], world: int = 1,
            timeout: float = 60.0, **write_options) -> dict:
    """One version old -> new through the sender path over whole tensors (chunks, parts,
    manifests, seal and joint commit as the Publisher writes them; no Megatron placement):
    `world` TensorSenders write their share, the version is sealed and committed (the default
    policy: no receivers awaited). Returns the decision."""
    for r in range(world):
        s = TensorSender(old, r, world)
        for n in s.tensors:
            s.tensors[n] = new[n]
        s.write(store, v, base, s.take(), **write_options)
    rec = commit.seal_version(store, v, base, world, timeout=timeout)
    return commit.run_commit(store, rec, CommitPolicy())
