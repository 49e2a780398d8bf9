"""Weights rebuilt from the store alone: keyframes and the committed chain after them.

The plainest reader of the protocol, below both sides: a restarted sender rebases on
`reconstruct`, the callback's `verify` option follows the chain with a `Replica`, receivers
start from `load_keyframe`. It reads whole parts, checks each against its manifest and every
chunk against the tensors, decodes with the codec, applies to a dict of tensors and checks
the version record's digests. Nothing is written before every chunk of a version is
verified and decoded. The streaming receiver (receiver/follow.py) is the fast path to the
same bits; this is the simple one, with no acks, journal or early apply.
"""

from __future__ import annotations

import xxhash
from safetensors.torch import load

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.protocol import commit, keys, records


class KeyframeError(ValueError):
    """A keyframe that does not parse, or whose tensors differ from its record's digests."""


def load_keyframe(store, k: int) -> tuple[dict, bytes]:
    """Keyframe k's tensors (and the file's bytes), checked against its record: a corrupt or
    replaced keyframe is refused with its key named, before any receiver starts from it."""
    key = keys.keyframe_model(k)
    blob = store.get(key, limit=records.read_limit(key))
    try:
        tensors = load(blob)
    except Exception as exc:  # (safetensors raises its own SafetensorError, and others on odd headers)
        raise KeyframeError(f"{key}: not a valid safetensors file ({exc})") from None
    rec = commit.read_keyframe(store, k)
    if rec is not None:
        ref = rec["digests"]
        bad = sorted(n for n in set(ref) | set(tensors)
                     if n not in tensors or n not in ref or digest.hexd(digest.sum64(tensors[n])) != ref[n])
        if bad:
            raise KeyframeError(f"{key}: tensor {bad[0]!r} differs from {keys.keyframe_record(k)} "
                                f"({len(bad)} tensors): a corrupt or replaced keyframe")
    return tensors, blob


def committed_keyframes(store) -> list[int]:
    """Keyframes of committed versions (version 0's counts as committed), oldest first."""
    return [k for k in commit.keyframes(store)
            if k == 0 or (commit.read_decision(store, k) or {}).get("decision") == "commit"]


def latest_keyframe(store) -> int | None:
    """The newest keyframe of a committed version (or version 0)."""
    kfs = committed_keyframes(store)
    return kfs[-1] if kfs else None


def read_version(store, v: int) -> tuple[commit.VersionRecord, list[bytes]]:
    """The record and every chunk of sealed version v, each part checked against its rank's
    manifest (bytes and checksum): refused with the part named if it was corrupted or cut."""
    rec = commit.read_record(store, v)
    if rec is None:
        raise KeyError(f"version {v} is not sealed")
    chunks: list[bytes] = []
    for key in rec["ranks"]:
        m = commit.read_json(store, key)
        if m is None:
            raise codec.ChunkError(f"{key}: manifest missing")
        if m["version"] != v or m["base"] != rec["base"]:
            raise codec.ChunkError(f"{key}: manifest is for version {m['version']} on {m['base']}, not {v}")
        for p in m["parts"]:
            try:
                blob = store.get(p["key"], limit=p["bytes"])
            except KeyError:
                raise codec.ChunkError(f"{p['key']}: part missing from the store") from None
            if len(blob) != p["bytes"] or xxhash.xxh3_64_hexdigest(blob) != p["checksum"]:
                raise codec.ChunkError(f"{p['key']}: does not match its manifest (corrupt or truncated)")
            chunks += [bytes(c) for c in codec.split_chunks(blob)]
    return rec, chunks


class Replica:
    """Canonical tensors (name -> tensor, changed in place) that follow a store's committed
    chain from `version`, which they must hold: checked against the store's digests here."""

    def __init__(self, store, tensors: dict, version: int):
        self.store, self.tensors, self.version = store, tensors, version
        self.changed: dict[int, int] = {}  # version applied -> elements it changed
        self.digests = {n: digest.sum64(t) for n, t in tensors.items()}
        ref = commit.version_digests(store, version)
        if ref is not None:
            bad = sorted(n for n in ref if n not in self.digests or int(ref[n], 16) != self.digests[n])
            if bad:
                raise codec.ChunkError(f"the tensors do not hold version {version}: tensor {bad[0]!r} differs "
                                       f"({len(bad)} tensors)")

    def apply(self, v: int, decided: bool = False) -> int:
        """Apply committed version v (its base must be the version held); returns the number
        of changed elements. A bad chunk or digest raises codec.ChunkError. decided: the caller
        has read v's decision already (commit)."""
        if not decided:
            d = commit.read_decision(self.store, v)
            if d is None or d["decision"] != "commit":
                raise KeyError(f"version {v} is not committed ({d['decision'] if d else 'undecided'})")
        rec, chunks = read_version(self.store, v)
        if rec["base"] != self.version:
            raise codec.ChunkError(f"version {v} builds on {rec['base']}, the replica holds {self.version}")
        decoded = []
        for c in chunks:  # every chunk verified and decoded before anything is written
            h = codec.parse_header(c)
            for part in h.parts():
                t = self.tensors.get(part.name)
                if t is None:
                    raise codec.ChunkError(f"version {v}: no tensor {part.name!r} here (wrong model?)")
                codec.check_target(part, t, part.name)
            # context-coded chunks read the old bits: nothing of v is applied yet
            decoded += codec.decode_parts(c, h, old=lambda m: self.tensors[m.name])
        dg = dict(self.digests)
        for dc in decoded:
            n = dc.header.name
            before, after = digest.scatter_terms(self.tensors[n].view(-1), dc.positions, dc.values, dc.op)
            dg[n] = (dg[n] - before + after) & digest.MASK
        bad = [n for n, x in rec["digests"].items() if n in dg and int(x, 16) != dg[n]]
        if bad:
            raise codec.ChunkError(f"version {v}: after applying, tensor {bad[0]!r} does not match the version's "
                                   f"digest ({len(bad)} tensors)")
        self.digests, self.version = dg, v
        self.changed[v] = sum(dc.header.count for dc in decoded)
        return self.changed[v]

    def catch_up(self, until: int) -> int:
        """Apply the committed versions after the one held, up to `until`; returns the version
        then held. Committed versions form one chain: each builds on the previous one."""
        for u in commit.list_versions(self.store):
            if self.version < u <= until:
                d = commit.read_decision(self.store, u)
                if d is not None and d["decision"] == "commit":
                    self.apply(u, decided=True)
        return self.version


def reconstruct(store, v: int) -> dict:
    """The canonical tensors of committed version v, rebuilt from the newest committed keyframe
    at or before v plus the committed deltas after it, every step checked against the
    version records' digests."""
    kfs = [k for k in committed_keyframes(store) if k <= v]
    if not kfs:
        raise KeyError(f"no keyframe at or before version {v} to rebuild it from")
    tensors, _ = load_keyframe(store, kfs[-1])
    r = Replica(store, tensors, kfs[-1])
    if r.catch_up(v) != v:
        raise KeyError(f"version {v} is not committed (rebuilt up to {r.version})")
    return tensors
