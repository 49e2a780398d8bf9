"""A relay's store side: the objects it holds, how it fetches and verifies them from its
parent, the listings it keeps, and the news log its long-polls answer from."""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from pathlib import Path

import xxhash

from nemo_dcr_callback import codec
from nemo_dcr_callback.protocol import keys, records
from nemo_dcr_callback.safe_io import TooLarge


class Cache:
    """Immutable objects by key: memory up to a budget, then LRU spill to a directory."""

    def __init__(self, mem_bytes: int, spill_dir: str | None, spill_bytes: int):
        self.mem: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self.mem_bytes, self.used = mem_bytes, 0
        self.spill = Path(spill_dir) if spill_dir else None
        self.spilled: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self.spill_bytes, self.spill_used = spill_bytes, 0
        if self.spill:
            self.spill.mkdir(parents=True, exist_ok=True)

    def _file(self, key: str) -> Path:
        return self.spill / xxhash.xxh3_128_hexdigest(key.encode())

    def put(self, key: str, data: bytes, digest: str) -> None:
        if key in self.mem:
            return
        self.mem[key] = (data, digest)
        self.used += len(data)
        while self.used > self.mem_bytes and len(self.mem) > 1:
            k, (d, h) = self.mem.popitem(last=False)
            self.used -= len(d)
            if self.spill and len(d) <= self.spill_bytes:
                self._file(k).write_bytes(d)
                self.spilled[k] = (len(d), h)
                self.spill_used += len(d)
                while self.spill_used > self.spill_bytes:
                    old, (n, _) = self.spilled.popitem(last=False)
                    self._file(old).unlink(missing_ok=True)
                    self.spill_used -= n

    def drop(self, key: str) -> None:
        d = self.mem.pop(key, None)
        if d is not None:
            self.used -= len(d[0])
        if self.spill and self.spilled.pop(key, None) is not None:
            self._file(key).unlink(missing_ok=True)

    def get(self, key: str) -> tuple[bytes, str] | None:
        hit = self.mem.get(key)
        if hit is not None:
            self.mem.move_to_end(key)
            return hit
        if key in self.spilled:
            n, h = self.spilled[key]
            try:
                return self._file(key).read_bytes(), h
            except FileNotFoundError:
                self.spilled.pop(key)
        return None

    def __contains__(self, key: str) -> bool:
        return key in self.mem or key in self.spilled


class VerifyError(Exception):
    pass


class BadRecord(VerifyError):
    """A receiver's record in the parent that is not the record its key names (too large, not
    JSON, out of range): answered 422 with the reason, so readers skip it as a bad record
    (a 5xx made them take the relay for a failing store, and training stopped)."""


def verify_object(key: str, data: bytes, manifest_parts: dict[str, dict]) -> None:
    """Check an object before it is cached or forwarded; raise VerifyError naming the problem."""
    if keys.is_part(key):
        try:
            for c in codec.split_chunks(data):
                codec.parse_header(c)  # verifies the chunk checksum and header fields
        except codec.ChunkError as exc:
            raise VerifyError(f"{key}: {exc}") from None
        ref = manifest_parts.get(key)
        if ref is not None and (len(data) != ref["bytes"] or xxhash.xxh3_64_hexdigest(data) != ref["checksum"]):
            raise VerifyError(f"{key}: does not match its rank manifest")
    elif (own := keys.receiver_record(key)) is not None:
        bad = receiver_record_error(own, key, data)
        if bad:
            raise BadRecord(bad)
    elif key.endswith(".json"):
        try:
            records.parse(key, data)
        except records.RecordError as exc:
            raise VerifyError(str(exc)) from None


