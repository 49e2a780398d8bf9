"""The store interface: what sender, receiver and tools ask of an object store.

The implementations live in transport/ (file://, s3://, relay://); this module is what both
sides of the protocol share with them: the errors a store raises, the create-only write of a
history object (protocol.keys.is_history), and how a poller waits for news. A store object has `url`, `put(key, data,
durable=True)`, `put_if_absent`, `get` (KeyError if absent), `exists`, `list`, `children`,
`delete`, `delete_prefix`; optionally `executor()` (a thread pool for concurrent requests),
`get_pieces` (a streamed get), and, on a relay, `long_polls`, `wait` and `wait_keys`.

Secrets never leave in a printed URL: `redact` masks the user info (user:password@) wherever
a URL is shown or raised.
"""

from __future__ import annotations

import re
import time

_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"?#]*@")


def redact(text: str) -> str:
    """text with the user info of every URL in it replaced by ***."""
    return _USERINFO.sub(r"\1***@", text)


class StoreError(OSError):
    """The store cannot be reached or refused an operation."""


class ImmutableError(StoreError):
    """A history object (protocol.keys.is_history) exists with other bytes: history is
    create-only on every backend, so it is not replaced."""


def put_once(store, key: str, data: bytes, **kw) -> None:
    """Create a history object; the same bytes again (a retry) stand, others are refused."""
    if store.put_if_absent(key, data, **kw):
        return
    try:
        same = store.get(key, limit=len(data)) == data
    except KeyError:  # deleted since (gc): write it again
        return put_once(store, key, data, **kw)
    except ValueError:  # larger than ours (safe_io.TooLarge, refused unread): other bytes
        same = False
    if not same:
        raise ImmutableError(f"{key} is history and immutable in {redact(store.url)}: it exists with "
                             f"other bytes, not replaced")


def long_polls(store) -> bool:
    """Can the store answer a long-poll now: a relay, or a failover chain currently on one (a
    chain that fell back to S3 is polled, and backs off like S3)."""
    return bool(getattr(store, "long_polls", False))


def backoff(pause: float, lo: float, hi: float) -> float:
    """The next pause of a poller whose last poll found nothing new: doubled, never below lo,
    at most hi (or lo, if hi is below it). Receivers, relays and ranks waiting for a decision
    back off alike on a store that cannot long-poll."""
    return min(max(2 * pause, lo), max(hi, lo))


def wait_change(store, token: int, poll: float, limit: float = 1.0, data_only: bool = False) -> int:
    """Pause until the store may have changed. A relay long-polls (returns as soon as it has
    something new, so a fleet of receivers does not busy-poll it; data_only: only a new part,
    manifest, record or decision counts, not acks or registrations); other stores sleep `poll`.
    Pass back the returned token next time (start with 0)."""
    if not long_polls(store):
        time.sleep(poll)
        return token
    return store.wait(token, limit, data_only)


def wait_news(store, token: int, poll: float, limit: float = 1.0,
              data_only: bool = False) -> tuple[int, list[str] | None]:
    """wait_change(), also returning the keys new since `token` where the store can name them
    (a relay's news feed); None where it cannot: then list."""
    if not long_polls(store):
        return wait_change(store, token, poll, limit, data_only), None
    return store.wait_keys(token, limit, data_only)
