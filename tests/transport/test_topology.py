"""A relay tree's topology (transport/topology.py): the failover chains it gives each relay
and receiver, k-ary trees, and refused definitions (unknown parents, cycles)."""

from __future__ import annotations

import pytest

from nemo_dcr_callback.transport.topology import Topology


def test_topology_chains_and_validation(tmp_path):
    t = Topology.from_dict({"origin": "s3://b/run", "relays": {
        "root": {"url": "relay://10.0.0.1:8700"},
        "a": {"url": "relay://10.1.0.1:8700", "parent": "root"},
        "a2": {"url": "relay://10.1.0.2:8700", "parent": "a"}}})
    assert t.upstream("a2") == "relay://10.1.0.1:8700,relay://10.0.0.1:8700,s3://b/run"
    assert t.attach("a") == "relay://10.1.0.1:8700,relay://10.0.0.1:8700,s3://b/run"
    assert t.listen("a2") == ("10.1.0.2", 8700) and t.children("root") == ["a"]
    k = Topology.from_dict({"origin": "file:///o", "kary": {"fanout": 2, "relays": {
        n: f"relay://h{i}:1" for i, n in enumerate(["r", "x", "y", "z", "w"])}}})
    assert [k.nodes[n].parent for n in "rxyzw"] == ["origin", "r", "r", "x", "x"]
    with pytest.raises(ValueError, match="unknown parent"):
        Topology.from_dict({"origin": "o", "relays": {"a": {"url": "relay://h:1", "parent": "nope"}}})
    with pytest.raises(ValueError, match="cycle"):
        Topology.from_dict({"origin": "o", "relays": {"a": {"url": "relay://h:1", "parent": "b"},
                                                      "b": {"url": "relay://h:2", "parent": "a"}}})
