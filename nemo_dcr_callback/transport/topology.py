"""The relay tree from a config file: who is whose parent, and each node's failover chain.

    origin: s3://bucket/run?endpoint=http://10.0.0.1:8333   # where the senders write
    relays:                                                  # explicit, per region ...
      root:     {url: relay://10.0.0.1:8700, parent: origin}
      region-a: {url: relay://10.1.0.1:8700, parent: root}
      region-b: {url: relay://10.2.0.1:8700, parent: root}

or a k-ary tree over a list (relay i's parent is relay (i-1)//k, relay 0's is the origin):

    origin: s3://...
    kary: {fanout: 2, relays: {root: relay://..., a: relay://..., b: relay://...}}

A node's chain is its parent, grandparent, ..., origin: a relay uses it as its upstream and a
receiver attached to relay R uses R followed by R's chain, so either re-attaches one level up
when a relay dies (transport.relay_store.FailoverStore).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import yaml

from nemo_dcr_callback.protocol.store import StoreError
from nemo_dcr_callback.transport.relay_store import RelayStore

ORIGIN = "origin"


@dataclass
class Node:
    name: str
    url: str
    parent: str


class Topology:
    def __init__(self, origin: str, nodes: list[Node]):
        self.origin = origin
        self.nodes = {n.name: n for n in nodes}
        if len(self.nodes) != len(nodes):
            raise ValueError("relay names must be unique")
        for n in nodes:
            if n.parent != ORIGIN and n.parent not in self.nodes:
                raise ValueError(f"relay {n.name!r}: unknown parent {n.parent!r}")
            self.chain(n.name)  # raises on cycles

    @classmethod
    def from_dict(cls, d: dict) -> Topology:
        if "origin" not in d:
            raise ValueError("topology: 'origin' (the store the senders write) is required")
        if "kary" in d:
            k = int(d["kary"].get("fanout", 2))
            if k < 1:
                raise ValueError("topology: kary.fanout must be >= 1")
            items = list(d["kary"]["relays"].items())
            nodes = [Node(name, url, ORIGIN if i == 0 else items[(i - 1) // k][0])
                     for i, (name, url) in enumerate(items)]
        else:
            nodes = [Node(name, spec["url"], spec.get("parent", ORIGIN)) for name, spec in d.get("relays", {}).items()]
        return cls(d["origin"], nodes)

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        return cls.from_dict(yaml.safe_load(Path(path).read_text()))

    def chain(self, name: str) -> list[str]:
        """URLs above node `name`, nearest first, ending with the origin."""
        out, seen, cur = [], {name}, self.nodes[name].parent
        while cur != ORIGIN:
            if cur in seen:
                raise ValueError(f"topology: cycle through relay {cur!r}")
            seen.add(cur)
            out.append(self.nodes[cur].url)
            cur = self.nodes[cur].parent
        return out + [self.origin]

    def upstream(self, name: str) -> str:
        """The store URL a relay pulls from (its failover chain)."""
        return ",".join(self.chain(name))

    def attach(self, name: str) -> str:
        """The store URL for a receiver attached to relay `name`."""
        return ",".join([self.nodes[name].url, *self.chain(name)])

    def nearest(self, probes: int = 3) -> str:
        """The relay answering /health fastest from here (median of `probes`): receivers attach
        to it with `--attach auto`. Unreachable relays are skipped."""
        best: tuple[float, str] | None = None
        for name, node in self.nodes.items():
            rs = RelayStore(node.url, timeout=2.0)
            try:
                ts = []
                for _ in range(probes):
                    t0 = time.perf_counter()
                    rs.health()
                    ts.append(time.perf_counter() - t0)
            except StoreError:
                continue
            rtt = statistics.median(ts)
            if best is None or rtt < best[0]:
                best = (rtt, name)
        if best is None:
            raise ValueError("no relay in the topology answers")
        return best[1]

    def listen(self, name: str) -> tuple[str, int]:
        u = urlparse(self.nodes[name].url)
        return u.hostname, u.port

    def children(self, name: str) -> list[str]:
        return [n.name for n in self.nodes.values() if n.parent == name]

    def depth(self, name: str) -> int:
        return len(self.chain(name))
