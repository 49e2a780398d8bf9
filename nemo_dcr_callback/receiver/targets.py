"""Receiver targets: where verified chunks land.

- `StateDictTarget`: canonical tensors by name (a Hugging Face model's state_dict(), whose
  tensors share storage with the parameters). Positions are applied directly.
- `LoaderTarget`: a live model whose own loader places weights (vLLM-style
  `load_weights(iterable of (name, tensor))`, which may rename, fuse or split tensors). Per
  canonical tensor, the changes are scattered into a reusable zeroed scratch buffer and the
  model's loader is called on it under a dispatch mode that turns every copy into model
  storage into an XOR (or a ulp addition, or an overwrite of the entries not holding the
  sentinel): the model's own code decides where each element goes. Which names the loader
  moves as plain copies (the condition for this) is learned once, at start-up, by a no-op
  pass that watches the loader's copies; other names are refused with a clear error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_dcr_callback import codec
from nemo_dcr_callback.delta import BITS_DTYPE, OP_OVERWRITE, OP_ULP, OP_XOR, bits, ulp_add_reference

LoadFn = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


_POOL: ThreadPoolExecutor | None = None


def _apply_pool() -> ThreadPoolExecutor | None:
    """Threads for the receiver's apply (None on one core)."""
    global _POOL
    n = min(4, os.cpu_count() or 1)
    if n < 2:
        return None
    if _POOL is None:
        _POOL = ThreadPoolExecutor(n, thread_name_prefix="nemo-dcr-apply")
    return _POOL


class StateDictTarget:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def check(self, h: codec.ChunkHeader) -> None:
        t = self.tensors.get(h.name)
        if t is None:
            raise codec.ChunkError(f"receiver has no tensor {h.name!r} (wrong model?)")
        if not t.is_contiguous():
            raise codec.ChunkError(f"receiver tensor {h.name!r} is not contiguous")
        codec.check_target(h, t, h.name)

    def apply(self, decoded: list[codec.DecodedChunk]) -> None:
        for d in decoded:
            codec.apply_decoded(d, self.tensors[d.header.name].view(-1))

    def apply_with_terms(self, decoded: list[codec.DecodedChunk]) -> dict[str, tuple[int, int]]:
        """apply() fused with the digest check: per tensor, the digest terms of the touched
        elements before and after (read from the tensors themselves in the same pass)."""
        from nemo_dcr_callback import digest

        def one(d: codec.DecodedChunk) -> tuple[int, int]:
            return digest.scatter_terms(self.tensors[d.header.name].view(-1), d.positions, d.values, d.op)

        # Chunks touch disjoint positions and the terms add up in any order, so they are applied
        # on a few threads (the compiled scatter runs without the GIL): the apply sits after the
        # commit decision, on the refit's critical path.
        pool = _apply_pool() if len(decoded) > 1 else None
        terms = list(pool.map(one, decoded)) if pool is not None else [one(d) for d in decoded]
        out: dict[str, tuple[int, int]] = {}
        for d, (b, a) in zip(decoded, terms, strict=True):
            ob, oa = out.get(d.header.name, (0, 0))
            out[d.header.name] = ((ob + b) & digest.MASK, (oa + a) & digest.MASK)
        return out

    def names(self) -> list[str]:
        return list(self.tensors)

    def flat(self, name: str) -> torch.Tensor:
        return self.tensors[name].view(-1)


def apply_chunks(state: dict[str, torch.Tensor], chunks: list[bytes]) -> int:
    """Apply chunks to canonical tensors: every chunk is checked and decoded before any is
    applied. Returns the number of changed elements."""
    target = StateDictTarget(state)
    decoded = []
    for c in chunks:
        h = codec.parse_header(c)
        target.check(h)
        decoded.append(codec.decode_chunk(c, h))
    target.apply(decoded)
    return sum(d.header.count for d in decoded)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Watch(TorchDispatchMode):
    """Records, for every copy into model storage, whether it is a plain copy of a view of
    the scratch buffer (same dtype): the condition for turning it into an XOR."""

    def __init__(self, model_storages: set[int], scratch: torch.Tensor):
        super().__init__()
        self.model, self.scratch = model_storages, _storage_key(scratch)
        self.copies = 0
        self.plain = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if dst is not None and func._schema.is_mutable and _storage_key(dst) in self.model:
            if func is torch.ops.aten.copy_.default:
                src = args[1]
                self.copies += 1
                if _storage_key(src) != self.scratch or src.dtype != dst.dtype or src.shape != dst.shape:
                    self.plain = False
            else:
                self.plain = False  # the loader writes model storage by some other op
            return dst  # a watch pass writes nothing
        return func(*args, **kwargs)


