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

from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_dcr_callback import codec
from nemo_dcr_callback.delta import BITS_DTYPE, OP_OVERWRITE, OP_ULP, OP_XOR, bits, ulp_add_reference

LoadFn = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


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
    """Turns the loader's copies into model storage into XOR / ulp-add / sentinel overwrite."""

    def __init__(self, model_storages: set[int], op: int, sentinel: int | None):
        super().__init__()
        self.model, self.op, self.sentinel = model_storages, op, sentinel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and _storage_key(args[0]) in self.model:
            dst, src = args[0], args[1]
            bdt = BITS_DTYPE[dst.element_size()]
            d, s = dst.view(bdt), src.view(bdt)
            if self.op == OP_XOR:
                d.bitwise_xor_(s)
            elif self.op == OP_ULP:
                d.copy_(ulp_add_reference(d, s))
            else:
                d.copy_(torch.where(s == self.sentinel, d, s))
            return dst
        return func(*args, **kwargs)


class LoaderTarget:
    """A live model updated through its own loader (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, load_fn: LoadFn, shapes: dict[str, tuple[torch.Size, torch.dtype]]):
        self.model, self.load_fn = model, load_fn
        self.shapes = shapes  # canonical name -> (shape, dtype), e.g. from the checkpoint's index
        self.storages = {_storage_key(p) for p in model.parameters()} | {_storage_key(b) for b in model.buffers()}
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self.plain = self._learn()

    def _buffer(self, name: str) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        n = int(torch.Size(shape).numel())
        buf = self._scratch.get(dtype)
        if buf is None or buf.numel() < n:
            buf = self._scratch[dtype] = torch.zeros(max(n, 1), dtype=dtype)
        return buf[:n].view(shape)

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
        groups: dict[tuple[str, int], list[codec.DecodedChunk]] = {}
        for d in decoded:
            groups.setdefault((d.header.name, d.op), []).append(d)
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
                with _Combine(self.storages, op, sentinel):
                    self.load_fn([(name, buf)])
                flat.zero_()  # reusable scratch: zero again (a sparse reset would do for huge tensors)

    @staticmethod
    def _sentinel(bdt: torch.dtype, ds: list[codec.DecodedChunk]) -> int:
        """A bit pattern no overwrite value uses (a NaN payload first)."""
        used = set(torch.cat([d.values for d in ds]).tolist()) if ds else set()
        for cand in (0x7FC1, 0x7FA5, 0x7F81, -1, -2) if bdt == torch.int16 else (0x7FC00001, -1, -2):
            if cand not in used:
                return cand
        raise codec.ChunkError("no free sentinel for an overwrite chunk")
