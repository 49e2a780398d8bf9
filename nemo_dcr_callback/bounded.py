"""In-memory tables with a stated size limit (docs/SECURITY.md: bounded caches).

A relay and a receiver keep tables keyed by what peers ask for (keys looked up, listings,
records passed through). A peer holding only the receivers' token grew a relay's tables by
160 MB with 40k requests of made-up keys, and nothing was ever released. Every such table is
a `Bounded`: at most `cap` entries, the least recently set (or touched) going first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Bounded(OrderedDict[K, V]):
    """A dict of at most `cap` entries; setting an entry makes it the newest, and the oldest
    go once there are more than `cap` (touch() makes a read count as use)."""

    def __init__(self, cap: int):
        if cap < 1:
            raise ValueError(f"a bounded table needs room for one entry at least (cap {cap})")
        super().__init__()
        self.cap = cap

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.cap:
            self.popitem(last=False)

    def touch(self, key: K) -> None:
        if key in self:
            self.move_to_end(key)