class _Combine(TorchDispatchMode):
    """Turns the loader's copies into model storage into XOR / ulp-add / sentinel overwrite,
    chosen by the scratch buffer the copy comes from."""

    def __init__(self, model_storages: set[int], ops: dict[int, tuple[int, int | None]]):
        super().__init__()
        self.model, self.ops = model_storages, ops  # scratch storage -> (op, sentinel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and _storage_key(args[0]) in self.model:
            dst, src = args[0], args[1]
            op, sentinel = self.ops[_storage_key(src)]
            bdt = BITS_DTYPE[dst.element_size()]
            d, s = dst.view(bdt), src.view(bdt)
            if op == OP_XOR:
                d.bitwise_xor_(s)
            elif op == OP_ULP:  # only where the scratch holds a difference (zero elsewhere)
                mask = s != 0
                d[mask] = ulp_add_reference(d[mask], s[mask])
            else:
                d.copy_(torch.where(s == sentinel, d, s))
            return dst
        return func(*args, **kwargs)


class LoaderTarget:
    """A live model updated through its own loader (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, load_fn: LoadFn, shapes: dict[str, tuple[torch.Size, torch.dtype]],
                 scratch_bytes: int = 256 << 20):
        self.model, self.load_fn = model, load_fn
        self.shapes = shapes  # canonical name -> (shape, dtype), e.g. from the checkpoint's index
        self.scratch_bytes = scratch_bytes  # loader calls are batched up to this much scratch
        self.storages = {_storage_key(p) for p in model.parameters()} | {_storage_key(b) for b in model.buffers()}
        self.plain = self._learn()

    def _buffer(self, name: str) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        return torch.zeros(shape, dtype=dtype)

    def _learn(self) -> dict[str, bool]:
        plain = {}
        with torch.no_grad():
            for name in self.shapes:
                buf = self._buffer(name)
                w = _Watch(self.storages, buf)
                with w:
                    self.load_fn([(name, buf)])
                plain[name] = w.plain and w.copies > 0
        return plain

    def check(self, h: codec.ChunkHeader) -> None:
        if h.name not in self.shapes:
            raise codec.ChunkError(f"receiver has no tensor {h.name!r} (wrong model?)")
        shape, dtype = self.shapes[h.name]
        if dtype != h.dtype.torch or int(torch.Size(shape).numel()) != h.numel:
            raise codec.ChunkError(f"chunk for {h.name!r} is {h.dtype.name} x {h.numel}, the model's is "
                                   f"{dtype} x {torch.Size(shape).numel()}")
        if not self.plain[h.name]:
            raise codec.ChunkError(f"the model's loader transforms {h.name!r} (not a plain copy): "
                                   "in-place delta application is refused for it")

    def apply(self, decoded: list[codec.DecodedChunk]) -> None:
        """One scratch tensor per (name, op), filled sparsely; the loader is called on
        batches of them (bounded by scratch_bytes) under one dispatch mode."""
        groups: dict[tuple[str, int], list[codec.DecodedChunk]] = {}
        for d in decoded:
            groups.setdefault((d.header.name, d.op), []).append(d)
        batch: list[tuple[str, torch.Tensor]] = []
        ops: dict[int, tuple[int, int | None]] = {}
        size = 0
        with torch.no_grad():
            for (name, op), ds in groups.items():
                buf = self._buffer(name)
                flat = bits(buf)
                sentinel = None
                if op == OP_OVERWRITE:
                    sentinel = self._sentinel(flat.dtype, ds)
                    flat.fill_(sentinel)
                for d in ds:
                    flat[d.positions.to(torch.int64)] = d.values
                ops[_storage_key(buf)] = (op, sentinel)
                batch.append((name, buf))
                size += buf.numel() * buf.element_size()
                if size >= self.scratch_bytes:
                    self._load(batch, ops)
                    batch, ops, size = [], {}, 0
            if batch:
                self._load(batch, ops)

    def _load(self, batch, ops) -> None:
        with _Combine(self.storages, ops):
            self.load_fn(batch)

    @staticmethod
    def _sentinel(bdt: torch.dtype, ds: list[codec.DecodedChunk]) -> int:
        """A bit pattern no overwrite value uses (a NaN payload first)."""
        used = set(torch.cat([d.values for d in ds]).tolist()) if ds else set()
        for cand in (0x7FC1, 0x7FA5, 0x7F81, -1, -2) if bdt == torch.int16 else (0x7FC00001, -1, -2):
            if cand not in used:
                return cand
        raise codec.ChunkError("no free sentinel for an overwrite chunk")


class CheckpointDirTarget:
    """A Hugging Face checkpoint directory patched in place, crash-safe.

    Each version is first turned into a redo log: the new bits at every changed position
    (computed from the file's current bits), written and fsynced under `.nemo-dcr/`, and
    recorded as pending in `.nemo-dcr/state.json`; only then are the safetensors files
    written (memory-mapped) and flushed, and the state moved to the new version. Replaying
    the redo log is idempotent (overwrites), so a crash anywhere leaves a directory that the
    next open completes: never half-applied, never reloaded from scratch.
    """

    def __init__(self, path):
        import json
        import mmap
        from pathlib import Path

        from nemo_dcr_callback.checkpoint import Checkpoint

        self.path = Path(path)
        self.meta = self.path / ".nemo-dcr"
        self.meta.mkdir(exist_ok=True)
        ck = Checkpoint(self.path)
        self.where = {name: ck.files[f] for name, f in ck.where.items()}
        ck_files = ck.files
        self._maps = {}
        for fname, sf in ck_files.items():
            f = open(sf.path, "r+b")
            self._maps[fname] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE))
        self._file_of = dict(ck.where)
        state_p = self.meta / "state.json"
        self.version = 0
        if state_p.exists():
            st = json.loads(state_p.read_text())
            self.version = st["version"]
            if st.get("pending"):
                self._replay(self.meta / st["pending"])
                self.version = st["pending_version"]
                self._write_state(self.version, None, None)

    def names(self) -> list[str]:
        return list(self.where)

    def flat(self, name: str) -> torch.Tensor:
        return self.tensor(name).view(-1)

    def tensor(self, name: str) -> torch.Tensor:
        sf = self.where[name]
        e = sf.entries[name]
        _, mm = self._maps[self._file_of[name]]
        info = codec.dtype_info(e.dtype)
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=e.end - e.begin, offset=sf.data_offset + e.begin)
        return raw.view(info.torch)

    def check(self, h: codec.ChunkHeader) -> None:
        if h.name not in self.where:
            raise codec.ChunkError(f"checkpoint has no tensor {h.name!r} (wrong model?)")
        codec.check_target(h, self.tensor(h.name), h.name)

    def _write_state(self, version: int, pending: str | None, pending_version: int | None) -> None:
        import json
        import os

        tmp = self.meta / "state.json.tmp"
        tmp.write_text(json.dumps({"version": version, "pending": pending, "pending_version": pending_version}))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.meta / "state.json")

    def apply(self, decoded: list[codec.DecodedChunk], version: int | None = None) -> None:
        import os

        if version is None:
            raise ValueError("CheckpointDirTarget.apply needs the version (for its redo log)")
        records = []
        for d in decoded:  # new bits at the changed positions, from the file's current bits
            t = bits(self.tensor(d.header.name))
            pos = d.positions.to(torch.int64)
            cur = t[pos]
            if d.op == OP_XOR:
                new = cur ^ d.values
            elif d.op == OP_ULP:
                new = ulp_add_reference(cur, d.values)
            else:
                new = d.values
            records.append((d.header.name, pos, new))
        redo = f"redo-{version:010d}.pt"
        with open(self.meta / redo, "wb") as f:
            torch.save(records, f)
            f.flush()
            os.fsync(f.fileno())
        self._write_state(self.version, redo, version)
        self._replay(self.meta / redo)
        self._write_state(version, None, None)
        (self.meta / redo).unlink(missing_ok=True)
        self.version = version

    def _replay(self, redo_path) -> None:
        records = torch.load(redo_path, weights_only=True)
        for name, pos, new in records:
            bits(self.tensor(name))[pos] = new
            self._crash_point()
        for _, mm in self._maps.values():
            mm.flush()

    def _crash_point(self) -> None:
        """Between two tensor writes of a replay (fault injection: journal.fault_point)."""
        from nemo_dcr_callback.receiver.journal import fault_point

        fault_point()

    def close(self) -> None:
        import gc

        gc.collect()  # drop tensor views of the maps
        for f, mm in self._maps.values():
            try:
                mm.flush()
                mm.close()
            except BufferError:
                pass
            f.close()
