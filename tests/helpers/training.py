"""What training tests read back: the lines the callback's `verify` option prints, and the
store's version records. Bit-exactness alone would pass with frozen weights (a version that
changes nothing is trivially bit-exact), so training tests also check that every version
changed some elements."""

from __future__ import annotations

import re

from nemo_dcr_callback.protocol import commit

# sender/callback.py, DCRCallback._verify
VERIFIED = re.compile(r"dcr: version (\d+): the store's chain is bit-exact with the dense export "
                      r"\((\d+) tensors, (\d+) changed;")


def verified(output: str) -> list[tuple[int, int, int]]:
    """(version, tensors, elements changed) of every verify line in a run's output, in order."""
    return [(int(v), int(n), int(c)) for v, n, c in VERIFIED.findall(output)]


def changed(store, versions) -> dict[int, int]:
    """Elements each version's record says its deltas changed (the ranks' manifests summed)."""
    out = {}
    for v in versions:
        rec = commit.read_record(store, v)
        assert rec is not None, f"version {v} has no record in {store.url}"
        out[v] = rec["changed"]
    return out
