"""Store wrappers that record the requests made of a real store (behaviour unchanged), and
races of threads against one."""

from __future__ import annotations

import threading
import time

from nemo_dcr_callback.transport.store import FileStore


def race(fn, n: int) -> list:
    """Call fn(i) for i in range(n) from n threads started together; the results, in finishing order."""
    out: list = []
    ths = [threading.Thread(target=lambda i=i: out.append(fn(i))) for i in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return out


class TimedListings:
    """A real store whose `children` listings (a follower's or a relay's poll of it) are
    timed in .at; everything else passes through."""

    def __init__(self, store):
        self.store, self.at = store, []

    def children(self, prefix):
        self.at.append(time.monotonic())
        return self.store.children(prefix)

    def __getattr__(self, name):
        return getattr(self.store, name)


class CountingStore(FileStore):
    """A file store that records the requests made of it in .calls, (method, key or prefix)."""

    def __init__(self, root):
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []

    def get(self, key, limit=None):
        self.calls.append(("get", key))
        return super().get(key, limit=limit)

    def list(self, prefix):
        self.calls.append(("list", prefix))
        return super().list(prefix)

    def children(self, prefix):
        self.calls.append(("children", prefix))
        return super().children(prefix)
