"""The protocol's JSON objects as typed records (docs/PROTOCOL.md; where each lives: keys.py)."""

from __future__ import annotations

from typing import Literal, TypedDict


class PartRef(TypedDict):
    key: str
    bytes: int
    chunks: int
    checksum: str  # xxh3-64 of the part's bytes (hex)


class RankManifest(TypedDict):
    version: int
    base: int
    rank: int
    world: int
    parts: list[PartRef]
    bytes: int
    chunks: int
    params: int
    changed: int
    digests: dict[str, str]  # canonical tensor -> additive digest of this rank's slice at `version`


class VersionRecord(TypedDict):
    version: int
    base: int  # the version a receiver must hold to apply this one
    world: int
    ranks: list[str]  # manifest keys
    bytes: int
    params: int
    changed: int
    digests: dict[str, str]  # canonical tensor -> digest of the whole tensor at `version`
    time: float


class Ack(TypedDict):
    version: int
    receiver: str
    base: int
    ok: bool
    error: str | None
    time: float


class Decision(TypedDict):
    version: int
    base: int
    decision: Literal["commit", "abort"]
    acked: list[str]
    lagging: list[str]  # receivers that did not ack in time: they catch up later
    reason: str
    time: float


class Registration(TypedDict):
    receiver: str
    version: int
    time: float
