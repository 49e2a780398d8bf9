"""The protocol's JSON objects as typed records (docs/PROTOCOL.md; where each lives: keys.py)."""

from __future__ import annotations

import json
import math
import time
from typing import Literal, NotRequired, TypedDict

from nemo_dcr_callback.protocol import keys


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


class RankSums(TypedDict):
    version: int
    base: int
    rank: int
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
    # a receiver still starting (a serving engine loading for minutes): gc keeps what it
    # holds, and the committer does not count it among the receivers a quorum is taken of
    starting: NotRequired[bool]


class RecordError(ValueError):
    """A store object that is not the record its key says it is (not JSON, a field missing or of
    the wrong type). Raised with the key named, never a bare KeyError or JSONDecodeError."""


# Fields a reader relies on, with their types. Receivers write registrations and acks with a
# token every receiver shares, so those are checked on every read; the publisher's records
# are checked where a tool reads them (status, gc) so garbage gives a clear error.
_NUM = (int, float)
SCHEMAS: dict[str, dict[str, tuple]] = {
    "registration": {"receiver": (str,), "version": (int,), "time": _NUM},
    "ack": {"version": (int,), "receiver": (str,), "base": (int,), "ok": (bool,), "time": _NUM},
    "decision": {"version": (int,), "base": (int,), "decision": (str,), "acked": (list,), "lagging": (list,),
                 "reason": (str,), "time": _NUM},
    "version": {"version": (int,), "base": (int,), "world": (int,), "ranks": (list,), "bytes": (int,),
               "params": (int,), "changed": (int,), "digests": (dict,), "time": _NUM},
}


# Receivers write registrations and acks with a token they all share: such a record is at most
# this many bytes (a real one is about 150), so reading one costs little whatever was written.
RECEIVER_RECORD_MAX = 16 << 10
MAX_INT = 1 << 63  # counts, versions and sizes are in [0, 2^63)
# Every read of a store object states the largest it takes (refused by its size, unread):
JSON_MAX = 64 << 20  # manifests, version records, decisions, keyframe records, configs, stats
# a keyframe's or verify's model (parts are read at the size their rank manifest states); a
# real checkpoint may be this large, and the readers load it whole anyway
OBJECT_MAX = 1 << 40
# a part (about PublisherConfig.part_bytes; a relay takes at most its max_object_mb): parts
# are fetched as soon as listed, before their manifest states their exact size
PART_MAX = 1 << 32
# A receiver's clock may run ahead of the reader's by this much; a registration or ack from
# further in the future is refused (one dated 1e300 counted as live for ever).
CLOCK_SKEW_S = 300.0


def read_limit(key: str) -> int:
    """The largest object a reader takes under `key`, by the kind of object it names."""
    kind = keys.kind(key)
    if kind in ("registration", "ack"):
        return RECEIVER_RECORD_MAX
    if kind == "part":
        return PART_MAX
    if kind in ("keyframe_model", "verify_model"):
        return OBJECT_MAX
    return JSON_MAX


def parse(key: str, data: bytes | bytearray):
    """JSON from a store object, RecordError naming the key for anything this reader does not
    take (not JSON, not UTF-8, a number past Python's 4,300 digits, nesting past its recursion
    limit)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise RecordError(f"{key}: not JSON this reader takes ({len(data)} bytes)") from None


def _field_ok(val, types) -> bool:
    if not isinstance(val, types) or (type(val) is bool and bool not in types):
        return False
    if type(val) is int:
        return 0 <= val < MAX_INT
    if type(val) is float:
        return math.isfinite(val)
    return True


def check(kind: str, key: str, obj) -> dict:
    """obj if it has every field of `kind` with the right type (integers in [0, 2^63), finite
    times), else RecordError naming key."""
    if not isinstance(obj, dict):
        raise RecordError(f"{key}: not a {kind} record (a JSON object expected, got {type(obj).__name__})")
    for field, types in SCHEMAS[kind].items():
        val = obj.get(field)
        if not _field_ok(val, types):
            shown = repr(val) if len(repr(val)) <= 40 else repr(val)[:40] + "..."
            raise RecordError(f"{key}: not a {kind} record (field {field!r} is {shown})")
    if kind == "registration" and not isinstance(obj.get("starting", False), bool):
        raise RecordError(f"{key}: not a registration record (field 'starting' is {obj['starting']!r:.40})")
    if kind == "decision" and obj["decision"] not in ("commit", "abort"):
        raise RecordError(f"{key}: not a decision record (decision {obj['decision']!r})")
    if kind in ("registration", "ack"):
        # what receivers write is checked for meaning too, not only form
        if obj["time"] > time.time() + CLOCK_SKEW_S:
            raise RecordError(f"{key}: not a {kind} record (dated {obj['time']:.6g}, more than {CLOCK_SKEW_S:.0f} s "
                              "ahead of this clock)")
        if obj["version"] > keys.MAX_VERSION or obj.get("base", 0) > keys.MAX_VERSION:
            raise RecordError(f"{key}: not a {kind} record (version {obj['version']} past {keys.MAX_VERSION})")
        bad = keys.name_error(obj["receiver"])
        if bad:
            raise RecordError(f"{key}: not a {kind} record ({bad})")
    return obj


def dump(obj) -> bytes:
    """Compact JSON: every receiver downloads the manifests and records of every version."""
    return json.dumps(obj, separators=(",", ":")).encode()
