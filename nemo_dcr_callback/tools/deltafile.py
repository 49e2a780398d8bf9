"""File-level deltas between two safetensors checkpoints (`nemo-dcr diff / patch / stats`).

A delta file is the codec's chunks back to back, then a zstd-compressed JSON manifest, then
a fixed footer (docs/FORMAT.md): the writer streams chunks as they are encoded and needs no
second pass. The manifest holds each safetensors header of NEW (or, where it equals BASE's,
its digest only), per tensor in header order its mode, change count and chunks, and digests
of the old and new bits, so `patch` rebuilds NEW's files byte for byte. Tensors with few
changes share batched chunks (one header and one set of entropy tables for many norms,
biases or experts). `patch` (tools/delta_patch.py) verifies everything it can before
writing (manifest checksum, base digest), writes into a temporary path and renames it into
place only when the new bits' digest matched: a bad delta or a wrong base leaves nothing
behind.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec.checkpoint import Checkpoint, CheckpointError, TensorEntry
from nemo_dcr_callback.core.delta import take_delta
from nemo_dcr_callback.tools.delta_manifest import (
    MAX_MANIFEST,
    VERSION,
    DeltaError,
    _file_header,
    _records,
    dump_manifest,
    load_manifest,
)

MAGIC = b"DCRD"
END_MAGIC = b"DCRDEND\x00"
# The footer of a signed file: an HMAC-SHA256 sits before it, over every byte before it and
# then the footer itself (so the manifest's offset and length are signed too). "DCRDSIG\0"
# files signed only the bytes before the MAC: a footer re-pointed at a manifest hidden in a
# copied file passed; they are refused by name.
SIGNED_MAGIC = b"DCRDSG2\x00"
OLD_SIGNED_MAGIC = b"DCRDSIG\x00"
SIG_BYTES = 32
MIN_KEY_BYTES = 16
BATCH_CHANGES = 4096  # a tensor with fewer changes than this goes into a batched chunk
BATCH_LIMIT = 1 << 16  # changes in one batched chunk, at most
_HEAD = struct.Struct("<4sHH")  # magic, version, reserved
_FOOT = struct.Struct("<QQQ8s")  # manifest offset, manifest length, xxh3-64 of manifest, end magic


def signing_key(env: str) -> bytes:
    """The delta signing key from the environment variable `env` (never a command-line value:
    those show in process listings and shell history)."""
    v = os.environ.get(env, "")
    if len(v.encode()) < MIN_KEY_BYTES:
        raise DeltaError(f"{env} must hold the delta signing key, at least {MIN_KEY_BYTES} bytes"
                         + (" (it is empty or unset)" if not v else f" (it has {len(v.encode())})"))
    return v.encode()


class _Out:
    """The delta being written, fed to an HMAC as it goes (one pass, as without a key)."""

    def __init__(self, f, mac):
        self.f, self.mac = f, mac

    def write(self, b: bytes) -> None:
        self.f.write(b)
        if self.mac is not None:
            self.mac.update(b)

    def tell(self) -> int:
        return self.f.tell()


class _Progress:
    """One line to stderr at most every `every` seconds, and a last one."""

    def __init__(self, what: str, total: int, every: float = 2.0, quiet: bool = False):
        self.what, self.total, self.every, self.quiet = what, total, every, quiet
        self.t0 = self.last = time.monotonic()
        self.done = self.nbytes = 0

    def add(self, nbytes: int) -> None:
        self.done += 1
        self.nbytes += nbytes
        self.tick()

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or (not force and now - self.last < self.every):
            return
        self.last = now
        print(f"nemo-dcr {self.what}: {self.done}/{self.total} tensors, {self.nbytes / 1e9:.2f} GB, "
              f"{now - self.t0:.1f} s", file=sys.stderr)


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _check_output(out_path: Path, inputs: list[Path], force: bool) -> None:
    """diff never replaces one of its inputs, nor writes into a checkpoint directory it reads
    (the delta would become one of that checkpoint's files); another existing file only with
    force."""
    out = out_path.resolve()
    for p in inputs:
        p = p.resolve()
        if out == p or (p.is_dir() and p in out.parents):
            raise ValueError(f"{out_path} is (inside) the input {p}: diff never writes over its inputs")
    if out_path.exists() and not force:
        raise FileExistsError(f"{out_path} exists (use --force to replace it)")


def _check_links(ck: Checkpoint) -> None:
    """Every file of a checkpoint folder that diff embeds must be inside the folder: a symlink
    leading out of it would put whatever it points at (a key, another model) into the delta."""
    if not ck.is_dir:
        return
    root = os.path.realpath(ck.path)
    for name in [*ck.files, *ck.other_files]:
        real = os.path.realpath(ck.path / name)
        if real != root and not real.startswith(root + os.sep):
            raise DeltaError(f"{ck.path / name} is a link leading out of {ck.path} (to {real}): refused; copy the "
                             "file in if it belongs to the checkpoint")


def diff(old_path: str | os.PathLike, new_path: str | os.PathLike, out_path: str | os.PathLike, *,
         span: int = codec.DEFAULT_CHUNK_SPAN, level: int = 1, quiet: bool = False, force: bool = False,
         key: bytes | None = None, context: bool = True) -> dict:
    """Write the delta OLD -> NEW to out_path (atomically). Returns the manifest. With a key,
    the file is signed: an HMAC-SHA256 of everything before it (docs/FORMAT.md), for deltas
    passed between parties, where the unkeyed checksums prove nothing. context: try the
    context-modelled coding (which reads OLD's bits) on every chunk and keep it where smaller."""
    out_path = Path(out_path)
    _check_output(out_path, [Path(old_path), Path(new_path)], force)
    old, new = Checkpoint(old_path), Checkpoint(new_path)
    _check_links(new)
    fd, tmp = tempfile.mkstemp(prefix=out_path.name + ".", suffix=".tmp", dir=out_path.parent or ".")
    prog = _Progress("diff", len(new.where), quiet=quiet)
    try:
        with os.fdopen(fd, "wb") as raw:
            f = _Out(raw, hmac.new(key, digestmod=hashlib.sha256) if key is not None else None)
            f.write(_HEAD.pack(MAGIC, VERSION, 0))
            w = _Writer(f, span, level, context)
            files = []
            for fname, sf in new.files.items():
                same = fname in old.files and old.files[fname].header_bytes == sf.header_bytes
                files.append({"path": fname, **({"header_digest": xxhash.xxh3_128_hexdigest(sf.header_bytes)}
                                                if same else {"header": sf.header_bytes.decode()})})
                for name, e in sorted(sf.entries.items(), key=lambda kv: kv[1].begin):
                    w.tensor(name, e, sf.tensor(name), old)
                    prog.add(e.end - e.begin)
            w.flush()
            others = []
            for name in new.other_files:
                p = new.path / name
                dg = file_digest(p)
                if name in old.other_files and file_digest(old.path / name) == dg:
                    others.append({"path": name, "digest": dg, "same": True})
                else:
                    data = p.read_bytes()
                    others.append({"path": name, "digest": dg, "blob": [f.tell(), len(data)]})
                    f.write(data)
            manifest = {
                "format": "nemo-dcr-delta", "version": VERSION,
                "layout": "dir" if new.is_dir else "file",
                "files": files, "tensors": w.columns(), "chunk_lengths": w.lengths,
                "old_digest": w.old_digest.hexdigest(), "new_digest": w.new_digest.hexdigest(),
                "bound_bits": {k: round(v) for k, v in w.bounds.items()}, "totals": w.totals,
                "other_files": others, "removed": sorted(set(old.where) - set(new.where)),
            }
            mbytes = dump_manifest(manifest)
            moff = f.tell()
            f.write(mbytes)
            footer = _FOOT.pack(moff, len(mbytes), xxhash.xxh3_64_intdigest(mbytes),
                                END_MAGIC if key is None else SIGNED_MAGIC)
            if f.mac is not None:
                f.mac.update(footer)  # the footer is signed too: it says where the manifest is
                raw.write(f.mac.digest())
            raw.write(footer)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, out_path)
        prog.tick(force=True)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return manifest


class _Writer:
    """diff's chunk writer: each tensor's chunks, or its changes held for a batched chunk, and
    the manifest's columns (in header order) as it goes."""

    def __init__(self, f: _Out, span: int, level: int, context: bool):
        self.f, self.span, self.level, self.context = f, span, level, context
        self.lengths: list[int] = []  # every chunk's length, in file order
        self.mode, self.changed, self.chunks = [], [], []  # per tensor
        self.pending: list[tuple] = []  # (manifest index, name, numel, delta) held for a batch
        self.pending_dtype = None
        self.old_digest, self.new_digest = xxhash.xxh3_128(), xxhash.xxh3_128()
        self.bounds = {"positions": 0.0, "xor": 0.0, "ulp": 0.0}
        self.totals = {"params": 0, "dense_bytes": 0, "xor_params": 0, "full_bytes": 0}

    def _old(self, was: torch.Tensor) -> torch.Tensor | None:
        return was if self.context else None

    def _write(self, c: bytes) -> int:
        self.f.write(c)
        self.lengths.append(len(c))
        return len(self.lengths) - 1

    def tensor(self, name: str, e: TensorEntry, cur: torch.Tensor, old: Checkpoint) -> None:
        i = len(self.mode)
        self.new_digest.update(bytes.fromhex(codec.tensor_digest(cur)))
        self.totals["params"] += cur.numel()
        self.totals["dense_bytes"] += cur.numel() * cur.element_size()
        same_kind = name in old.where and old.entry(name).dtype == e.dtype and old.entry(name).shape == e.shape
        if not same_kind:
            first = len(self.lengths)
            for c in codec.encode_overwrite(name, cur.contiguous(), span=self.span, level=self.level):
                self._write(c)
                self.totals["full_bytes"] += len(c)
            self.mode.append("f")
            self.changed.append(cur.numel())
            self.chunks.append([first, len(self.lengths) - first])
            return
        was = old.tensor(name).contiguous()
        base = was.clone()  # (take_delta moves it to cur)
        self.old_digest.update(bytes.fromhex(codec.tensor_digest(was)))
        self.totals["xor_params"] += cur.numel()
        d = take_delta(cur, base, keep_new=True)
        b = codec.delta_bound_bits(d)
        self.bounds["positions"] += b["positions"]
        self.bounds["xor"] += b["xor"]
        self.bounds["ulp"] += b["ulp"] if b["ulp"] is not None else b["xor"]
        self.mode.append("x")
        self.changed.append(d.count)
        self.chunks.append([len(self.lengths), 0])
        if d.count == 0:
            return
        batchable = (0 < d.count < BATCH_CHANGES and d.numel <= self.span and d.new is not None
                     and codec.dtype_info(d.dtype).is_float)
        if not batchable:
            for c in codec.encode_delta(name, d, span=self.span, level=self.level, old=self._old(was)):
                self._write(c)
            self.chunks[i] = [self.chunks[i][0], len(self.lengths) - self.chunks[i][0]]
            return
        if self.pending and (self.pending_dtype != d.dtype
                             or sum(p[3].count for p in self.pending) + d.count > BATCH_LIMIT
                             or sum(p[2] for p in self.pending) + d.numel > self.span):
            self.flush()
        self.pending.append((i, name, d.numel, d, was))
        self.pending_dtype = d.dtype

    def flush(self) -> None:
        """Write the held tensors' changes as one batched chunk (a lone tensor as its own)."""
        if not self.pending:
            return
        if len(self.pending) == 1:  # a lone tensor as its own chunks (several where it spans more than span)
            i, name, _, d, was = self.pending[0]
            first = len(self.lengths)
            for c in codec.encode_delta(name, d, span=self.span, level=self.level, old=self._old(was)):
                self._write(c)
            self.chunks[i] = [first, len(self.lengths) - first]
        else:
            c = codec.encode_batch(self.pending_dtype, [(name, numel, d.positions, d.xor, d.new)
                                                        for _, name, numel, d, _ in self.pending], level=self.level,
                                   olds=None if not self.context else [was for *_, was in self.pending])
            at = self._write(c)
            for i, *_ in self.pending:
                self.chunks[i] = [at, 1]
        self.pending = []

    def columns(self) -> dict:
        return {"mode": "".join(self.mode), "changed": self.changed, "chunks": self.chunks}


class DeltaFile:
    """A delta file opened for reading: manifest verified, chunks read on demand."""

    def __init__(self, path: str | os.PathLike, key: bytes | None = None):
        """With a key, the file must be signed with it: checked over the whole file before
        anything else is believed (an unsigned or altered file is refused)."""
        self.path = Path(path)
        try:
            self._f = open(self.path, "rb")
        except OSError as exc:
            raise DeltaError(f"{self.path}: cannot open ({exc.strerror})") from None
        size = os.fstat(self._f.fileno()).st_size
        if size < _HEAD.size + _FOOT.size:
            raise DeltaError(f"{self.path}: truncated delta file ({size} bytes)")
        magic, ver, _ = _HEAD.unpack(self._f.read(_HEAD.size))
        if magic != MAGIC:
            raise DeltaError(f"{self.path}: not a nemo-dcr delta file")
        if ver != VERSION:
            raise DeltaError(f"{self.path}: delta format version {ver}, this build reads {VERSION}")
        self._f.seek(size - _FOOT.size)
        footer = self._f.read(_FOOT.size)
        moff, mlen, msum, end = _FOOT.unpack(footer)
        if end == OLD_SIGNED_MAGIC:
            raise DeltaError(f"{self.path}: signed with the old scheme, whose signature did not cover the footer: "
                             "refused; make the delta again with this build")
        if end not in (END_MAGIC, SIGNED_MAGIC):
            raise DeltaError(f"{self.path}: truncated delta file (no footer)")
        self.signed = end == SIGNED_MAGIC
        sig = SIG_BYTES if self.signed else 0
        if mlen > MAX_MANIFEST or moff + mlen + sig != size - _FOOT.size or moff < _HEAD.size:
            raise DeltaError(f"{self.path}: corrupt footer")
        if key is not None:
            self._check_signature(key, moff + mlen, footer)
        self._f.seek(moff)
        mbytes = self._f.read(mlen)
        if xxhash.xxh3_64_intdigest(mbytes) != msum:
            raise DeltaError(f"{self.path}: manifest checksum mismatch (corrupt delta)")
        try:
            self.manifest = load_manifest(mbytes)
        except DeltaError as exc:
            raise DeltaError(f"{self.path}: {exc}") from None
        self.data_end = moff
        self._decoded: tuple[int, dict] | None = None  # the last batched chunk read, by tensor

    def records(self, base_headers: dict[str, bytes]) -> tuple[list[dict], dict[str, str]]:
        """(one record per tensor of NEW, each file's header): the headers NEW shares with BASE
        come from base_headers (file name -> BASE's header bytes), their digests checked."""
        try:
            headers = {f["path"]: _file_header(f, base_headers) for f in self.manifest["files"]}
            return _records(self.manifest, headers), headers
        except DeltaError as exc:
            raise DeltaError(f"{self.path}: {exc}") from None

    def _check_signature(self, key: bytes, signed_end: int, footer: bytes) -> None:
        """The MAC over [0, signed_end) and then the footer, before anything else is believed."""
        if not self.signed:
            raise DeltaError(f"{self.path}: not signed, and a signed delta is required: refused")
        mac = hmac.new(key, digestmod=hashlib.sha256)
        self._f.seek(0)
        left = signed_end
        while left:
            block = self._f.read(min(left, 8 << 20))
            if not block:
                raise DeltaError(f"{self.path}: truncated delta file")
            mac.update(block)
            left -= len(block)
        mac.update(footer)
        if not hmac.compare_digest(mac.digest(), self._f.read(SIG_BYTES)):
            raise DeltaError(f"{self.path}: signature does not match (altered after signing, or another key): "
                             "refused")

    def read(self, span: list[int]) -> bytes:
        off, length = span
        if off < _HEAD.size or off + length > self.data_end:
            raise DeltaError(f"{self.path}: chunk span {span} outside the data section")
        self._f.seek(off)
        data = self._f.read(length)
        if len(data) != length:
            raise DeltaError(f"{self.path}: truncated chunk")
        return data

    def header(self, index: int, span: list[int]) -> codec.ChunkHeader:
        """Chunk `index`'s verified header (the chunk is read whole: its checksum covers it)."""
        try:
            return codec.parse_header(self.read(span))
        except codec.ChunkError as exc:
            raise DeltaError(f"{self.path}: chunk {index}: {exc}") from None

    def parts_for(self, index: int, span: list[int], name: str, old=None,
                  check: Callable[[codec.ChunkHeader], None] | None = None) -> list[codec.DecodedChunk]:
        """Tensor `name`'s changes in chunk `index`: verified, decoded, checked to be this
        tensor's. A batched chunk is decoded once for all of its tensors (patch goes in order).
        old: a tensor's chunk header -> BASE's flat tensor (context-coded chunks read it).
        check: called with every tensor's header in the chunk before anything is decoded (the
        sizes a header claims are checked against their targets before they are allocated)."""
        if self._decoded is None or self._decoded[0] != index:
            buf = self.read(span)
            h = codec.parse_header(buf)
            if check is not None:
                for part in h.parts():
                    check(part)
            self._decoded = (index, {d.header.name: d for d in codec.decode_parts(buf, h, old)})
        d = self._decoded[1].get(name)
        if d is None:
            raise DeltaError(f"{self.path}: chunk {index} holds no changes of {name!r} (corrupt manifest)")
        return [d]

    def close(self) -> None:
        self._f.close()


def stats(delta_path: str | os.PathLike) -> dict:
    """Size, change rate and information bound of a delta file (from its manifest)."""
    d = DeltaFile(delta_path)
    m = d.manifest
    d.close()
    t, tot, bb = m["tensors"], m["totals"], m["bound_bits"]
    size = os.path.getsize(delta_path)
    payload = sum(m["chunk_lengths"])
    changed = sum(c for mode, c in zip(t["mode"], t["changed"], strict=True) if mode == "x")
    xbytes = payload - tot["full_bytes"]
    bx, bu = bb["positions"] + bb["xor"], bb["positions"] + bb["ulp"]
    out = {
        "tensors": len(t["mode"]), "params": tot["params"], "changed": changed,
        "change_rate": changed / tot["xor_params"] if tot["xor_params"] else 0.0,
        "full_tensors": t["mode"].count("f"), "removed_tensors": len(m["removed"]),
        "bytes": size, "payload_bytes": payload, "dense_bytes": tot["dense_bytes"],
        "bits_per_param": 8 * payload / tot["params"] if tot["params"] else 0.0,
        "ratio_vs_dense": tot["dense_bytes"] / size,
        "xor_bound_bytes": bx / 8, "ulp_bound_bytes": bu / 8,
        "efficiency_vs_xor_bound": (bx / 8) / xbytes if xbytes else 1.0,
        "efficiency_vs_ulp_bound": (bu / 8) / xbytes if xbytes else 1.0,
    }
    # Whole file: every byte a receiver downloads (manifest, chunk headers, tensors sent whole),
    # against the bound plus what must be sent whole anyway. Real checkpoints have hundreds of
    # tensors, and their per-tensor costs hide behind the payload-only figure.
    out["efficiency_whole_vs_xor_bound"] = (bx / 8 + tot["full_bytes"]) / size if size else 1.0
    out["efficiency_whole_vs_ulp_bound"] = (bu / 8 + tot["full_bytes"]) / size if size else 1.0
    out["non_payload_bytes"] = size - payload
    return out


__all__ = ["DeltaError", "DeltaFile", "diff", "stats", "CheckpointError", "dump_manifest", "load_manifest"]