def receiver_record_error(own: tuple[str, str, int | None], key: str, data: bytes) -> str | None:
    """Why a registration or ack is refused (None: it is the record its key names)."""
    kind, receiver, version = own
    if len(data) > records.RECEIVER_RECORD_MAX:
        return f"{key}: {len(data)} bytes, more than a {kind} may have ({records.RECEIVER_RECORD_MAX})"
    try:
        obj = records.check(kind, key, records.parse(key, data))
    except records.RecordError as exc:
        return str(exc)
    if obj["receiver"] != receiver or (version is not None and obj["version"] != version):
        return f"{key}: the {kind} names receiver {obj['receiver']!r}, version {obj['version']}"
    return None


def name_in(op: str, prefix: str, key: str) -> str | None:
    """What a listing (op: list | children) of prefix shows for key, or None if not covered."""
    base = prefix.rstrip("/")
    if base and not key.startswith(base + "/"):
        return None
    return key if op == "list" else key[len(base) + 1 if base else 0:].split("/", 1)[0]


async def single_flight(inflight: dict, key, make):
    """Run make() once for concurrent askers of one key: the first runs it, the others await
    its result (or its exception)."""
    fut = inflight.get(key)
    if fut is not None:
        return await asyncio.shield(fut)
    fut = asyncio.get_running_loop().create_future()
    inflight[key] = fut
    try:
        res = await make()
        fut.set_result(res)
        return res
    except BaseException as exc:
        fut.set_exception(exc)
        fut.exception()  # retrieved: waiters re-raise it
        raise
    finally:
        inflight.pop(key, None)


