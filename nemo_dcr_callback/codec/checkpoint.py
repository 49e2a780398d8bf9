"""Safetensors checkpoints as raw bits: a file, or a Hugging Face directory of shards.

The reader keeps each file's header bytes verbatim so a patched checkpoint can be written
back byte for byte identical to the original (same header, same tensor order and offsets).
Files are memory-mapped copy-on-write: tensors are writable views, and nothing written to
them ever reaches the file on disk.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_dcr_callback.codec import dtype_info

MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as safetensors."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors dtype string (BF16, F32, ...)
    shape: tuple[int, ...]
    begin: int  # byte offsets inside the file's data section
    end: int


class SafetensorsFile:
    """One .safetensors file: its header (verbatim) and copy-on-write tensor views."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: too short for safetensors")
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > MAX_HEADER or 8 + hlen > size:
                raise CheckpointError(f"{self.path}: bad safetensors header length {hlen}")
            self.header_bytes = f.read(hlen)
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self.data_offset = 8 + hlen
        try:
            header = json.loads(self.header_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.path}: header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None)
        self.entries: dict[str, TensorEntry] = {}
        data_len = size - self.data_offset
        for name, e in header.items():
            try:
                dtype = e["dtype"]
                shape = tuple(int(d) for d in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: bad entry for {name!r}") from None
            width = dtype_info(dtype).width
            numel = 1
            for d in shape:
                numel *= d
            if not 0 <= begin <= end <= data_len or end - begin != numel * width:
                raise CheckpointError(f"{self.path}: {name!r} data offsets do not match its shape")
            self.entries[name] = TensorEntry(name, dtype, shape, begin, end)
        spans = sorted((e.begin, e.end) for e in self.entries.values())
        pos = 0
        for b, e in spans:
            if b != pos:
                raise CheckpointError(f"{self.path}: tensor data is not contiguous (hole or overlap at {pos})")
            pos = e
        if pos != data_len:
            raise CheckpointError(f"{self.path}: {data_len - pos} trailing bytes after the tensor data")

    def tensor(self, name: str) -> torch.Tensor:
        """A copy-on-write view of the tensor (writes never reach the file)."""
        e = self.entries[name]
        info = dtype_info(e.dtype)
        if e.end == e.begin:
            return torch.empty(e.shape, dtype=info.torch)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=e.end - e.begin,
                               offset=self.data_offset + e.begin)
        return raw.view(info.torch).reshape(e.shape)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def list_safetensors(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix == ".safetensors")


class Checkpoint:
    """A .safetensors file or a directory of them (other files in the directory ride along)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"{self.path}: no such file or directory")
        self.is_dir = self.path.is_dir()
        names = list_safetensors(self.path) if self.is_dir else [self.path.name]
        if not names:
            raise CheckpointError(f"{self.path}: no .safetensors files")
        base = self.path if self.is_dir else self.path.parent
        self.files = {n: SafetensorsFile(base / n) for n in names}
        self.where: dict[str, str] = {}
        for fname, f in self.files.items():
            for t in f.entries:
                if t in self.where:
                    raise CheckpointError(f"{self.path}: tensor {t!r} in both {self.where[t]} and {fname}")
                self.where[t] = fname
        self.other_files = (sorted(p.name for p in self.path.iterdir()
                                   if p.is_file() and p.suffix != ".safetensors")
                            if self.is_dir else [])

    def entry(self, name: str) -> TensorEntry:
        return self.files[self.where[name]].entries[name]

    def tensor(self, name: str) -> torch.Tensor:
        return self.files[self.where[name]].tensor(name)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def write_safetensors(path: Path, header_bytes: bytes, entries: dict[str, TensorEntry], get_bits) -> None:
    """Write a file with exactly this header; tensor bytes come from get_bits(name) (a
    contiguous tensor), placed at the header's offsets in ascending order."""
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for e in sorted(entries.values(), key=lambda e: e.begin):
            t = get_bits(e.name)
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
