"""The parts of a version, fetched, verified and decoded (the Follower's transfer side).

Each part is fetched in order, a few at a time (FETCH_LANES), and decoded chunk by chunk as
its bytes arrive; every chunk's checksum is verified and its header checked against the
target before it is kept. `Parts` holds one version's, and the record of an early apply:

Early apply (opt-in, in-memory tensors: Follower(early=True)): the parts of the next version
are applied in place as they arrive, each chunk verified first, with an undo record (XOR is
its own inverse; other ops keep the old bits), and the digests are checked before the ack,
as in the design's receiver path (apply, verify, ack). So the apply overlaps the transfer
instead of following the decision. Anything that then fails (a part against its manifest, a
digest, an abort) is undone exactly before the version is dropped: the weights are back on
the bits of the version held. early="sealed" waits until the version is sealed (the senders
are done encoding) and then applies the parts held while the rest are still on the link: the
apply hides in the transfer's tail without taking CPU from the encoders. Off by default: on
a host whose CPUs the receiver shares with the senders and relays (this project's
benchmarks), applying chunk by chunk during the transfer costs more CPU than the batched
apply after the decision and slowed the refit; see docs/PROTOCOL.md for figures.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch
import xxhash

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import context, digest
from nemo_dcr_callback.codec.decode import OldBits
from nemo_dcr_callback.config import FETCH_LANES
from nemo_dcr_callback.core.bitops import scatter, ulp_negate
from nemo_dcr_callback.core.rawbits import OP_OVERWRITE, OP_ULP, OP_XOR, bits
from nemo_dcr_callback.protocol.records import read_limit
from nemo_dcr_callback.safe_io import TooLarge

Part = tuple[int, str, list[codec.DecodedChunk]]  # a part's bytes, xxh3 and decoded chunks


class Parts:
    """Verified, decoded parts of one version, fetched as they appear: in order, a couple at a
    time (FETCH_LANES). On a link-bound transfer every part fetched at once shares the link
    and they all land together at the end, so their decoding (and an early apply) piled up
    after the last byte; fetched in order they land one by one, and each is decoded while the
    next is on the link. Two lanes: the next request is under way while a part streams. A
    link with a large bandwidth-delay product (S3 in another region, tens of ms away) needs
    more parts in flight to fill it: Follower(fetch_lanes=...)."""

    def __init__(self, lanes: int = FETCH_LANES):
        self.lanes = lanes
        self.parts: dict[str, Part] = {}  # key -> (bytes, xxh3, decoded)
        self.pending: dict[str, Future] = {}  # key -> a fetch running in the store's pool
        self.queued: list[str] = []  # keys waiting for a lane
        self.lock = threading.RLock()  # pending/queued: the pool's done-callbacks start queued fetches
        self.t0: float | None = None
        # early apply: the parts applied in place so far, each chunk's undo (None: XOR, its own
        # inverse; else the old bits) and the digest terms (before, after) per tensor
        self.applied: set[str] = set()
        self.undo: list[tuple[codec.DecodedChunk, torch.Tensor | None]] = []
        self.terms: dict[str, tuple[int, int]] = {}

    def harvest(self) -> None:
        """Keep the background fetches that finished; a failed one is dropped (fetched again,
        in the caller's thread, when the version is staged: its error is raised there)."""
        with self.lock:
            for key, fut in list(self.pending.items()):
                if fut.done():
                    del self.pending[key]
                    if fut.exception() is None:
                        self.parts[key] = fut.result()[1:]

    def fetch(self, keys: list[str], pool, fetch_one) -> None:
        """Queue keys not yet held, under way or queued, and fill the free lanes."""
        with self.lock:
            self.queued += [k for k in keys if k not in self.parts and k not in self.pending and k not in self.queued]
        self._pump(pool, fetch_one)

    def _pump(self, pool, fetch_one) -> None:
        with self.lock:
            while self.queued and sum(not f.done() for f in self.pending.values()) < self.lanes:
                key = self.queued.pop(0)
                fut = self.pending[key] = pool.submit(fetch_one, key)
                fut.add_done_callback(lambda _f: self._pump(pool, fetch_one))

    def in_flight(self, keys: list[str]) -> set[Future]:
        """While any of keys is under way or queued, every fetch under way (one finishing
        harvests a part or frees a lane for a queued one); empty once none of keys is."""
        with self.lock:
            if any(k in self.pending or k in self.queued for k in keys):
                return set(self.pending.values())
            return set()

    def cancel(self) -> None:
        with self.lock:
            self.queued.clear()

    # ------------------------------------------------------------ early apply
    def apply_held(self, target) -> None:
        """Apply, in place, every part held and not applied yet, keeping each chunk's undo and
        the digest terms."""
        self.harvest()
        for key, (_, _, dec) in list(self.parts.items()):
            if key in self.applied:
                continue
            for d in dec:  # one chunk at a time: the undo log never holds a chunk not applied
                flat = target.flat(d.header.name)
                # XOR and ulp chunks are undone from the chunk itself; only overwrites keep the old bits
                old = None if d.op in (OP_XOR, OP_ULP) else torch.index_select(bits(flat), 0, d.positions)
                b, a = target.apply_with_terms([d])[d.header.name]
                self.undo.append((d, old))
                digest.add_terms(self.terms, d.header.name, b, a)
            self.applied.add(key)

    def rollback(self, target) -> None:
        """Take back every early-applied chunk, newest first: the weights are exactly as before."""
        for d, old in reversed(self.undo):
            flat = target.flat(d.header.name)
            if d.op == OP_ULP:
                scatter(flat, d.positions, ulp_negate(d.values), OP_ULP)
            elif old is None:
                scatter(flat, d.positions, d.values, OP_XOR)
            else:
                scatter(flat, d.positions, old, OP_OVERWRITE)
        self.undo.clear()
        self.applied.clear()
        self.terms = {}


Check = Callable[[codec.ChunkHeader], None]


def _decode_checked(c: bytes | memoryview, check: Check, old: OldBits | None = None) -> list[codec.DecodedChunk]:
    """One chunk of a part: its checksum and header verified, every tensor it writes checked
    against the target, decoded (one DecodedChunk per tensor: a batched chunk holds several).
    old: the target's bits of a tensor (context-coded chunks are decoded from them)."""
    h = codec.parse_header(c)
    for part in h.parts():
        check(part)
    return codec.decode_parts(c, h, old)


class _PartDecoder:
    """One part's chunks, each verified (checksum, target) and decoded as soon as its last byte
    is in; the part's length and xxh3 are taken as it arrives, for the manifest check."""

    def __init__(self, check: Check, old: OldBits | None = None):
        self.check, self.old = check, old
        self.reset()

    def reset(self) -> None:  # a fetch that broke off starts again from the first byte
        self.buf, self.off, self.size = bytearray(), 0, 0
        self.hash = xxhash.xxh3_64()
        self.decoded: list[codec.DecodedChunk] = []

    def feed(self, piece: bytes) -> None:
        self.buf += piece
        self.size += len(piece)
        self.hash.update(piece)
        while True:
            with memoryview(self.buf) as mv:
                end = codec.chunk_end(mv, self.off)
                if end is None or end > len(mv):
                    break
                c = bytes(mv[self.off:end])  # a copy: the buffer grows under it
            self.decoded += _decode_checked(c, self.check, self.old)
            self.off = end
        if self.off >= 1 << 20:  # drop the decoded bytes
            del self.buf[:self.off]
            self.off = 0

    def finish(self) -> Part:
        if self.off != len(self.buf):
            raise codec.ChunkError(f"part ends inside a chunk ({len(self.buf) - self.off} bytes left): truncated")
        return self.size, self.hash.hexdigest(), self.decoded


def fetch_part(store, key: str, check: Check, old: OldBits | None = None) -> tuple[str, int, str, list]:
    """Fetch one part, verify it (chunk checksums, `check` against the target) and decode it:
    chunk by chunk as its bytes arrive where the store streams them (S3), so after a part's
    last byte only its last chunk is left to decode. `old` reads the target's bits of a tensor
    for context-coded chunks: they must be the version's base (the Follower fetches a version
    only while it holds its base). Returns (key, bytes, xxh3, decoded)."""
    pieces = getattr(store, "get_pieces", None)
    if pieces is not None:
        part = _PartDecoder(check, old)
        try:
            pieces(key, part, limit=read_limit(key))
        except KeyError:
            raise codec.ChunkError(f"{key}: part missing from the store") from None
        except TooLarge as exc:
            raise codec.ChunkError(str(exc)) from None
        return (key, *part.finish())
    try:
        blob = store.get(key, limit=read_limit(key))
    except KeyError:
        raise codec.ChunkError(f"{key}: part missing from the store") from None
    except TooLarge as exc:
        raise codec.ChunkError(str(exc)) from None
    decoded = [d for c in codec.split_chunks(blob) for d in _decode_checked(c, check, old)]
    return key, len(blob), xxhash.xxh3_64_hexdigest(blob), decoded


class HeldBits:
    """A tensor's bits as the target holds them (the version held: a version is fetched only
    while its base is held), for context-coded chunks: a flat view where the target has one,
    else the canonical tensor read through its loader's copies (kept for the version held: a
    tensor of several chunks is read once). A tensor on a GPU is read as its exponent bytes,
    computed on the device (the walk needs no more)."""

    def __init__(self, target):
        self.target = target
        self.device = getattr(target, "device", None)  # a loader's model on a GPU: old bits read there
        self._lock = threading.Lock()
        self._cache: tuple[int, dict[str, torch.Tensor]] = (-1, {})

    def forget(self) -> None:
        """The version held moved on: what was read is stale."""
        self._cache = (-1, {})

    def __call__(self, h: codec.ChunkHeader, version: int) -> torch.Tensor:
        flat = getattr(self.target, "flat", None)
        if flat is not None:
            return _host(flat(h.name))
        canonical = getattr(self.target, "canonical", None)
        if canonical is None:
            raise codec.ChunkError(f"chunk for {h.name!r} is context-coded, and this receiver "
                                   f"({type(self.target).__name__}) cannot read the bits it holds")
        with self._lock:
            if self._cache[0] != version:
                self._cache = (version, {})
            held = self._cache[1]
            if h.name not in held:
                t = canonical(h.name, device=self.device) if self.device is not None else canonical(h.name)
                if t is None:
                    raise codec.ChunkError(f"chunk for {h.name!r} is context-coded, and this receiver holds only "
                                           "part of that tensor (tensor parallel): it cannot read the old bits")
                held[h.name] = _host(t)
            return held[h.name]


def _host(t: torch.Tensor) -> torch.Tensor:
    """Old bits on the host, flat, for the decoder's walk: a host tensor as it is, a device
    tensor as its exponent bytes (computed there; half of BF16's bytes cross to the host)."""
    return t.reshape(-1) if t.is_cpu else context.exponent_bytes(t).cpu()
