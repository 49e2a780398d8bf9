"""CheckpointDirTarget: a Hugging Face checkpoint directory patched in place, crash-safe."""

from __future__ import annotations

import gc
import json
import mmap
import os
from pathlib import Path

import torch

from nemo_dcr_callback import codec, faults, safe_io
from nemo_dcr_callback.codec import digest
from nemo_dcr_callback.codec.checkpoint import Checkpoint
from nemo_dcr_callback.core.rawbits import OP_OVERWRITE
from nemo_dcr_callback.receiver.journal import Journal


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
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"model directory {self.path} does not exist (or is not a directory)")
        ck = Checkpoint(self.path)  # a directory that is not a checkpoint is refused before anything is written
        self.meta = self.path / ".nemo-dcr"
        self.meta.mkdir(exist_ok=True)
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

    def _loc(self, name: str):
        """(safetensors file, its entry for name, open file, map): where a tensor's bytes are."""
        sf = self.where[name]
        f, mm = self._maps[self._file_of[name]]
        return sf, sf.entries[name], f, mm

    def tensor(self, name: str) -> torch.Tensor:
        sf, e, _, mm = self._loc(name)
        info = codec.dtype_info(e.dtype)
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=e.end - e.begin, offset=sf.data_offset + e.begin)
        return raw.view(info.torch)

    def check(self, h: codec.ChunkHeader) -> None:
        if h.name not in self.where:
            raise codec.ChunkError(f"checkpoint has no tensor {h.name!r} (wrong model?)")
        codec.check_target(h, self.tensor(h.name), h.name)

    def _write_state(self, version: int, pending: str | None, pending_version: int | None) -> None:
        # (a link planted in the model directory is never written through: safe_io)
        safe_io.write_whole(self.meta / "state.json", json.dumps({"version": version, "pending": pending,
                                                                  "pending_version": pending_version}), durable=True)

    def apply(self, decoded: list[codec.DecodedChunk], version: int | None = None) -> None:
        self.apply_with_terms(decoded, version)

    def apply_with_terms(self, decoded: list[codec.DecodedChunk],
                         version: int | None = None) -> dict[str, tuple[int, int]]:
        """Redo log first (fsynced, recorded as pending), then the overwrite from the records
        in memory; per tensor, the digest terms of the touched elements before and after."""
        if version is None:
            raise ValueError("CheckpointDirTarget.apply needs the version (for its redo log)")
        records = self._records(decoded)
        redo = f"redo-{version:010d}.pt"
        safe_io.write_streamed(self.meta / redo, lambda f: torch.save(records, f), durable=True)
        self._write_state(self.version, redo, version)
        terms = self._overwrite(records)
        self._write_state(version, None, None)
        (self.meta / redo).unlink(missing_ok=True)
        self.version = version
        return terms

    def _records(self, decoded: list[codec.DecodedChunk]) -> list:
        """What the redo log holds: the new bits at every changed position, from the file's
        current bits (a subclass adds what follows from them: fp8_dir.py)."""
        return Journal.records(self.flat, decoded)

    def _replay(self, redo_path) -> None:
        self._overwrite(torch.load(redo_path, weights_only=True))

    def _overwrite(self, records) -> dict[str, tuple[int, int]]:
        """Write the records' bits into the files (idempotent) and flush them to disk."""
        out: dict[str, tuple[int, int]] = {}
        for name, pos, new in records:
            b, a = self._write_record(name, pos, new)
            digest.add_terms(out, name, b, a)
            self._crash_point()
        for f, mm in self._maps.values():
            mm.flush()
            os.fsync(f.fileno())
        return out

    def _write_record(self, name: str, pos: torch.Tensor, new: torch.Tensor) -> tuple[int, int]:
        """One record's overwrite, with its digest terms. Where its changes are dense enough
        that nearly every page of their span gets one, the span is patched in a copy and
        written with one pwrite: dirtying a file's pages through the map costs a write fault
        each (50-55 ms for a 64 MB file here, against 12 ms for the pwrite of it). Sparse ones
        are written through the map."""
        flat = self.flat(name)
        lo, hi = (int(pos[0]), int(pos[-1]) + 1) if pos.numel() else (0, 0)
        if not pos.numel() or pos.numel() * 512 < hi - lo:
            return digest.scatter_terms(flat, pos, new, OP_OVERWRITE)
        span = flat[lo:hi].clone()
        terms = digest.scatter_terms(span, pos, new, OP_OVERWRITE, offset=lo)
        sf, e, f, _ = self._loc(name)
        data = span.view(torch.uint8).numpy()
        off = sf.data_offset + e.begin + lo * span.element_size()
        while data.size:  # (pwrite may write less than asked)
            k = os.pwrite(f.fileno(), data, off)
            data, off = data[k:], off + k
        return terms

    def _crash_point(self) -> None:
        """Between two tensor writes (a crash here: the next open replays the redo log). A
        seam: tests replace it on an instance; the fault suite arms the named point."""
        faults.point("receiver.tensor_written")

    def close(self) -> None:
        gc.collect()  # drop tensor views of the maps
        for f, mm in self._maps.values():
            try:
                mm.flush()
                mm.close()
            except BufferError:
                pass
            f.close()
