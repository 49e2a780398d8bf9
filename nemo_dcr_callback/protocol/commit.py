"""The commit protocol: versions in a store, receiver acks, the joint commit (docs/PROTOCOL.md).

The store's keys are in protocol/keys.py, the JSON objects' types in protocol/records.py; both
are re-exported here under their old names (`commit.part_key`, `commit.VersionRecord`, ...).
A rank's parts and manifest are written by protocol/upload.py; this module seals a version
from the manifests, collects the receivers' acks and writes the one decision (the joint
commit: the only step called "commit" in this package).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Collection

import torch
from safetensors.torch import save

from nemo_dcr_callback.bounded import Bounded
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.config import CommitPolicy
from nemo_dcr_callback.protocol import keys, records
from nemo_dcr_callback.protocol.keys import (  # noqa: F401 - re-exported for commit's callers
    ack_key,
    decision_key,
    keyframe_dir,
    part_key,
    rank_manifest,
    rank_sums,
    receiver_key,
    vdir,
    verify_key,
    version_record,
)
from nemo_dcr_callback.protocol.records import (  # noqa: F401 - re-exported for commit's callers
    RECEIVER_RECORD_MAX,
    Ack,
    Decision,
    PartRef,
    RankManifest,
    RankSums,
    RecordError,
    Registration,
    VersionRecord,
    check,
    dump,
)
from nemo_dcr_callback.protocol.store import StoreError, backoff, wait_change, wait_news
from nemo_dcr_callback.safe_io import TooLarge


def read_json(store, key: str, limit: int | None = None):
    """A JSON object from the store, or None if the key does not exist; RecordError (naming the
    key) if the object is not JSON this reader takes: over `limit` bytes (default: what its
    kind of object may have, records.read_limit), refused unread by its size; refused by a
    relay as a bad record; not JSON, a number past Python's 4,300 digits or nesting past its
    recursion limit."""
    limit = records.read_limit(key) if limit is None else limit
    try:
        data = store.get(key, limit=limit)
    except KeyError:
        return None
    except TooLarge as exc:
        raise RecordError(f"{key}: {exc.size} bytes, more than such a record may have ({limit})") from None
    return records.parse(key, data)


# keys already warned about (one warning per bad key; Bounded: made-up keys cannot grow it)
_warned: Bounded[tuple[str, str], None] = Bounded(4096)  # (store URL, key)


def _lenient(kind: str, key: str, obj, where: str = "") -> dict | None:
    """A receiver-written record, or None (with one warning per key) if it is malformed: one
    bad registration or ack must not stop training or the tools."""
    if obj is None or isinstance(obj, RecordError):
        if obj is not None and (where, key) not in _warned:
            _warned[(where, key)] = None
            print(f"nemo-dcr: skipping {obj}", file=sys.stderr)
        return None
    try:
        return check(kind, key, obj)
    except RecordError as exc:
        if (where, key) not in _warned:
            _warned[(where, key)] = None
            print(f"nemo-dcr: skipping {exc}", file=sys.stderr)
        return None


def _read_lenient(store, key: str):
    try:
        return read_json(store, key, RECEIVER_RECORD_MAX)
    except RecordError as exc:
        return exc


def read_receiver_records(store, kind: str, keys: list[str]) -> list[dict | None]:
    """The one reader of what receivers write (registrations, acks): each key's record, or
    None where it is absent or bad (over RECEIVER_RECORD_MAX bytes, not JSON this reader
    takes, not the record its key says: skipped with one warning naming the key), read
    concurrently where the store has a thread pool (a fleet's records: one request each,
    which in a row put a round trip per receiver on the commit's path)."""
    pool = getattr(store, "executor", None)
    if pool is None or len(keys) < 2:
        raw = [_read_lenient(store, k) for k in keys]
    else:
        raw = list(pool().map(lambda k: _read_lenient(store, k), keys))
    where = getattr(store, "url", "")
    return [_lenient(kind, k, r, where) for k, r in zip(keys, raw, strict=True)]


def seal_version(store, v: int, base: int, world: int, timeout: float = 600.0, poll: float = 0.01) -> VersionRecord:
    """Wait for every rank's manifest of version v, then write its record with a conditional
    write (if another writer got there first, theirs stands). Returns the record."""
    deadline = time.monotonic() + timeout
    keys = [rank_manifest(v, r) for r in range(world)]
    ms: dict[str, dict] = {}
    while len(ms) < world:
        for k in keys:
            if k not in ms:
                m = read_json(store, k)
                if m is None:
                    break  # all must arrive: a poll reads only up to the first one missing
                ms[k] = m
        if len(ms) < world:
            if time.monotonic() > deadline:
                missing = [k for k in keys if k not in ms]
                raise TimeoutError(f"version {v}: rank manifests missing after {timeout:.0f} s: {missing[:4]}")
            time.sleep(poll)
    for k, m in ms.items():
        if m["version"] != v or m["base"] != base:
            raise RuntimeError(f"{k}: manifest is for version {m['version']} on base {m['base']}, "
                               f"expected {v} on {base} (ranks disagree)")
    digests: dict[str, int] = {}
    for r in range(world):
        sk = rank_sums(v, r)
        sums = read_json(store, sk)  # written before the rank's manifest
        if not isinstance(sums, dict) or sums.get("version") != v or not isinstance(sums.get("digests"), dict):
            raise RuntimeError(f"{sk}: missing or not version {v}'s digests of rank {r}")
        for name, d in sums["digests"].items():
            digests[name] = (digests.get(name, 0) + int(d, 16)) & digest.MASK
    rec = VersionRecord(version=v, base=base, world=world, ranks=keys, bytes=sum(m["bytes"] for m in ms.values()),
                        params=sum(m["params"] for m in ms.values()),
                        changed=sum(m["changed"] for m in ms.values()),
                        digests={k: digest.hexd(d) for k, d in sorted(digests.items())}, time=time.time())
    if not store.put_if_absent(version_record(v), dump(rec)):
        rec = read_json(store, version_record(v))
    return rec


def read_record(store, v: int) -> VersionRecord | None:
    r = read_json(store, version_record(v))
    return None if r is None else check("version", version_record(v), r)


def version_digests(store, v: int) -> dict[str, str] | None:
    """The per-tensor digests a holder of version v must match: its record's, or for version 0
    (and any version held from its keyframe) its keyframe record's; None if the store has neither."""
    rec = read_record(store, v) if v else None
    if rec is not None:
        return rec["digests"]
    kf = read_keyframe(store, v)
    return kf["digests"] if kf else None


def list_versions(store) -> list[int]:
    """Every version that has objects in the store (sealed or not)."""
    return sorted(v for v in map(keys.version_of, store.children(keys.VERSIONS)) if v is not None)


# ------------------------------------------------------------------ receivers and acks
def register(store, receiver: str, version: int, starting: bool = False) -> None:
    """A receiver announces itself and the version it holds (and refreshes it after each apply).
    starting: it cannot ack yet (Registration.starting)."""
    reg = Registration(receiver=receiver, version=version, time=time.time())
    if starting:
        reg["starting"] = True
    store.put(receiver_key(receiver), json.dumps(reg).encode())


class Heartbeat:
    """A receiver's registration kept fresh: beat() rewrites it once every `every_s`, applied
    or idle (gc keeps what a receiver seen within live_s holds: refreshed only after applies,
    an idle one lost its chain in the chaos soak). A write the store refuses is retried at the
    next beat, said once per run of failures: a missed heartbeat is no reason to stop serving."""

    def __init__(self, store, receiver: str, every_s: float, starting: bool = False):
        self.store, self.receiver, self.every_s, self.starting = store, receiver, every_s, starting
        self._at, self._failing = -float("inf"), False

    def beat(self, version: int) -> None:
        if time.monotonic() - self._at < self.every_s:
            return
        try:
            register(self.store, self.receiver, version, self.starting)
        except StoreError as exc:
            if not self._failing:
                print(f"nemo-dcr receiver: could not register {self.receiver!r} ({exc}); retrying",
                      file=sys.stderr, flush=True)
            self._failing = True
            return
        self._at, self._failing = time.monotonic(), False


def receivers(store, live_s: float | None = None) -> dict[str, Registration]:
    """Registered receivers (those seen within live_s seconds, if given)."""
    out = {}
    now = time.time()
    names = [f"{keys.RECEIVERS}/{n}" for n in store.children(keys.RECEIVERS) if n.endswith(".json")]
    for r in read_receiver_records(store, "registration", names):
        if r is not None and (live_s is None or now - r["time"] <= live_s):
            out[r["receiver"]] = r
    return out


def write_ack(store, v: int, receiver: str, base: int, ok: bool = True, error: str | None = None) -> None:
    store.put(ack_key(v, receiver), json.dumps(Ack(version=v, receiver=receiver, base=base, ok=ok, error=error,
                                                   time=time.time())).encode())


DIRECT_ACK_READS = 2  # at most this many acks still missing: read them by name, no listing
# Under a relay the committer reads the acks its long-poll names; it still lists them this
# often, for acks written around the relay (a receiver that failed over to the origin).
ACK_LIST_EVERY_S = 0.5
# On a polled store (S3, files) the committer looks for acks every CommitPolicy.poll for the
# first ACK_FAST_S after the seal or the last new ack (where a refit's acks come: its decision
# is not delayed), then its pause grows by ACK_POLL_SHARE of the time past that, up to
# ACK_POLL_MAX_S. A late ack is seen at most ~5% of its lateness (and 0.25 s) later: large
# refits whose acks come many seconds after the seal lose at most that; a registered receiver
# that died costs ~470 requests over a 60 s ack timeout instead of ~6,000.
ACK_FAST_S = 2.0
ACK_POLL_SHARE = 0.05
ACK_POLL_MAX_S = 0.25


def ack_pause(poll: float, quiet_s: float) -> float:
    """The committer's next pause on a polled store, `quiet_s` after the last new ack (or
    the seal)."""
    return min(poll + ACK_POLL_SHARE * max(0.0, quiet_s - ACK_FAST_S), max(poll, ACK_POLL_MAX_S))


def read_acks(store, v: int, seen: dict[str, Ack] | None = None, expected: list[str] | None = None) -> dict[str, Ack]:
    """The acks of v by receiver. `seen` (ack object name -> ack) caches what earlier calls
    read: acks are written once, so a poll lists and reads only the new ones. With the
    receivers `expected` and only a few of their acks missing, those are read by name: one
    round trip on the commit's path instead of a listing and then a read."""
    seen = {} if seen is None else seen
    if expected is not None:
        missing = [r for r in expected if f"{r}.json" not in seen]  # seen: by object name, as listed
        if len(missing) <= DIRECT_ACK_READS:
            for r, a in zip(missing, read_receiver_records(store, "ack", [ack_key(v, r) for r in missing]),
                            strict=True):
                if a is not None:
                    seen[f"{r}.json"] = a
            return {a["receiver"]: a for a in seen.values()}
    new = [n for n in store.children(keys.acks_dir(v)) if n not in seen]
    for name, a in zip(new, read_receiver_records(store, "ack", [f"{keys.acks_dir(v)}/{n}" for n in new]),
                       strict=True):
        if a is not None:
            seen[name] = a
    return {a["receiver"]: a for a in seen.values()}


# ------------------------------------------------------------------ the joint commit
class CommitTimeout(TimeoutError):
    pass


def decide(store, v: int, base: int, decision: str, acked: list[str], lagging: list[str], reason: str) -> Decision:
    """Write the decision for v with If-None-Match; returns the decision that stands (ours, or
    the one another writer got in first)."""
    d = Decision(version=v, base=base, decision=decision, acked=sorted(acked), lagging=sorted(lagging),
                 reason=reason, time=time.time())
    if store.put_if_absent(decision_key(v), json.dumps(d).encode()):
        return d
    return read_json(store, decision_key(v))


def read_decision(store, v: int) -> Decision | None:
    d = read_json(store, decision_key(v))
    return None if d is None else check("decision", decision_key(v), d)


def run_commit(store, rec: VersionRecord, policy: CommitPolicy, base_committed: bool = True,
               expected: list[str] | None = None, log: Callable[[str], None] | None = None,
               behind: Collection[str] = ()) -> Decision:
    """The committer's side of version rec['version'] (rank 0's publisher worker): collect acks
    per the policy, then decide. A version whose base was not committed is aborted at once.
    behind: receivers the previous decision marked lagging; under the quorum policy a version
    is not held for them (their acks count if they came in time)."""
    v, base = rec["version"], rec["base"]
    if not base_committed:
        return decide(store, v, base, "abort", [], [], f"base version {base} was not committed")
    if expected is None:  # (a receiver still starting cannot ack: a quorum of it aborted versions for minutes)
        expected = sorted(k for k, r in receivers(store, policy.live_s).items() if not r.get("starting"))
    t0 = time.monotonic()
    deadline = t0 + policy.timeout
    need = math.ceil(policy.quorum * len(expected))
    prompt = [k for k in expected if k not in behind]
    quorum_at: float | None = None
    seen: dict[str, Ack] = {}
    token, news, listed_at = 0, None, -1e9
    quiet_since = time.monotonic()
    while True:
        n_seen = len(seen)
        if news is not None and time.monotonic() - listed_at < ACK_LIST_EVERY_S:
            named = [k for k in news if k.startswith(f"{keys.acks_dir(v)}/") and k.rsplit("/", 1)[1] not in seen]
            for k, a in zip(named, read_receiver_records(store, "ack", named), strict=True):
                if a is not None:
                    seen[k.rsplit("/", 1)[1]] = a
        else:
            listed_at = time.monotonic()
            read_acks(store, v, seen, expected)
        acks = {a["receiver"]: a for a in seen.values() if a["receiver"] in expected}
        ok = [k for k, a in acks.items() if a["ok"] and a["base"] == base]
        refused = [k for k, a in acks.items() if not (a["ok"] and a["base"] == base)]
        if len(ok) == len(expected):
            return decide(store, v, base, "commit", ok, [], f"{len(ok)}/{len(expected)} receivers acked")
        if refused and policy.mode in ("wait", "abort"):
            why = "; ".join(f"{k}: {acks[k]['error'] or 'wrong base'}" for k in refused[:3])
            return decide(store, v, base, "abort", ok, refused, f"refused by {why}")
        answered = len(acks) == len(expected)
        now = time.monotonic()
        late = now > deadline
        if policy.mode == "quorum" and quorum_at is None and len(ok) >= need:
            quorum_at = now
            deadline = min(deadline, now + max(policy.grace, now - t0))
        if quorum_at is not None and all(k in acks for k in prompt):
            answered = True
        if policy.mode == "quorum" and (answered or late):
            lagging = [k for k in expected if k not in ok]
            if len(ok) >= need:
                return decide(store, v, base, "commit", ok, lagging,
                              f"quorum {len(ok)}/{len(expected)} (need {need})")
            return decide(store, v, base, "abort", ok, lagging, f"no quorum: {len(ok)}/{len(expected)} (need {need})")
        if late:
            missing = [k for k in expected if k not in acks]
            if policy.mode == "abort":
                return decide(store, v, base, "abort", ok, missing,
                              f"no ack from {missing[:4]} in {policy.timeout:.0f} s")
            raise CommitTimeout(f"version {v}: no ack from {missing[:4]} after {policy.timeout:.0f} s "
                                "(commit policy 'wait')")
        # a relay long-polls (acks written through it wake this at once, and its answer names
        # them: they are read without listing the acks); other stores sleep, longer the longer
        # no new ack came (ack_pause)
        now = time.monotonic()
        if len(seen) > n_seen:
            quiet_since = now
        left = max(policy.poll, deadline - now)
        token, news = wait_news(store, token, min(ack_pause(policy.poll, now - quiet_since), left),
                                max(policy.poll, min(1.0, left)))


def await_decision(store, v: int, timeout: float, poll: float = 0.01, token: int = 0,
                   max_poll: float | None = None) -> Decision:
    """Wait for the decision on v (non-committing ranks, receivers). token: the caller's last
    change token of this store (a relay's generation), if it has one: with 0 the first
    long-poll returned at once (anything is news after 0) and the decision was asked for
    twice before it could exist (2 of a receiver's ~30 requests per version). max_poll: on a
    store that is polled, the pause doubles from `poll` up to this (callers off the refit's
    path: each poll of S3 is a request, and a large job has a poller per rank)."""
    deadline = time.monotonic() + timeout
    first = poll
    while True:
        d = read_decision(store, v)
        if d is not None:
            return d
        left = deadline - time.monotonic()
        if left < 0:
            raise CommitTimeout(f"version {v}: no commit decision after {timeout:.0f} s")
        token = wait_change(store, token, poll, min(1.0, left), data_only=True)  # a decision is data
        if max_poll is not None:
            poll = backoff(poll, first, max_poll)


# ------------------------------------------------------------------ restarting a sender
def resume_point(store) -> tuple[int, int, list[int]]:
    """Where a restarting sender picks up: (last committed version, newest version number in
    the store, the versions after the last committed one that nobody decided: left behind by
    a sender that died mid-version). An undecided folder holding nothing but acks is no
    version (a receiver, or anyone with its token, acked a version nobody published): it is
    skipped with a warning, so it cannot push the next version number out of range."""
    versions = list_versions(store)
    last, dangling = 0, []
    for v in versions:
        d = read_decision(store, v)
        if d is not None and d["decision"] == "commit":
            last, dangling = v, [x for x in dangling if x > v]
        elif d is None:
            dangling.append(v)
    ghosts = [v for v in dangling if v > last and not any(not keys.is_ack(k) for k in store.list(vdir(v)))]
    if ghosts:
        print(f"nemo-dcr: ignoring version folders that hold only acks (no version was published there): "
              f"{ghosts[:4]}", file=sys.stderr, flush=True)
    versions = [v for v in versions if v not in ghosts]
    return last, max(versions, default=0), [v for v in dangling if v > last and v not in ghosts]


def abort_dangling(store, versions: list[int], reason: str = "the senders restarted", base: int = 0) -> None:
    """Decide abort for versions a dead sender left unfinished (their parts are never applied;
    gc removes them). Conditional writes: a decision already there stands. A version with no
    record (its senders died before the seal) is recorded on `base`, the last committed
    version (a decision's base is a version number like any other: readers refuse -1)."""
    for v in versions:
        rec = read_record(store, v)
        decide(store, v, rec["base"] if rec else base, "abort", [], [], reason)


# ------------------------------------------------------------------ keyframes and garbage
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
              torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytearray | bytes:
    """The safetensors file of `tensors`, written once into one buffer: safetensors' own save()
    builds the file and then copies it into bytes, twice the model at its peak (the trainer
    engine's keyframe 0 holds the baseline beside it)."""
    if any(t.dtype not in _ST_DTYPES for t in tensors.values()):
        return save({k: t.contiguous() for k, t in tensors.items()})
    header, off = {}, 0
    for k in sorted(tensors):
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # (the data starts 8-byte aligned, as safetensors writes it)
    buf = bytearray(8 + len(head) + off)
    buf[:8] = len(head).to_bytes(8, "little")
    buf[8:8 + len(head)] = head
    view = memoryview(buf)[8 + len(head):]
    for k, meta in header.items():
        a, b = meta["data_offsets"]
        if b > a:
            flat = tensors[k].detach().contiguous().reshape(-1).cpu()
            view[a:b] = flat.view(torch.uint8).numpy().data if flat.dtype != torch.uint8 else flat.numpy().data
    return buf


def write_keyframe(store, v: int, tensors: dict, config_json: str | None = None) -> None:
    """A full canonical checkpoint of version v (safetensors), its config and digests; the
    record goes last, so a keyframe with a record is complete."""
    store.put(keys.keyframe_model(v), safetensors_bytes(tensors))
    if config_json is not None:
        store.put(keys.keyframe_config(v), config_json.encode())
    store.put(keys.keyframe_record(v), json.dumps({"version": v, "digests": {
        k: digest.hexd(digest.sum64(t)) for k, t in sorted(tensors.items())}, "time": time.time()}).encode())


def keyframes(store) -> list[int]:
    """Complete keyframes (with a record); version 0 counts as committed by definition."""
    return sorted(int(c) for c in store.children(keys.KEYFRAMES) if keys.version_of(c) is not None
                  and store.exists(keys.keyframe_record(c)))


def read_keyframe(store, v: int) -> dict | None:
    return read_json(store, keys.keyframe_record(v))


def gc(store, live_s: float = 600.0, dry_run: bool = False) -> list[str]:
    """Delete what nobody needs: aborted versions (but the decision of the newest, while no
    later version committed); undecided versions older than the newest decision; committed
    versions at or below both the newest usable keyframe and the oldest version a live
    receiver holds; keyframes older than the newest usable one, and those of aborted or
    collected versions. Returns the deleted keys."""
    vs = list_versions(store)
    decisions = {v: read_decision(store, v) for v in vs}
    committed = [v for v in vs if decisions[v] and decisions[v]["decision"] == "commit"]
    kfs = [k for k in keyframes(store) if k == 0 or k in committed]
    newest_kf = max(kfs, default=0)
    held = [r["version"] for r in receivers(store, live_s).values()]
    floor = min([newest_kf, *held])
    newest_decided = max((v for v in vs if decisions[v]), default=-1)
    # A keyframe counts only while its version's decision says commit (rebuild.committed_keyframes),
    # so a kept keyframe's version folder stays with it. Collected at floor, it left the store
    # with no usable keyframe: a restarted trainer could not resume, a new receiver not start
    # (the soak found it), and the keyframes no longer counted piled up.
    doomed_versions = [v for v in vs if (decisions[v] and decisions[v]["decision"] == "abort")
                       or (decisions[v] is None and v < newest_decided)
                       or (v in committed and v <= floor and not (v in kfs and v >= newest_kf))]
    # The newest version's decision stays while no later version committed: it is what tells a
    # restarted trainer the next number (resume_point). Collected whole, an abort written on
    # the way out of a stopped job let the next job publish its own version 9 on the same
    # number (the chaos soak): receivers, and relays caching history forever, took the one
    # for the other.
    newest = max(vs, default=0)
    tombstone = newest if newest in doomed_versions and newest > max(committed, default=0) else None
    prefixes = [vdir(v) for v in doomed_versions if v != tombstone] + [keys.verify_dir(v) for v in doomed_versions]
    # keyframes older than the newest usable one, and those of versions aborted or collected
    # (a trainer writes a keyframe before its version is decided; those of aborted versions
    # were never deleted: the soak's store held one per trainer restart)
    prefixes += [keyframe_dir(kf) for kf in keyframes(store) if kf != 0 and (
        kf < newest_kf or kf not in decisions or (decisions[kf] or {}).get("decision") == "abort")]
    prefixes += [keyframe_dir(0)] if 0 < newest_kf else []
    spare = [k for k in store.list(vdir(tombstone)) if k != decision_key(tombstone)] if tombstone is not None else []
    if dry_run:
        return [k for p in prefixes for k in store.list(p)] + spare
    if spare:
        store.delete(spare)
    return [k for p in prefixes for k in store.delete_prefix(p)] + spare
