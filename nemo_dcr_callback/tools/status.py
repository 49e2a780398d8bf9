"""`nemo-dcr status`: what a store holds, for whoever runs the fleet.

The newest versions with their base, decision (or why none yet), size and acks; the
keyframes; the registered receivers with the version each holds and when it was last seen
(a receiver that fell behind, or stopped, shows here first); and what `nemo-dcr gc` would
delete. Read-only: it never writes to the store.
"""

from __future__ import annotations

import time
from typing import TypedDict

from nemo_dcr_callback.protocol import commit, keys


class VersionRow(TypedDict):
    version: int
    state: str  # "commit", "abort", "sealed" (waiting for acks), "open" (ranks still writing)
    base: int | None
    params: int | None
    changed: int | None
    bytes: int | None
    acks: int
    acked: list[str]
    lagging: list[str]
    reason: str
    age_s: float | None  # since its record (or decision) was written


class ReceiverRow(TypedDict):
    receiver: str
    version: int
    seen_s: float
    live: bool


def existing(store):
    """The store, if it is there: a file:// store that does not exist is an error for status
    and gc (a writer would create it; a reader or cleaner has the wrong path)."""
    root = getattr(store, "root", None)
    if root is not None and not root.is_dir():
        raise FileNotFoundError(f"no store at {store.url} (the directory does not exist)")
    return store


def collect(store, last: int = 10, live_s: float = 600.0) -> dict:
    """The store's state, newest `last` versions in full."""
    existing(store)
    now = time.time()
    vs = commit.list_versions(store)
    rows: list[VersionRow] = []
    for v in vs[-last:] if last else []:
        rec, dec = commit.read_record(store, v), commit.read_decision(store, v)
        acks = [n for n in store.children(keys.acks_dir(v)) if n.endswith(".json")]
        state = dec["decision"] if dec else ("sealed" if rec else "open")
        t = dec["time"] if dec else (rec["time"] if rec else None)
        rows.append(VersionRow(version=v, state=state, base=rec["base"] if rec else None,
                               params=rec["params"] if rec else None, changed=rec["changed"] if rec else None,
                               bytes=rec["bytes"] if rec else None, acks=len(acks),
                               acked=dec["acked"] if dec else [], lagging=dec["lagging"] if dec else [],
                               reason=dec["reason"] if dec else "", age_s=None if t is None else now - t))
    regs = commit.receivers(store)
    rx = [ReceiverRow(receiver=r["receiver"], version=r["version"], seen_s=now - r["time"],
                      live=now - r["time"] <= live_s) for r in sorted(regs.values(), key=lambda r: r["receiver"])]
    committed = [r["version"] for r in rows if r["state"] == "commit"]
    return {"url": store.url, "versions": len(vs), "first": vs[0] if vs else None, "newest": vs[-1] if vs else None,
            "newest_committed": max(committed) if committed else None, "keyframes": commit.keyframes(store),
            "rows": rows, "receivers": rx, "live_s": live_s,
            "gc": len(commit.gc(store, live_s=live_s, dry_run=True))}


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def render(st: dict) -> str:
    lines = [f"store {st['url']}: " + (
        f"{st['versions']} versions ({st['first']}..{st['newest']}), newest committed "
        f"{st['newest_committed'] if st['newest_committed'] is not None else 'none of those shown'}, "
        f"keyframes {st['keyframes'] or 'none'}" if st["versions"] else
        f"no versions yet; keyframes {st['keyframes'] or 'none'}")]
    if st["rows"]:
        lines.append(f"{'version':>8} {'base':>5} {'state':<7} {'changed':>8} {'bytes':>10} {'ratio':>7} "
                     f"{'acks':>5}  {'age':>7}  reason")
        for r in st["rows"]:
            rate = f"{r['changed'] / r['params']:.2%}" if r["params"] else "-"
            ratio = f"{2 * r['params'] / r['bytes']:.1f}x" if r["params"] and r["bytes"] else "-"
            why = r["reason"] + (f"; lagging {', '.join(r['lagging'][:4])}" if r["lagging"] else "")
            lines.append(f"{r['version']:>8} {r['base'] if r['base'] is not None else '-':>5} {r['state']:<7} "
                         f"{rate:>8} {_mb(r['bytes']):>10} {ratio:>7} {r['acks']:>5}  {_age(r['age_s']):>7}  {why}")
    live = sum(r["live"] for r in st["receivers"])
    lines.append(f"receivers: {len(st['receivers'])} registered, {live} seen within {st['live_s']:.0f} s")
    for r in st["receivers"]:
        behind = "" if st["newest_committed"] is None or r["version"] >= st["newest_committed"] else \
            f", {st['newest_committed'] - r['version']} behind"
        lines.append(f"  {r['receiver']:<24} holds {r['version']}{behind}, seen {_age(r['seen_s'])} ago"
                     + ("" if r["live"] else " (not live: gc does not keep its versions)"))
    lines.append(f"gc would delete {st['gc']} objects (nemo-dcr gc --store URL)")
    return "\n".join(lines)
