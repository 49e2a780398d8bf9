"""Following a store: the receiver's side of the commit protocol (docs/PROTOCOL.md).

For the next version whose base is the version held, the follower streams its parts as the
senders upload them (decoding while later parts are still in flight: fetch.py), checks every
chunk's checksum, every part against its rank's manifest and every chunk against the target,
acks, waits for the joint commit, and only then applies; after applying it checks the
tensors' additive digests against the version record. Nothing from a version that fails any
check is applied; an aborted version is dropped. A receiver that is behind chains committed
deltas; one with nothing, or too far behind, starts from a keyframe (protocol/rebuild.py). Early apply
(opt-in: FollowerConfig.early) is described in fetch.py.
"""

from __future__ import annotations

import errno
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, replace

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.config import FETCH_LANES, FollowerConfig
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.keys import VERSIONS, is_part, version_of
from nemo_dcr_callback.protocol.store import StoreError, backoff, wait_news
from nemo_dcr_callback.receiver.fetch import HeldBits, Parts, fetch_part
from nemo_dcr_callback.receiver.journal import Journal
from nemo_dcr_callback.receiver.targets import StateDictTarget

__all__ = ["APPLY_MODES", "FETCH_LANES", "IDLE_AFTER_S", "Applied", "Follower", "FollowerConfig"]

# The receiver's apply modes by name (CLI and benchmarks) -> FollowerConfig.early.
APPLY_MODES: dict[str, bool | str] = {"late": False, "sealed": "sealed", "early": True}


@dataclass
class Applied:
    version: int
    base: int
    chunks: int
    changed: int
    bytes: int
    fetch_s: float  # from the first part seen to every chunk verified and decoded
    apply_s: float
    wait_s: float = 0.0  # ack -> decision
    digest_checked: bool = False
    unchecked: int = 0  # tensors this version changed that the target holds only in part (not digested)


# A follower of a store that cannot long-poll (S3, file://) that has seen nothing new for this
# long doubles its pause between polls, up to idle_poll_s: each poll of S3 is a LIST request.
IDLE_AFTER_S = 1.0


