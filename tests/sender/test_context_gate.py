"""dcr.context=auto: a sender context-codes only while it is ahead of the link (parts handed
over that the link has not carried yet), and codes plain while the link keeps up, so on a
fast link the walk over each chunk's range (about a copy of it) is not paid for bytes that
cost nothing. The link is its own upload's (parts still queued), or, given link_mbit, the
receivers' (the store near the sender, the receivers far: its uploads never queue). The slow
upload is stood in for by a file store whose part uploads each take 0.3 s on a pool (no
shaped link runs inside a unit test; bench refit runs the real one, tbf over veth)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.protocol import commit
from nemo_dcr_callback.protocol.keys import is_part
from nemo_dcr_callback.receiver import Follower
from nemo_dcr_callback.sender.named import NamedPublisher
from nemo_dcr_callback.transport.store import FileStore
from tests.helpers.tensors import same_bits


class _SlowLink(FileStore):
    """Part uploads that take 0.3 s each, two at a time (a link slower than the encoder)."""

    def __init__(self, root):
        super().__init__(root)
        self._pool = ThreadPoolExecutor(2)

    def executor(self):
        return self._pool

    def put(self, key, data, durable=True):
        if is_part(key):
            time.sleep(0.3)
        super().put(key, data, durable)


def _states():
    g = torch.Generator().manual_seed(5)
    out = []
    masters = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(384, 256, generator=g)
               * torch.logspace(-3, 0, 384 * 256)[torch.randperm(384 * 256, generator=g)].reshape(384, 256)
               for i in range(8)}
    for _ in range(2):
        out.append({k: t.to(torch.bfloat16) for k, t in masters.items()})
        for t in masters.values():
            t += 4e-5 * torch.sign(torch.randn(t.shape, generator=g))
    return out


def _coded(store, v):
    """(context-coded, plain) chunks of version v, in upload order."""
    hs = [codec.parse_header(c) for k in sorted(store.list(commit.vdir(v)), key=_part_no) if is_part(k)
          for c in codec.split_chunks(store.get(k))]
    return [h.classes > 0 for h in hs]


def _part_no(key: str) -> int:
    return int(key.rsplit("-", 1)[-1].split(".")[0]) if is_part(key) else -1


def test_auto_context_codes_once_the_upload_falls_behind(tmp_path):
    states = _states()
    store = _SlowLink(tmp_path)
    pub = NamedPublisher(store, states[0], context="auto", part_bytes=64 << 10)
    assert pub.publish(states[1])["committed"]
    coded = _coded(store, 1)
    assert not coded[0] and any(coded), coded  # plain until a part waits for the link, then context
    held = {k: t.clone() for k, t in states[0].items()}
    Follower(FileStore(tmp_path), held).follow(until=1, timeout=30)
    assert same_bits(held, states[1])


def test_no_mirror_where_auto_can_never_context_code(tmp_path):
    """A store that uploads in the caller (a file store: no pool) never has a backlog, so auto
    never context-codes there: the Megatron worker keeps no mirror for it (no host copy to move
    each version); on keeps one anywhere, off nowhere; a store with a pool keeps one under auto."""
    from nemo_dcr_callback.sender.shard import context_possible

    files, pooled = FileStore(tmp_path / "f"), _SlowLink(tmp_path / "s")
    assert [context_possible(m, files) for m in ("auto", "on", "off")] == [False, True, False]
    assert [context_possible(m, pooled) for m in ("auto", "on", "off")] == [True, True, False]


@pytest.mark.parametrize("link_mbit, expect", [(None, "plain"), (1.0, "mixed"), (1e6, "plain")])
def test_auto_keeps_ahead_of_the_receivers_link(tmp_path, link_mbit, expect):
    """A store that never queues (a file store) with the receivers' link given: at 1 Mbit/s the
    sender is soon a part ahead of it and codes context from then on; on a link far faster
    than its encoding it never is, nor without a link rate. Every case lands on the new bits."""
    states = _states()
    pub = NamedPublisher(FileStore(tmp_path), states[0], context="auto", part_bytes=64 << 10, link_mbit=link_mbit)
    assert pub.publish(states[1])["committed"]
    coded = _coded(FileStore(tmp_path), 1)
    assert not coded[0]  # the first part: nothing sent yet, so nothing to be ahead of
    assert any(coded) == (expect == "mixed"), coded
    held = {k: t.clone() for k, t in states[0].items()}
    Follower(FileStore(tmp_path), held).follow(until=1, timeout=30)
    assert same_bits(held, states[1])


def test_a_link_rate_makes_auto_possible_on_any_store_and_is_checked(tmp_path):
    from nemo_dcr_callback.config import DCRConfig
    from nemo_dcr_callback.sender.shard import context_possible

    assert context_possible("auto", FileStore(tmp_path), 100.0)
    assert not context_possible("off", FileStore(tmp_path), 100.0)
    for bad in (0, -5.0):
        with pytest.raises(ValueError, match="link_mbit must be a positive rate"):
            DCRConfig(link_mbit=bad)


def test_the_gate_counts_parts_handed_over_against_the_links_share(tmp_path):
    """auto with a link: context once two parts are handed over beyond what the link (1/world
    of it per rank) has carried; chunks still gathering into a part do not count."""
    from nemo_dcr_callback.protocol.upload import RankWriter
    from nemo_dcr_callback.sender.shard import context_gate

    w = RankWriter(FileStore(tmp_path), 1, 0, 0, 1, part_bytes=64 << 10)
    slow, fast = context_gate("auto", w, 1.0), context_gate("auto", w, 1e6)  # 125 KB/s; 125 GB/s
    shared = context_gate("auto", w, 8.0, world=8)  # the same 125 KB/s per rank
    w.add(b"x" * (60 << 10))  # gathering, not handed over
    assert not slow() and not shared()
    for _ in range(3):
        w.add(b"x" * (4 << 10) if w._size else b"x" * (64 << 10))  # parts of 64 KiB handed over
    assert slow() and shared() and not fast()  # 192 KiB handed over, a few ms of the slow link carried
    assert not context_gate("off", w, 1.0)() and context_gate("on", w, 1e6)()
