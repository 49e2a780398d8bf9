"""dcr.context=auto: a sender context-codes only while its upload is behind (a part's worth of
bytes still queued for the link), and codes plain while the link keeps up, so on a fast link
the walk over each chunk's range (about a copy of it) is not paid for bytes that cost nothing.
The slow link is stood in for by a file store whose part uploads each take 0.3 s on a pool
(no shaped link runs inside a unit test; bench refit runs the real one, tbf over veth)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

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