class StoreSide:
    """The Relay's methods over what it holds and what its parent has (a mixin of Relay: the
    state they use is set up in Relay.__init__, node.py)."""

    # ------------------------------------------------------------ the news log
    def _bump(self, *changed: str) -> None:
        """Something new is here: the keys that changed (none: not known which)."""
        self.gen += 1
        for k in changed or (None,):
            if len(self.changes) == self.changes.maxlen:
                self._log_floor = self.changes[0][0]  # (dropped next: its generation is incomplete now)
            self.changes.append((self.gen, k))
        self._changed.set()
        self._changed = asyncio.Event()

    def _news(self, known: int, data_only: bool) -> bool:
        """Has anything changed since generation `known` (data_only: any immutable object:
        parts, manifests, records, decisions; not acks or registrations)?"""
        if self.gen <= known:
            return False
        if not data_only:
            return True
        for g, key in reversed(self.changes):
            if g <= known:
                return False
            if key is None or not keys.is_mutable(key):
                return True
        return known < self._log_floor  # the log does not reach back that far: say yes

    def changed_since(self, known: int, data_only: bool) -> list[str] | None:
        """The keys that appeared here after generation `known`, oldest first (data_only:
        immutable ones only); None when the log cannot say (it does not reach back that far,
        or a change was of unknown keys, or something disappeared): then list."""
        if known < self._log_floor:
            return None
        out = []
        for g, key in reversed(self.changes):
            if g <= known:
                break
            if key is None:
                return None
            if not (data_only and keys.is_mutable(key)):
                out.append(key)
        return out[::-1]

    # ------------------------------------------------------------ the parent
    async def _up(self, fn, *args):
        """fn(*args) on the upstream thread pool; calls to the parent are counted (and traced)."""
        name = getattr(fn, "__name__", "call")
        up = getattr(fn, "__self__", None) is self.parent
        if up:
            self.stats["upstream"][name] = self.stats["upstream"].get(name, 0) + 1
        if not (up and self._log):
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        t0, rec = time.perf_counter(), {"up": name, "arg": args[0] if args and isinstance(args[0], str) else
                                        (list(args[:1]) or None)}
        try:
            out = await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
            rec["result"] = "ok" if out is not False else "exists"  # (put_if_absent: another write stands)
            if isinstance(out, (bytes, list)):
                rec["n"] = len(out)  # bytes fetched, names listed
            return out
        except KeyError:
            rec["result"] = "missing"
            raise
        except BaseException as exc:
            rec["result"] = f"{type(exc).__name__}: {exc}"[:300]
            raise
        finally:
            self._trace({**rec, "ms": round(1e3 * (time.perf_counter() - t0), 3)})

    async def fetch(self, key: str) -> tuple[bytes, str] | None:
        """The verified object (bytes, xxh3), from the cache or fetched once; None if absent or
        not an object of the protocol (keys.kind: nothing else in the parent is served)."""
        if keys.kind(key) is None:
            return None
        hit = self.cache.get(key)
        if hit is not None:
            self.stats["hits"] += 1
            return hit
        if keys.is_mutable(key):
            p = self.passed.get(key)
            if p is not None and time.monotonic() - p[0] < self.cfg.passed_ttl_s:
                self.stats["hits"] += 1
                return p[1], p[2]
        else:
            w = self.writing.get(key)
            if w is not None:  # being written through: held in a moment (unless the write fails)
                await w.wait()
                hit = self.cache.get(key)
                if hit is not None:
                    return hit
            if self._known_absent(key):
                return None
            seen = self.missing.get(key)
            if seen is not None and time.monotonic() - seen < self.cfg.poll_s:
                return None
        return await single_flight(self.inflight, key, lambda: self._fetch_upstream(key))

    async def _fetch_upstream(self, key: str) -> tuple[bytes, str] | None:
        kind = keys.kind(key)
        try:
            data = await self._up(self.parent.get, key, self.cfg.max_bytes(kind))
        except KeyError:
            self.missing[key] = time.monotonic()
            return None
        except (TooLarge, records.RecordError) as exc:
            self.stats["rejected"] += 1
            if kind in ("registration", "ack"):
                raise BadRecord(str(exc)) from None  # (a receiver's record: a bad one, skipped by readers)
            raise
        except OSError:
            self.stats["upstream_errors"] += 1
            raise
        self.stats["bytes_in"] += len(data)
        self.stats["objects_in"] += 1
        if keys.is_part(key):
            self.stats["part_bytes_in"] += len(data)
        try:
            await self._up(verify_object, key, data, self.manifest_parts)
        except VerifyError:
            self.stats["rejected"] += 1
            raise
        h = xxhash.xxh3_64_hexdigest(data)
        self.missing.pop(key, None)
        if not keys.is_mutable(key):
            self._hold(key, data, h)
            if not self._announced(key):  # listed already: its waiters woke then (a GET joins this fetch)
                self._bump(key)
        return data, h

    # ------------------------------------------------------------ listings
    def _watched(self, k: tuple[str, str]) -> bool:
        """Listings the watcher keeps current (and wakes long-polls on): served as they are."""
        return (self.cfg.prefetch and time.monotonic() - self.watch_alive < 2.0
                and (k == ("children", keys.VERSIONS) or (k[0] == "list" and k[1] in self.watched_dirs)))

    async def listing(self, op: str, prefix: str, fresh: bool = False) -> list[str]:
        """The parent's list/children of prefix: what the watcher last saw for the versions it
        follows, else shared by every asker within poll_s (a child's poll never crosses the
        link above on its own). "versions" and "versions/" are one listing (every store lists
        them alike): asked both ways, they were two, and the one the watcher did not keep went
        up the tree to the origin every time (on S3, a receiver's list of versions)."""
        prefix = prefix.rstrip("/")
        k = (op, prefix)
        hit = self.lists.get(k)
        if hit is not None and not fresh and (time.monotonic() - hit[0] < self.cfg.poll_s or self._watched(k)):
            return hit[1]

        async def fetch_list() -> list[str]:
            t = time.monotonic()
            try:
                out = await self._up(getattr(self.parent, op), prefix)
            except BaseException:
                self.stats["upstream_errors"] += 1
                raise
            # keys written through this relay while the listing was on its way may be missing
            # from it (the parent listed first): keep them, or children would never see them
            late = {n for key, at in self.put_at.items() if at >= t and (n := name_in(op, prefix, key))}
            if late - set(out):
                out = sorted(set(out) | late)
            if hit is None or hit[1] != out:
                old = set(hit[1] if hit else ())
                diff = [n if op == "list" else f"{prefix}/{n}" if prefix else n for n in set(out) - old]
                if diff:
                    self._bump(*diff)
                    self.new_at = time.monotonic()
                if old - set(out):  # something went (a collected version): the news feed says "list"
                    self._bump()
                if not all(self._written_here(k) for k in diff) or old - set(out):
                    self._upstream_news = True
            self.lists[k] = (t, out)
            return out

        return await single_flight(self.list_inflight, k, fetch_list)

    def _written_here(self, key: str) -> bool:
        """Was key (or, for a folder, something in it) written through this relay?"""
        return key in self.put_at or any(k.startswith(key + "/") for k in self.put_at)

    def _watched_listing(self, key: str) -> list[str] | None:
        """The watcher's current listing of the version folder that holds key, if it keeps one."""
        d = key.rsplit("/", 2)[0] if key.count("/") >= 2 else ""
        for vd in (d, key.rsplit("/", 1)[0]):
            hit = self.lists.get(("list", vd))
            if hit is not None and self._watched(("list", vd)):
                return hit[1]
        return None

    def _known_absent(self, key: str) -> bool:
        """A record or decision of a watched version that the watcher's current listing does
        not have: receivers ask for those before they exist, and the answer needs no trip up.
        Not parts or manifests: nobody asks for one before seeing it listed here or named by a
        manifest, so a listing without it is older than the asker's news (a listing's answer
        can cross a shaped link behind queued part bytes and replace one the news had already
        extended). Those go to the parent; a receiver told "missing" refuses the version."""
        if not keys.is_record_or_decision(key):
            return False
        names = self._watched_listing(key)
        return names is not None and key not in names

    def _announced(self, key: str) -> bool:
        """Is the key in a listing the watcher keeps (whose change woke the long-polls)? Then
        holding it is no news: waiters saw it listed, and a GET waits for the fetch under way.
        Waking them again cost every receiver a wait and a listing per part."""
        names = self._watched_listing(key)
        return names is not None and key in names

    def _listed(self, key: str) -> None:
        """Add a key written through this relay to the cached listings that cover it (and note
        when, for listings still on their way from the parent)."""
        self.put_at[key] = time.monotonic()  # (Bounded: only the last seconds matter)
        self._add_listed(key)

    def _add_listed(self, key: str) -> None:
        """Add key to the cached listings that cover it."""
        for (op, prefix), (t, names) in list(self.lists.items()):
            name = name_in(op, prefix, key)
            if name and name not in names:
                self.lists[(op, prefix)] = (t, sorted([*names, name]))

    def _unlisted(self, key: str) -> None:
        """Take back a write announced before the parent had it (its write failed)."""
        self.passed.pop(key, None)
        self.put_at.pop(key, None)
        for (op, prefix), (t, names) in list(self.lists.items()):
            name = name_in(op, prefix, key)
            if name and name in names and op == "list":
                self.lists[(op, prefix)] = (t, [n for n in names if n != name])
        self._bump()  # something went: news feeds say "list"

    # ------------------------------------------------------------ holding objects
    def _hold(self, key: str, data: bytes, h: str) -> None:
        """Cache a verified immutable object and learn a manifest's parts (the caller wakes the
        long-polls if the key is news to them)."""
        self.missing.pop(key, None)
        self.cache.put(key, self._fault.at_rest(key, data), h)
        if keys.is_rank_manifest(key):
            for p in json.loads(data).get("parts", []):
                self.manifest_parts[p["key"]] = p

    def _passed(self, key: str, data: bytes) -> None:
        """Keep a mutable object just written through this relay (served for passed_ttl_s)."""
        self.passed[key] = (time.monotonic(), data, xxhash.xxh3_64_hexdigest(data))  # (Bounded)
