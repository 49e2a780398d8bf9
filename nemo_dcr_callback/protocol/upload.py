"""One rank's share of a version, written to the store: parts, then sums, then the manifest.

The order is the protocol's (docs/PROTOCOL.md): a manifest names only complete, checksummed
parts, and the rank's slice digests are in the store before it, so whoever sees the manifest
(the sealer) finds them. The sender's worker streams with RankWriter; tools and tests write a
list of chunks with write_rank.
"""

from __future__ import annotations

import time

import xxhash

from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.config import PART_BYTES
from nemo_dcr_callback.protocol.keys import part_key, rank_manifest, rank_sums
from nemo_dcr_callback.protocol.records import PartRef, RankManifest, RankSums, dump


class RankWriter:
    """Streams one rank's chunks of one version: chunks gather into parts of `part_bytes`,
    each part is uploaded as soon as it is full (concurrently where the store can), and the
    manifest goes last, so a manifest always names complete, checksummed parts. Parts ramp up:
    the first is a sixteenth of the size (at least 64 KiB), each next one twice the last, up
    to part_bytes, so bytes start crossing the link after a sixteenth of the encoding work a
    full part would take, and the link is not left idle while the next part is encoded (where
    the encoder runs at about the link's rate, a full second part left it idle for most of
    that part's encoding). bench refit at 1%: median 0.77 s with a quarter-size first part
    and full parts after it, 0.70-0.74 s with the ramp (and FETCH_LANES)."""

    def __init__(self, store, v: int, base: int, rank: int, world: int, part_bytes: int = PART_BYTES,
                 max_inflight: int = 8):
        self.store, self.v, self.base, self.rank, self.world = store, v, base, rank, world
        self.part_bytes, self.max_inflight = part_bytes, max_inflight
        self.first_part_bytes = min(part_bytes, max(64 << 10, part_bytes // 16))
        self._next_bytes = self.first_part_bytes  # the size the part being filled is sent at
        self.parts: list[PartRef] = []
        self._buf: list[bytes] = []
        self._size = 0
        self._futs: list = []
        self._sizes: dict[int, int] = {}  # id(future) -> its part's bytes
        self._t_first: float | None = None  # when the first part was handed over

    def backlog(self) -> int:
        """Bytes of parts handed to the store and not yet uploaded: where this stays above a
        part, the link, not the encoder, is the bottleneck (a sender then has CPU to spare for
        a smaller coding). A store without a pool uploads in add(): never a backlog."""
        return sum(self._sizes.get(id(f), 0) for f in self._futs if not f.done())

    def ahead(self, link_bytes_per_s: float) -> float:
        """Bytes of parts handed to the store beyond what a link of this rate has carried since
        the first part: the backlog of a link the sender cannot see (the receivers', where the
        store is near the sender). Chunks still gathering into a part do not count: the link
        cannot have them yet."""
        if self._t_first is None:
            return 0.0
        return sum(p["bytes"] for p in self.parts) - link_bytes_per_s * (time.monotonic() - self._t_first)

    def add(self, chunk: bytes) -> None:
        self._buf.append(chunk)
        self._size += len(chunk)
        if self._size >= self._next_bytes:
            self._flush_part()
            self._next_bytes = min(self.part_bytes, 2 * self._next_bytes)

    def _flush_part(self) -> None:
        if not self._buf:
            return
        data = b"".join(self._buf)
        key = part_key(self.v, self.rank, len(self.parts))
        self.parts.append(PartRef(key=key, bytes=len(data), chunks=len(self._buf),
                                  checksum=xxhash.xxh3_64_hexdigest(data)))
        self._buf, self._size = [], 0
        if self._t_first is None:
            self._t_first = time.monotonic()
        pool = getattr(self.store, "executor", None)
        if pool is None:
            self.store.put(key, data, durable=False)
            return
        self._futs = [f for f in self._futs if not f.done() or f.exception()]
        while len(self._futs) >= self.max_inflight:  # bounded memory: wait for the oldest upload
            self._futs.pop(0).result()
        self._futs.append(pool().submit(self.store.put, key, data, False))
        self._sizes = {id(f): self._sizes.get(id(f), len(data)) for f in self._futs}

    def finish(self, params: int, changed: int, digests: dict[str, int]) -> RankManifest:
        self._flush_part()
        for f in self._futs:
            f.result()  # the first upload error is raised here
        sums = RankSums(version=self.v, base=self.base, rank=self.rank,
                        digests={k: digest.hexd(d) for k, d in digests.items()})
        self.store.put(rank_sums(self.v, self.rank), dump(sums), durable=False)  # before the manifest: sealed
        m = RankManifest(version=self.v, base=self.base, rank=self.rank, world=self.world, parts=self.parts,
                         bytes=sum(p["bytes"] for p in self.parts), chunks=sum(p["chunks"] for p in self.parts),
                         params=params, changed=changed)
        self.store.put(rank_manifest(self.v, self.rank), dump(m), durable=False)
        return m


def write_rank(store, v: int, base: int, rank: int, world: int, chunks: list[bytes], params: int, changed: int,
               digests: dict[str, int] | None = None) -> RankManifest:
    """One rank's chunks in one go (tools and tests; the publisher streams with RankWriter)."""
    w = RankWriter(store, v, base, rank, world)
    for c in chunks:
        w.add(c)
    return w.finish(params, changed, digests or {})
