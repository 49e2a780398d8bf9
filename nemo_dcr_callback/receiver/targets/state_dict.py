"""StateDictTarget: canonical tensors by name (a Hugging Face model's state_dict(), whose
tensors share storage with the parameters). Positions are applied directly."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import digest

_POOL: ThreadPoolExecutor | None = None


def _apply_pool() -> ThreadPoolExecutor | None:
    """Threads for the receiver's apply (None on one core)."""
    global _POOL
    n = min(4, os.cpu_count() or 1)
    if n < 2:
        return None
    if _POOL is None:
        _POOL = ThreadPoolExecutor(n, thread_name_prefix="nemo-dcr-apply")
    return _POOL


class StateDictTarget:
    """Tensors by canonical name, each applied in place through a flat view."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def check(self, h: codec.ChunkHeader) -> None:
        t = self.tensors.get(h.name)
        if t is None:
            raise codec.ChunkError(f"receiver has no tensor {h.name!r} (wrong model?)")
        if not t.is_contiguous():
            raise codec.ChunkError(f"receiver tensor {h.name!r} is not contiguous")
        codec.check_target(h, t, h.name)

    def apply(self, decoded: list[codec.DecodedChunk]) -> None:
        codec.apply_all(decoded, [self.tensors[d.header.name].view(-1) for d in decoded])

    def apply_with_terms(self, decoded: list[codec.DecodedChunk]) -> dict[str, tuple[int, int]]:
        """apply() fused with the digest check: per tensor, the digest terms of the touched
        elements before and after (read from the tensors themselves in the same pass)."""
        def one(d: codec.DecodedChunk) -> tuple[int, int]:
            return digest.scatter_terms(self.tensors[d.header.name].view(-1), d.positions, d.values, d.op)

        # Chunks touch disjoint positions and the terms add up in any order, so they are applied
        # on a few threads (the compiled scatter runs without the GIL): the apply sits after the
        # commit decision, on the refit's critical path.
        pool = _apply_pool() if len(decoded) > 1 else None
        terms = list(pool.map(one, decoded)) if pool is not None else [one(d) for d in decoded]
        out: dict[str, tuple[int, int]] = {}
        for d, (b, a) in zip(decoded, terms, strict=True):
            digest.add_terms(out, d.header.name, b, a)
        return out

    def names(self) -> list[str]:
        return list(self.tensors)

    def flat(self, name: str) -> torch.Tensor:
        return self.tensors[name].view(-1)


def apply_chunks(state: dict[str, torch.Tensor], chunks: list[bytes]) -> int:
    """Apply chunks to canonical tensors: every chunk is checked and decoded before any is
    applied. Returns the number of changed elements."""
    target = StateDictTarget(state)
    decoded = []
    for c in chunks:
        h = codec.parse_header(c)
        for part in h.parts():
            target.check(part)
        decoded += codec.decode_parts(c, h, old=lambda m: state[m.name])  # before any is applied
    target.apply(decoded)
    return sum(d.header.count for d in decoded)