class Follower:
    """Applies versions, in chain order, to a target: canonical tensors (name -> tensor
    sharing storage with the model, e.g. a Hugging Face model's state_dict()) or a target
    object from receiver.targets (a model updated through its own loader, a checkpoint dir).

    `version` is the version the target holds (checked against the store's digests). With a
    receiver_id (FollowerConfig) the follower registers, acks versions and takes part in the
    joint commit; without one it only applies committed versions."""

    def __init__(self, store, target, version: int = 0, *, config: FollowerConfig | None = None, **options):
        cfg = self.config = replace(config or FollowerConfig(), **options)
        self.store = store
        self.target = StateDictTarget(target) if isinstance(target, dict) else target
        self.tensors = target if isinstance(target, dict) else None
        self.version = version
        self.receiver_id = cfg.receiver_id
        self.decision_timeout = cfg.decision_timeout
        self.poll_s = cfg.poll_s
        self.idle_poll_s = max(cfg.idle_poll_s, cfg.poll_s)
        self._parts: dict[int, Parts] = {}
        self._held_bits = HeldBits(self.target)  # the bits held, for context-coded chunks
        self.refused: dict[int, int] = {}  # version -> refusals (bad chunks, wrong base)
        # versions this follower can never apply (aborted, or on a base older than the one held):
        # each poll looked at every one again, two requests apiece. Under an abort storm hundreds
        # lay between the version held and the next one on it, a poll took longer than the ack
        # timeout, that version aborted too, and the storm fed itself (the chaos soak).
        self._passed: set[int] = set()
        # called with (version, error) at each refusal, also the ones acked and gone on from
        self.on_refuse: Callable[[int, BaseException], None] | None = None
        self.max_refusals = 3
        self._token = 0  # the store's change token (relays long-poll, see protocol.store.wait_news)
        # what a relay's long-poll answer named as new since the last one (None: not known) and
        # the last listing of the version streaming: together they are its listing now
        self._news: list[str] | None = None
        self._listed: tuple[int, list[str]] | None = None
        self.digests: dict[str, int] | None = None
        self.journal = None
        if cfg.journal is not None:  # weights that outlive this follower: complete a torn apply first
            if not hasattr(self.target, "flat"):
                raise ValueError("a journal needs a target with flat tensors (a state dict)")
            self.journal = Journal(cfg.journal)
            replayed = self.journal.replay(self.target.flat)
            held = self.journal.held()
            if held is not None:
                self.version = held
            if replayed is not None:
                print(f"nemo-dcr receiver: completed the interrupted apply of version {replayed} from the journal",
                      file=sys.stderr, flush=True)
        # names the target cannot digest (a loader that keeps only part of a tensor) go unchecked
        self.unchecked: set[str] = set()
        if cfg.check_digests and hasattr(self.target, "digest_of"):  # a model behind its loader
            held = {n: self.target.digest_of(n) for n in self.target.names()}
            self.unchecked = {n for n, d in held.items() if d is None}
            self.digests = {n: d for n, d in held.items() if d is not None}
            self._check_held()
        elif cfg.check_digests and hasattr(self.target, "flat"):
            self.digests = {n: digest.sum64(self.target.flat(n)) for n in self.target.names()}
            self._check_held()
        # early apply needs in-place tensors with an exact undo and the digest check before the
        # ack; journaled weights, loaders and checkpoint directories apply after the decision
        self.early = bool(cfg.early) and self.journal is None and self.digests is not None and isinstance(
            self.target, StateDictTarget)
        self.early_sealed_only = cfg.early == "sealed"
        self.fetch_lanes = cfg.fetch_lanes
        self._heart = commit.Heartbeat(store, self.receiver_id, cfg.register_every_s) if self.receiver_id else None
        self.heartbeat()

    def heartbeat(self) -> None:
        """The registration refreshed when due (commit.Heartbeat: every poll and apply)."""
        if self._heart is not None:
            self._heart.beat(self.version)

    # ------------------------------------------------------------ checks
    def _check_held(self) -> None:
        """The target must hold exactly the bits of the version it claims (wrong model or
        wrong baseline are refused here, before anything is applied)."""
        ref = commit.version_digests(self.store, self.version)
        if ref is None or self.digests is None:
            return
        missing = sorted(set(ref) - set(self.digests) - self.unchecked)
        if missing:
            raise codec.ChunkError(f"receiver has no tensor {missing[0]!r} of version {self.version} (wrong model?)")
        bad = [n for n, d in ref.items() if n in self.digests and int(d, 16) != self.digests[n]]
        if bad:
            raise codec.ChunkError(f"receiver does not hold version {self.version}: tensor {bad[0]!r} differs "
                                   f"({len(bad)} tensors; wrong baseline or wrong model)")

    # ------------------------------------------------------------ fetching
    def _fetch_one(self, key: str):
        """One part fetched, verified against the target and decoded (fetch.fetch_part)."""
        return fetch_part(self.store, key, self.target.check, lambda h: self._held_bits(h, self.version))

    def _fetch_parts(self, v: int, keys: list[str]) -> None:
        """Every part of `keys` held: waits for the ones fetching in the background, fetches
        the rest (concurrently where the store can)."""
        st = self._parts.setdefault(v, Parts(self.fetch_lanes))
        st.harvest()
        pool = getattr(self.store, "executor", None)
        new = [k for k in keys if k not in st.parts and k not in st.pending]
        if new and st.t0 is None:
            st.t0 = time.perf_counter()
        if pool is not None:  # queue the ones not yet under way, then wait for each in turn
            st.fetch(new, pool(), self._fetch_one)
            # (a failed fetch is fetched again below, where its error is raised)
            while futs := st.in_flight(keys):
                futures_wait(futs, return_when=FIRST_COMPLETED)
                self._apply_early(v, sealed=True)  # the version is sealed: apply what is here meanwhile
                st.harvest()
        st.harvest()
        for key in [k for k in keys if k not in st.parts]:  # no pool, or a background fetch failed
            _, n, h, dec = self._fetch_one(key)
            st.parts[key] = (n, h, dec)

    def prefetch(self, v: int, listing: list[str] | None = None) -> None:
        """Start fetching the parts of v that exist now (the senders may still be writing it)
        and return: where the store has a thread pool the fetches run there, so the next part's
        download is already under way while this thread lists again (the link never idles
        between parts). Results are kept only once they are verified and decoded."""
        st = self._parts.setdefault(v, Parts(self.fetch_lanes))
        st.harvest()
        listing = self.store.list(commit.vdir(v)) if listing is None else listing
        keys = [k for k in listing if is_part(k) and k not in st.parts and k not in st.pending]
        if not keys:
            return
        if getattr(self.store, "executor", None) is None:  # a local store: fetch here
            self._fetch_parts(v, keys)
            return
        if st.t0 is None:
            st.t0 = time.perf_counter()
        st.fetch(keys, self.store.executor(), self._fetch_one)

    def stage(self, v: int, rec: commit.VersionRecord) -> list[codec.DecodedChunk]:
        """Every chunk of sealed version v, verified against the manifests, decoded."""
        if rec["base"] != self.version:
            raise codec.ChunkError(f"version {v} builds on {rec['base']}, this receiver holds {self.version}")
        refs = []
        for key in rec["ranks"]:
            m = commit.read_json(self.store, key)
            if m is None:
                raise codec.ChunkError(f"{key}: manifest missing")
            if m["version"] != v or m["base"] != rec["base"]:
                raise codec.ChunkError(f"{key}: manifest is for version {m['version']} on {m['base']}, not {v}")
            refs += m["parts"]
        self._fetch_parts(v, [p["key"] for p in refs])
        st = self._parts[v] if refs else Parts()
        out = []
        for p in refs:
            n, h, dec = st.parts[p["key"]]
            if n != p["bytes"] or h != p["checksum"] or len(dec) != p["chunks"]:
                self._drop(v)  # undone, refetched next time
                raise codec.ChunkError(f"{p['key']}: {n} bytes / checksum {h} do not match the manifest "
                                       f"({p['bytes']} bytes / {p['checksum']}): corrupt or truncated")
            out += dec
        stray = set(st.parts) - {p["key"] for p in refs}  # listed, but in no manifest: not the version's
        if stray & st.applied:
            st.rollback(self.target)  # applied early: take everything back (the version's parts go on again)
        for k in stray:
            del st.parts[k]
        return out

    # ------------------------------------------------------------ early apply
    def _apply_early(self, v: int, sealed: bool = False) -> bool:
        """Apply, in place, the parts of v fetched and verified so far. While v streams it must
        follow the version held and not have been refused; sealed: its record's base is the
        version held (checked by stage). Returns whether the parts were applied."""
        st = self._parts.get(v)
        if not self.early or st is None or not (sealed or (v == self.version + 1 and v not in self.refused
                                                           and not self.early_sealed_only)):
            return False
        st.apply_held(self.target)
        return True

    def _drop(self, v: int) -> None:
        """Forget version v's parts (refetched if needed again), undoing any applied early."""
        st = self._parts.pop(v, None)
        if st is not None:
            st.cancel()
            if st.undo:
                st.rollback(self.target)

    # ------------------------------------------------------------ applying
    def _terms(self, decoded: list[codec.DecodedChunk]) -> dict[str, int]:
        """Per tensor, the digest terms of the elements the chunks touch, read from the target."""
        out: dict[str, int] = {}
        for d in decoded:
            n = d.header.name
            out[n] = (out.get(n, 0) + digest.sum64_at(self.target.flat(n), d.positions)) & digest.MASK
        return out

    def apply_version(self, v: int, rec: commit.VersionRecord | None = None, wait_decision: bool = True) -> Applied:
        rec = rec or commit.read_record(self.store, v)
        if rec is None:
            raise KeyError(f"version {v} is not sealed")
        t0 = time.perf_counter()
        pending_digests = None
        try:
            decoded = self.stage(v, rec)
            if v in self._parts and self._apply_early(v, sealed=True):  # the rest, then the digests, then the ack
                pending_digests = self._check_digests(v, rec, self._parts[v].terms, keep=False)
        except codec.ChunkError as exc:
            self._drop(v)
            if self.receiver_id:
                commit.write_ack(self.store, v, self.receiver_id, self.version, ok=False, error=str(exc))
            raise
        t_staged = time.perf_counter()
        fetch_s = t_staged - (self._parts[v].t0 if v in self._parts and self._parts[v].t0 else t0)
        wait_s = 0.0
        if self.receiver_id:
            commit.write_ack(self.store, v, self.receiver_id, self.version)
        if wait_decision:
            try:
                d = commit.await_decision(self.store, v, self.decision_timeout, self.poll_s, self._token)
            except BaseException:  # no decision (timeout, store down): back on the version held
                if v in self._parts and self._parts[v].undo:
                    self._parts[v].rollback(self.target)  # the verified parts stay: a retry applies them again
                raise
            wait_s = time.perf_counter() - t_staged
            if d["decision"] != "commit":
                self._drop(v)
                raise _Aborted(v, d["reason"])
        t1 = time.perf_counter()
        checked = False
        if pending_digests is not None:  # applied and checked already
            self.digests = pending_digests
            checked = bool(rec["digests"])
        elif self.journal is not None:  # redo records first, then an idempotent overwrite
            recs = self.journal.records(self.target.flat, decoded)
            self.journal.begin(v, recs)
            terms = self.journal.apply(self.target.flat, recs)
            if self.digests is not None:
                checked = self._check_digests(v, rec, terms)
            self.journal.done(v)
        elif self.digests is not None and hasattr(self.target, "apply_with_terms"):
            # one pass: apply and read back (a target that journals also takes the version)
            terms = (self.target.apply_with_terms(decoded, version=v) if hasattr(self.target, "version")
                     else self.target.apply_with_terms(decoded))
            checked = self._check_digests(v, rec, terms)
        else:
            old = self._terms(decoded) if self.digests is not None else None
            if hasattr(self.target, "version"):  # targets that journal (checkpoint directories)
                self.target.apply(decoded, version=v)
            else:
                self.target.apply(decoded)
            if old is not None:
                new = self._terms(decoded)
                checked = self._check_digests(v, rec, {n: (old[n], new[n]) for n in old})
        self.version = v
        self._held_bits.forget()
        self._parts.pop(v, None)
        self.heartbeat()
        return Applied(v, rec["base"], len(decoded), sum(d.header.count for d in decoded),
                       rec["bytes"], fetch_s, time.perf_counter() - t1, wait_s, checked,
                       len({d.header.name for d in decoded} & self.unchecked))

    def _check_digests(self, v, rec, terms: dict[str, tuple[int, int]], keep: bool = True):
        """The digests after applying (terms: per tensor, before and after) against the record's;
        keep: take them as the digests held and return whether any were checked, else return them."""
        dg = dict(self.digests)
        for n, (before, after) in terms.items():
            dg[n] = (dg[n] - before + after) & digest.MASK
        bad = [n for n, x in rec["digests"].items() if n in dg and int(x, 16) != dg[n]]
        if bad:
            raise codec.ChunkError(f"version {v}: after applying, tensor {bad[0]!r} does not match the version's "
                                   f"digest ({len(bad)} tensors): the receiver did not hold version {rec['base']}")
        if not keep:
            return dg
        self.digests = dg
        return bool(rec["digests"])

    def _listing_with(self, v: int, news: list[str] | None) -> list[str] | None:
        """v's listing from its last one and a relay's news since, if the news is only of v:
        the poll then costs no request (5-6 listings per version and receiver before)."""
        if news is None or self._listed is None or self._listed[0] != v:
            return None
        d = commit.vdir(v) + "/"
        if any(not k.startswith(d) for k in news):
            return None
        return sorted({*self._listed[1], *news}) if news else self._listed[1]

    def _names_newer(self, news: list[str]) -> bool:
        """Does the news name anything of a version after the one held (or outside them)?"""
        for k in news:
            path = k.split("/")
            v = version_of(path[1]) if len(path) >= 2 and path[0] == VERSIONS else None
            if v is None or v > self.version:
                return True
        return False

    def poll(self, on_apply: Callable[[Applied], None] | None = None, until: int | None = None) -> list[Applied]:
        """Apply every version that follows the one held, in order (streaming the newest one
        while it is written), up to `until` if given; on_apply runs right after each."""
        out: list[Applied] = []
        # what a relay's long-poll named as new since the last poll (None: not known); it is
        # this poll's news, so after an apply in the loop below nothing is news any more
        told, self._news = self._news, None
        news = told
        self.heartbeat()
        while True:
            if until is not None and self.version >= until:
                return out
            nxt = self.version + 1
            listings: dict[int, list[str]] = {}
            if self._poll_streaming(nxt, told, news, listings):
                return out
            if nxt in self._parts:
                known = [nxt]
            elif told is not None and not self._names_newer(told):
                # the relay named everything new up to this poll and none of it is after the
                # version held (now: also after an apply here); anything since is the next wait's
                # news. Listing the versions after each apply cost a request per version.
                known = []
            else:
                known = commit.list_versions(self.store)
            news = None
            if len(self._passed) > 64 or len(self.refused) > 64:  # (versions behind the one held are done with)
                self._passed = {v for v in self._passed if v > self.version}
                self.refused = {v: n for v, n in self.refused.items() if v > self.version}
            streamed = False
            for v in [v for v in known if v > self.version and v not in self._passed]:
                # One listing says whether v has a decision and a record (read only if so) and
                # which parts are there: a version that just appeared costs one round trip
                # before its first part is under way, not three.
                listing = listings[v] if v in listings else self.store.list(commit.vdir(v))
                got = self._poll_version(v, listing, streamed)
                streamed = streamed or got == "streamed"
                if isinstance(got, Applied):
                    out.append(got)
                    if on_apply:
                        on_apply(got)
                    break
            else:
                return out

    def _poll_streaming(self, nxt: int, told: list[str] | None, news: list[str] | None,
                        listings: dict[int, list[str]]) -> bool:
        """While the next version streams, one listing of its folder is the whole poll: it
        shows new parts, and its record or decision once written (then read by the caller).
        Listing every version, or asking for the record and decision each time, costs requests
        that a busy store answers slowly and delays seeing the next part. True: the poll is
        done (the version is still being written)."""
        if nxt not in self._parts or nxt in self.refused:
            return False
        if told is None and self._parts[nxt].queued:
            # parts known and waiting for a lane: a listing could only add more to wait for,
            # and each one crosses the link the parts need (its answer grows with the parts
            # listed). List again once the queue runs dry.
            self._parts[nxt].harvest()
            self._apply_early(nxt)
            return True
        listing = listings[nxt] = self._listing_with(nxt, news) or self.store.list(commit.vdir(nxt))
        self._listed = (nxt, listing)
        if not listing:
            # its folder is gone: aborted and collected before this receiver saw the decision
            # (it was stopped or cut off meanwhile); waiting on it was for ever
            self._drop(nxt)
            self._listed = None
            listings.pop(nxt)
        elif commit.version_record(nxt) not in listing and commit.decision_key(nxt) not in listing:
            self.prefetch(nxt, listing)
            self._apply_early(nxt)
            return True
        return False

    def _poll_version(self, v: int, listing: list[str], streamed: bool) -> Applied | str:
        """One version after the one held, from its listing: applied (an Applied), "streamed"
        (still being written: its parts fetched as they come, for the first such version
        only), or "skip" (aborted, refused, not on the version held)."""
        d = commit.read_decision(self.store, v) if commit.decision_key(v) in listing else None
        if d is not None and d["decision"] != "commit":
            self._drop(v)
            self._passed.add(v)
            return "skip"
        if v in self.refused and d is None:
            return "skip"  # refused (acked as such): wait for the decision before trying again
        rec = commit.read_record(self.store, v) if commit.version_record(v) in listing else None
        if rec is None:
            if d is None and not streamed:
                self._listed = (v, listing)  # the next poll adds the news to it: no listing
                self.prefetch(v, listing)  # still being written: stream what is there
                self._apply_early(v)
                return "streamed"
            return "skip"
        if rec["base"] != self.version:
            self._drop(v)  # not on the version held (anything applied early is undone)
            if rec["base"] < self.version:
                self._passed.add(v)
            return "skip"
        try:
            return self.apply_version(v, rec)
        except _Aborted:
            return "skip"
        except codec.ChunkError as exc:
            # A receiver in the commit refuses the version (its ack says why) and goes on: an
            # abort drops it; if it commits anyway (quorum), it is fetched afresh, a few times
            # at most (the damage may have been on the way here).
            self._drop(v)
            self.refused[v] = self.refused.get(v, 0) + 1
            if self.on_refuse is not None:
                self.on_refuse(v, exc)
            if not self.receiver_id or self.refused[v] > self.max_refusals:
                raise
            return "skip"

    def follow(self, until: int | None = None, timeout: float = 600.0, poll_s: float | None = None,
               on_apply: Callable[[Applied], None] | None = None) -> None:
        """Keep applying versions as they are committed, until version `until` (or timeout)."""
        poll_s = self.poll_s if poll_s is None else poll_s
        deadline = time.monotonic() + timeout
        warned = False
        pause, last_new = poll_s, time.monotonic()
        while until is None or self.version < until:
            try:
                applied = self.poll(on_apply, until)
                warned = False
                if applied:
                    deadline = time.monotonic() + timeout
                if until is not None and self.version >= until:
                    return
                now = time.monotonic()
                left = deadline - now
                if left < 0:
                    raise TimeoutError(f"no new version after {timeout:.0f} s (holding {self.version})")
                if applied or self._parts:  # a version applied or streaming: poll at once
                    pause, last_new = poll_s, now
                elif now - last_new > IDLE_AFTER_S:  # idle: back off (only where the store is polled)
                    pause = backoff(pause, poll_s, self.idle_poll_s)
                # a relay's answer names what is new (usually the whole poll)
                self._token, self._news = wait_news(self.store, self._token, pause, min(1.0, left), data_only=True)
            except OSError as exc:  # the store failing (a relay restarting), or a full disk: retried until the deadline
                full = exc.errno in (errno.ENOSPC, errno.EDQUOT)  # (the version held stays, whole)
                if not (full or isinstance(exc, StoreError)) or time.monotonic() > deadline:
                    raise
                if not warned:
                    print(f"nemo-dcr receiver: {'the disk is full' if full else 'store unavailable'} ({exc}); "
                          f"holding version {self.version}, retrying", file=sys.stderr, flush=True)
                warned, self._news = True, None
                time.sleep(1.0 if full else min(1.0, 10 * poll_s))
            if self._news is None:  # a gap in the news: later news does not bring the listing kept
                self._listed = None  # from before it up to date (docs/RELAY.md, long-poll)


class _Aborted(Exception):
    def __init__(self, v: int, reason: str):
        super().__init__(f"version {v} aborted: {reason}")
