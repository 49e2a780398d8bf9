"""`nemo-dcr relay`: one node of the relay tree (docs/RELAY.md).

A relay serves the store's key space (the commit protocol's objects, docs/PROTOCOL.md) to
its children (relays below it, receivers in its region) over HTTP, and fetches each object
from its parent (the origin store, or the relay above it) once:

- Prefetch: a watcher lists the parent's newest versions every `poll_s` and pulls every new
  part, manifest, record and decision as soon as it appears, so parts flow down the tree
  while the senders are still writing later parts (the unit is one part, a few MB: nothing
  waits for a whole version).
- Dedupe: concurrent requests for one key share one upstream fetch; immutable objects are
  cached (memory, LRU, spilling to disk), so each byte crosses the link above a relay once
  whatever the number of children.
- Verify before forwarding: every chunk of a part is checked (codec checksums, and the part
  against its rank manifest when that is known), JSON must parse; an object that fails is
  counted, never cached and never served (the child gets 502 and re-attaches elsewhere).
- Writes (receiver registrations, acks) are passed up to the parent, so acks reach the
  joint commit at the origin; conditional writes keep their If-None-Match meaning.
- Senders may write through the root relay (store URL `relay://root,s3://...`): each object
  is verified, passed up to the origin, then held and announced at once, so it flows down
  the tree without waiting for the watcher to find it in the origin; a committer reading
  acks through the relay long-polls instead of polling the origin.
- The watcher lists the parent every `poll_s` while rounds find objects it did not hold
  already, and backs off (up to `idle_poll_s`) otherwise, and once nothing new has turned
  up for `dormant_after_s` only lists every `dormant_poll_s`, so an idle tree does not keep
  the origin busy. Writes through this relay are held and listed as they come: they are no
  reason to list the parent. While senders write through it, the parent is listed only every
  `write_through_poll_s`, for writes that went around the relay (a sender's failover): on
  SeaweedFS a listing costs the relay 1.5-5 ms of CPU (boto3) and the server about 1 ms.
- News: a long-poll with `keys=1` is answered with the keys new since the caller's
  generation (or null: list), so a child relay, a receiver or a committer below learns what
  to fetch without listing (Relay.changed_since).
- Peers authenticate with a shared token (Authorization: Bearer); TLS is optional.

The parent is any store (transport.store.open_store): a comma-separated list of URLs makes
a failover chain (parent, grandparent, ..., origin), which is how a relay re-attaches when
its parent dies.

The package: config.py (RelayConfig), node.py (Relay: state and lifecycle; serve), cache.py
(what a relay holds and fetches from its parent), watcher.py (the prefetcher), handlers.py
(HTTP), wire.py (what the client in transport.relay_store shares with the server). Importing
this package, or wire.py, does not import aiohttp: the server's names load when first used.
"""

from __future__ import annotations

from nemo_dcr_callback.transport.relay.config import RelayConfig
from nemo_dcr_callback.transport.relay.wire import CHECKSUM_HEADER

__all__ = ["CHECKSUM_HEADER", "Relay", "RelayConfig", "main", "serve"]

_SERVER = ("Relay", "serve", "main")  # in node.py, which imports aiohttp


def __getattr__(name: str):
    # loaded on first use: transport.relay_store imports wire.py, and so this package, and a
    # receiver using it must not pay for (or need) the aiohttp server
    if name in _SERVER:
        from nemo_dcr_callback.transport.relay import node  # start-up cost: aiohttp's server, see above

        return getattr(node, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
