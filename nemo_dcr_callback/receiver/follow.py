"""Following a store: fetch each sealed version whose base is the version held, verify every
chunk, then apply them all to the target (nothing is applied from a version that fails)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from nemo_dcr_callback import codec, commit


@dataclass
class Applied:
    version: int
    base: int
    chunks: int
    changed: int
    bytes: int
    fetch_s: float
    apply_s: float


def fetch_version(store, v: int) -> tuple[dict, list[bytes]]:
    """The record and every chunk of version v, each checked against its manifest."""
    rec = commit.read_record(store, v)
    if rec is None:
        raise KeyError(f"version {v} is not sealed")
    chunks: list[bytes] = []
    for key in rec["ranks"]:
        m = json.loads(store.get(key))
        if m["version"] != v:
            raise codec.ChunkError(f"{key}: manifest is for version {m['version']}, not {v}")
        blob = store.get(m["object"]) if m["chunks"] else b""
        if len(blob) != m["bytes"]:
            raise codec.ChunkError(f"{m['object']}: {len(blob)} bytes, manifest says {m['bytes']} (truncated)")
        for ref in m["chunks"]:
            c = blob[ref["offset"]:ref["offset"] + ref["length"]]
            if xxhash.xxh3_64_hexdigest(c) != ref["checksum"]:
                raise codec.ChunkError(f"{m['object']}: chunk at {ref['offset']} does not match its manifest")
            chunks.append(c)
    return rec, chunks


class Follower:
    """Applies versions, in chain order, to a target: canonical tensors (name -> tensor
    sharing storage with the model, e.g. a Hugging Face model's state_dict()) or a target
    object from receiver.targets (a model updated through its own loader)."""

    def __init__(self, store, target, version: int = 0):
        from nemo_dcr_callback.receiver.targets import StateDictTarget

        self.store = store
        self.target = StateDictTarget(target) if isinstance(target, dict) else target
        self.tensors = target if isinstance(target, dict) else None
        self.version = version

    def apply_version(self, v: int) -> Applied:
        t0 = time.perf_counter()
        rec, chunks = fetch_version(self.store, v)
        if rec["base"] != self.version:
            raise codec.ChunkError(f"version {v} builds on {rec['base']}, this receiver holds {self.version}")
        decoded = []
        for c in chunks:  # verify and decode everything before touching a weight
            h = codec.parse_header(c)
            self.target.check(h)
            decoded.append(codec.decode_chunk(c, h))
        t1 = time.perf_counter()
        if hasattr(self.target, "version"):  # targets that journal (checkpoint directories)
            self.target.apply(decoded, version=v)
        else:
            self.target.apply(decoded)
        self.version = v
        return Applied(v, rec["base"], len(chunks), sum(d.header.count for d in decoded),
                       sum(map(len, chunks)), t1 - t0, time.perf_counter() - t1)

    def poll(self, on_apply: Callable[[Applied], None] | None = None) -> list[Applied]:
        """Apply every sealed version that follows the one held, in order; on_apply runs
        right after each one (before the next is applied)."""
        out = []
        while True:
            nxt = [v for v in commit.list_versions(self.store) if v > self.version]
            for v in nxt:
                rec = commit.read_record(self.store, v)
                if rec and rec["base"] == self.version:
                    out.append(self.apply_version(v))
                    if on_apply:
                        on_apply(out[-1])
                    break
            else:
                return out

    def follow(self, until: int | None = None, timeout: float = 600.0, poll_s: float = 0.05,
               on_apply: Callable[[Applied], None] | None = None) -> None:
        """Keep applying versions as they are sealed, until version `until` (or timeout)."""
        deadline = time.monotonic() + timeout
        while until is None or self.version < until:
            if self.poll(on_apply):
                deadline = time.monotonic() + timeout
            if until is not None and self.version >= until:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no new version after {timeout:.0f} s (holding {self.version})")
            time.sleep(poll_s)
