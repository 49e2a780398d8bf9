"""Publishing from named canonical tensors: for trainers that hold (or gather) their weights
as Hugging Face-named tensors (TRL, SkyRL and verl's actors, a vLLM `WeightSource`) rather
than as Megatron shards with a placement.

    pub = NamedPublisher("file:///shared/dcr", model.state_dict())   # keyframe 0, or resume
    for step in ...:
        train_step(...)
        d = pub.publish(model.state_dict())    # delta, chunks, seal, joint commit: one call
        if not d["committed"]: ...             # aborted: the next version covers the changes

One rank, synchronous: the delta kernel, encoding and upload run in the caller (tensor by
tensor, so parts upload while later tensors are diffed), then the version is sealed and the
joint commit decides it. Committed, the baseline moves; aborted or failed, the baselines are
restored bit for bit from the undo log and the next version carries the changes (XOR deltas
compose). The Megatron path (sharded, in the background, many ranks) is Publisher.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.config import PART_BYTES, CommitPolicy, check_link, context_mode
from nemo_dcr_callback.core import cuda_kernels, kernels
from nemo_dcr_callback.core.delta import Scratch, undo
from nemo_dcr_callback.core.rawbits import SparseDelta
from nemo_dcr_callback.protocol import commit, upload
from nemo_dcr_callback.protocol.rebuild import committed_keyframes, reconstruct
from nemo_dcr_callback.sender.shard import _host, _take, context_gate
from nemo_dcr_callback.transport.store import open_store

__all__ = ["NamedPublisher", "NamedSender", "PublishError"]

Tensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class PublishError(RuntimeError):
    """A version could not be published (what was sent is rolled back; nothing is committed)."""


class NamedSender:
    """The delta and chunks of canonical tensors held whole (a Hugging Face state dict): no
    placement, tensors split over `world` senders by name (round-robin). NamedPublisher
    publishes with it; the link benchmark and tests use it directly."""

    def __init__(self, tensors: dict[str, torch.Tensor], rank: int = 0, world: int = 1, *,
                 span: int = codec.DEFAULT_CHUNK_SPAN, level: int = 1, baseline: str = "gpu",
                 context: str | bool = "auto", link_mbit: float | None = None, encode_threads: int | None = None,
                 copy: bool = True):
        self.tensors = {n: tensors[n] for n in sorted(tensors)[rank::world]}
        self.rank, self.world, self.span, self.level = rank, world, span, level
        # Tensors encoded at once (None: the kernels' thread count, at most 4). One sender rank
        # is the whole publisher here (no Megatron ranks to spread the work), and context
        # coding costs several times the plain encoder's CPU: encoded one tensor at a time it
        # was what the refit waited for (docs/PERFORMANCE.md).
        if encode_threads is not None and encode_threads < 1:
            raise ValueError(f"encode_threads must be >= 1, not {encode_threads}")
        self.encode_threads = encode_threads or min(4, kernels.num_threads())
        self._pool: ThreadPoolExecutor | None = None
        # context coding (codec/context.py; when: config.CONTEXT_MODES) from the baselines,
        # which hold the new bits once a delta is taken; host baselines only (a GPU one would be
        # read back whole each version)
        self.context = context_mode(context)
        check_link(link_mbit)
        self.link_mbit = link_mbit  # the receivers' link, shared by the world senders (context="auto")
        # copy=False: the caller hands over tensors it made for this (NamedPublisher's, streamed in
        # one at a time), so the sender holds one copy of the model, not two
        self.baselines = {n: t.detach().reshape(-1) if not copy else t.detach().reshape(-1).clone()
                          for n, t in self.tensors.items()}
        cuda_kernels.check_baseline_option(baseline)
        self.baselines = {n: cuda_kernels.place_baseline(b, baseline, self.tensors[n].detach().reshape(-1))
                          if b.is_cuda else b for n, b in self.baselines.items()}
        self.digests = {n: digest.sum64(_host(b)) for n, b in self.baselines.items()}
        self._scratch = Scratch()
        self._side = cuda_kernels.SideStream()
        self._undo: list[tuple[str, SparseDelta]] = []  # every delta taken since the last settle()

    def _take_one(self, n: str, t: torch.Tensor) -> tuple[str, SparseDelta]:
        self._undo.append((n, _take(t.detach().reshape(-1), self.baselines[n], self._scratch, self._side)))
        return self._undo[-1]

    def take(self) -> list[tuple[str, SparseDelta]]:
        return [self._take_one(n, t) for n, t in self.tensors.items()]

    def stream(self, store, v: int, base: int, part_bytes: int = PART_BYTES,
               items: Iterable[tuple[str, torch.Tensor]] | None = None) -> tuple[list, dict]:
        """take() and write() interleaved tensor by tensor: each tensor's chunks are encoded
        and their parts uploaded while the kernel runs over the next tensors (the refit
        starts moving bytes right after the first tensor). items: the (name, tensor) pairs to
        take, as they come (default: self.tensors). Returns (taken, manifest)."""
        taken: list[tuple[str, SparseDelta]] = []

        def lazily():  # a failed upload leaves what was taken in the undo log: roll_back() restores it
            for n, t in (self.tensors.items() if items is None else items):
                taken.append(self._take_one(n, t))
                yield taken[-1]

        m = self.write(store, v, base, lazily(), part_bytes=part_bytes)
        return taken, m

    def write(self, store, v: int, base: int, taken, part_bytes: int = PART_BYTES,
              after_chunk: Callable[[], None] | None = None):
        """Encode and stream one version's chunks (parts uploaded as they fill), then the
        manifest with the moved digests (kept, for the next version, by settle())."""
        w = upload.RankWriter(store, v, base, self.rank, self.world, part_bytes=part_bytes)
        context_now = context_gate(self.context, w, self.link_mbit, self.world)
        dig = dict(self.digests)
        params = changed = 0
        pool = self._encoders()
        pending: deque[tuple[str, Future]] = deque()

        def encode(n: str, d: SparseDelta, cur: torch.Tensor | None) -> tuple[list[bytes], list[int]]:
            terms = [0, 0]
            return codec.encode_delta(n, d, d.new, span=self.span, level=self.level, terms=terms, current=cur), terms

        def add(n: str, chunks: list[bytes], terms: list[int]) -> None:
            for c in chunks:
                w.add(c)
                if after_chunk is not None:
                    after_chunk()
            dig[n] = digest.move(dig[n], terms)

        def drain(keep: int) -> None:  # in order: the parts and the digests as if encoded one by one
            while len(pending) > keep:
                n, fut = pending.popleft()
                add(n, *fut.result())

        try:
            for n, d in taken:
                params += d.numel
                changed += d.count
                if d.count:
                    b = self.baselines[n]
                    cur = b if b.is_cpu and context_now() else None
                    if pool is None:
                        add(n, *encode(n, d, cur))
                    else:
                        pending.append((n, pool.submit(encode, n, d, cur)))
                        drain(self.encode_threads)  # a few ahead, not the whole model's chunks held
            drain(0)
        finally:  # (failed: nothing may still read the baselines while roll_back restores them)
            for _, fut in pending:
                fut.cancel()
            wait([fut for _, fut in pending])
        m = w.finish(params, changed, dig)
        self._pending = dig
        return m

    def _encoders(self) -> ThreadPoolExecutor | None:
        if self.encode_threads < 2:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.encode_threads, thread_name_prefix="dcr-encode")
        return self._pool

    def settle(self) -> None:
        """The joint commit committed the version written last: keep its digests, drop the undo."""
        self.digests = self._pending
        self._undo.clear()

    def roll_back(self, taken: list[tuple[str, SparseDelta]] | None = None) -> None:
        """Restore the baselines: of `taken`, or of everything since the last settle() (also a
        version whose upload failed half-way)."""
        ids = {id(d) for _, d in taken} if taken is not None else None
        for n, d in reversed(self._undo if taken is None else taken):
            undo(self.baselines[n], d)
        self._undo = [] if ids is None else [(n, d) for n, d in self._undo if id(d) not in ids]


class NamedPublisher:
    """Publishes versions of a model held as named canonical tensors, one call per version.

    `tensors` are the weights the receivers hold now. On an empty store they become keyframe 0
    (with `config_json`, the model's config.json, so engines can start from it). On a store
    with history the baseline is rebuilt from it (the newest committed version, digests
    checked) and version numbers go on after the newest in the store; the first publish then
    carries whatever differs from it (tensors None: resume from the store alone)."""

    def __init__(self, store, tensors: Tensors | None, *, policy: CommitPolicy | None = None,
                 config_json: str | None = None, part_bytes: int = PART_BYTES, seal_timeout: float = 600.0,
                 span: int = codec.DEFAULT_CHUNK_SPAN, level: int = 1, context: str | bool = "auto",
                 link_mbit: float | None = None, log: Callable[[str], None] | None = None,
                 encode_threads: int | None = None):
        self.store = open_store(store) if isinstance(store, str) else store
        self.policy = policy or CommitPolicy()
        self.behind: list[str] = []  # receivers the last decision marked lagging (run_commit)
        self.part_bytes, self.seal_timeout, self.log = part_bytes, seal_timeout, log
        last, newest, dangling = commit.resume_point(self.store)
        if not committed_keyframes(self.store):
            if newest:
                raise PublishError(f"{self.store.url}: versions but no committed keyframe to rebuild them from")
            if tensors is None:
                raise PublishError(f"{self.store.url} is empty: the first publisher gives the weights the receivers "
                                   "hold (keyframe 0)")
            # one copy each, made as the pairs come: a generator that gathers one tensor at a time
            # (FSDP's full_tensor) never has the whole model twice on this rank
            held = {n: _own(t) for n, t in _pairs(tensors)}
            commit.write_keyframe(self.store, 0, {n: t.cpu() for n, t in held.items()}, config_json)
        else:
            commit.abort_dangling(self.store, dangling, "the publisher restarted", base=last)
            held = reconstruct(self.store, last)
            if tensors is not None:  # checked one pair at a time, none kept
                seen = set()
                for n, t in _pairs(tensors):
                    if n not in held:
                        raise PublishError(f"the tensors differ from the store's version {last}: unknown {n!r}")
                    _check_one(n, t, held[n], f"the store's version {last}")
                    held[n] = held[n].to(t.device)
                    seen.add(n)
                if missing := sorted(set(held) - seen):
                    raise PublishError(f"the tensors differ from the store's version {last}: missing {missing[:3]}")
        self.last, self.newest = last, newest  # last committed; newest version number used
        self.sender = NamedSender(held, span=span, level=level, context=context, link_mbit=link_mbit,
                                  encode_threads=encode_threads, copy=False)
        self.sender.tensors = {}  # publish passes the tensors each time: hold the baselines only

    def publish(self, tensors: Tensors, version: int | None = None) -> dict:
        """One version: the delta of `tensors` against the last committed version, sent,
        sealed and decided. A mapping is checked whole first; an iterable of (name, tensor)
        pairs is streamed (each tensor diffed and its chunks uploaded as it comes; a caller's
        generator may produce them one at a time). Returns the decision with "committed",
        "bytes", "params" and "changed". Raises PublishError (nothing committed, baselines
        restored) if it could not be sent or sealed; an aborted version is a decision, not an
        error."""
        v = self.newest + 1 if version is None else int(version)
        if v <= self.newest:
            raise PublishError(f"version {v}: the store already holds version {self.newest}; versions only increase")
        if isinstance(tensors, Mapping):  # checked whole before anything is sent
            _check_names(self.sender.baselines, tensors, "the baseline")
            items = ((n, tensors[n]) for n in self.sender.baselines)
        else:  # streamed: one tensor held at a time, checked as it comes (a bad one fails the version)
            items = self._checked(tensors)
        t0 = time.perf_counter()
        self.newest = v  # (a number used once, also by a version that failed)
        try:
            _, m = self.sender.stream(self.store, v, self.last, part_bytes=self.part_bytes, items=items)
            rec = commit.seal_version(self.store, v, self.last, 1, timeout=self.seal_timeout)
        except Exception as exc:
            self.sender.roll_back()
            commit.abort_dangling(self.store, [v], f"the publisher failed: {exc}", base=self.last)
            raise PublishError(f"version {v} was not published: {exc}") from exc
        try:
            d = commit.run_commit(self.store, rec, self.policy, log=self.log, behind=self.behind)
        except Exception as exc:  # (under "wait", past the timeout): decided abort, so that the
            # receivers move on, and the baselines restored, so that the next version is taken
            # against the last committed one; the caller still sees the error
            d = commit.decide(self.store, v, self.last, "abort", [], [], f"the commit failed: {exc}")
            if d["decision"] != "commit":
                self.sender.roll_back()
                raise
        self.behind = d["lagging"]
        committed = d["decision"] == "commit"
        if committed:
            self.sender.settle()
            self.last = v
        else:
            self.sender.roll_back()
        return {**d, "committed": committed, "bytes": m["bytes"], "params": m["params"], "changed": m["changed"],
                "publish_s": time.perf_counter() - t0}

    def _checked(self, items: Iterable[tuple[str, torch.Tensor]]):
        """The pairs as they come, each checked against the baseline; every tensor once."""
        held, seen = self.sender.baselines, set()
        for n, t in items:
            if n not in held:
                raise PublishError(f"the tensors differ from the baseline: unknown {n!r}")
            if n in seen:
                raise PublishError(f"{n}: given twice")
            _check_one(n, t, held[n], "the baseline")
            seen.add(n)
            yield n, t
        missing = sorted(set(held) - seen)
        if missing:
            raise PublishError(f"the tensors differ from the baseline: missing {missing[:3]}")


def _pairs(tensors: Tensors) -> Iterable[tuple[str, torch.Tensor]]:
    return tensors.items() if isinstance(tensors, Mapping) else tensors


def _own(t: torch.Tensor) -> torch.Tensor:
    """A baseline of its own (the caller's tensor goes on changing), on the tensor's device."""
    return t.detach().clone()


def _check_names(held: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], what: str) -> None:
    """The same tensors, shapes and dtypes as `held`, or a PublishError naming the first difference."""
    missing, extra = sorted(set(held) - set(got)), sorted(set(got) - set(held))
    if missing or extra:
        raise PublishError(f"the tensors differ from {what}: missing {missing[:3]}, unknown {extra[:3]}")
    for n, t in got.items():
        _check_one(n, t, held[n], what)


def _check_one(n: str, t: torch.Tensor, h: torch.Tensor, what: str) -> None:
    if t.dtype != h.dtype or t.numel() != h.numel():
        raise PublishError(f"{n}: {t.dtype} x {t.numel()} where {what} has {h.dtype} x {h.numel()}")
