"""File-level deltas between two safetensors checkpoints (`nemo-dcr diff / patch / stats`).

A delta file is the codec's chunks back to back, then a zstd-compressed JSON manifest, then
a fixed footer (docs/FORMAT.md): the writer streams chunks as they are encoded and needs no
second pass. The manifest holds each safetensors header of NEW (or, where it equals BASE's,
its digest only), per tensor in header order its mode, change count and chunks, and digests
of the old and new bits, so `patch` rebuilds NEW's files byte for byte. Tensors with few
changes share batched chunks (one header and one set of entropy tables for many norms,
biases or experts). Patching verifies everything it can before writing (manifest checksum,
base digest), writes into a temporary path and renames it into place only when the new
bits' digest matched: a bad delta or a wrong base leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch
import xxhash

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec.checkpoint import Checkpoint, CheckpointError, TensorEntry, write_safetensors
from nemo_dcr_callback.core.delta import take_delta
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.tools.delta_manifest import (
    MAX_MANIFEST,
    VERSION,
    DeltaError,
    _check_room,
    _entries_from_header,
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

    def parts_for(self, index: int, span: list[int], name: str, old=None) -> list[codec.DecodedChunk]:
        """Tensor `name`'s changes in chunk `index`: verified, decoded, checked to be this
        tensor's. A batched chunk is decoded once for all of its tensors (patch goes in order).
        old: a tensor's chunk header -> BASE's flat tensor (context-coded chunks read it)."""
        if self._decoded is None or self._decoded[0] != index:
            buf = self.read(span)
            h = codec.parse_header(buf)
            self._decoded = (index, {d.header.name: d for d in codec.decode_parts(buf, h, old)})
        d = self._decoded[1].get(name)
        if d is None:
            raise DeltaError(f"{self.path}: chunk {index} holds no changes of {name!r} (corrupt manifest)")
        return [d]

    def close(self) -> None:
        self._f.close()


def _rebuild_tensor(base: Checkpoint, dfile: DeltaFile, rec: dict, new_digest) -> torch.Tensor:
    """NEW's bits of one tensor: BASE's bits (or zeros for a tensor sent whole) with every
    chunk applied; its digest goes into new_digest (checked once every tensor is built)."""
    name = rec["name"]
    info = codec.dtype_info(rec["dtype"])
    if rec["mode"] == "xor":
        target = base.tensor(name).contiguous().clone().reshape(-1)
    else:
        target = torch.zeros(rec["numel"], dtype=info.torch)
    def base_of(h: codec.ChunkHeader) -> torch.Tensor:
        """BASE's bits of a tensor a context-coded chunk holds, checked against the chunk."""
        if h.name not in base.where:
            raise codec.ChunkError(f"chunk holds changes of {h.name!r}, which BASE does not have")
        t = target if h.name == name else base.tensor(h.name).reshape(-1)
        codec.check_target(h, t, h.name)
        return t

    for index, span in rec["chunks"]:
        for d in dfile.parts_for(index, span, name, base_of):
            codec.check_target(d.header, target, name)
            codec.apply_decoded(d, target)
    new_digest.update(bytes.fromhex(codec.tensor_digest(target)))
    return bits(target)


def patch(base_path: str | os.PathLike, delta_path: str | os.PathLike, out_path: str | os.PathLike, *,
          force: bool = False, quiet: bool = False, key: bytes | None = None) -> dict:
    """Rebuild NEW from BASE and a delta into out_path. All or nothing: on any error
    (DeltaError, codec.ChunkError, CheckpointError) nothing is left at out_path and BASE is
    untouched (it is only ever read). With a key, only a delta signed with it is taken."""
    dfile = DeltaFile(delta_path, key)
    m = dfile.manifest
    base = Checkpoint(base_path)
    out_path = Path(out_path)
    is_dir = m["layout"] == "dir"
    if out_path.exists() and not force and (not out_path.is_dir() or any(out_path.iterdir())):
        raise FileExistsError(f"{out_path} exists (use --force to replace it)")
    if out_path.resolve() == Path(base_path).resolve():
        raise ValueError("OUT must differ from BASE (BASE is never modified)")

    # 1. The base must be the delta's base, checked before anything is written.
    recs, headers = dfile.records({name: sf.header_bytes for name, sf in base.files.items()})
    old_digest = xxhash.xxh3_128()
    for rec in recs:
        if rec["mode"] != "xor":
            continue
        name = rec["name"]
        if name not in base.where:
            raise DeltaError(f"BASE has no tensor {name!r}: wrong base for this delta")
        e = base.entry(name)
        if e.dtype != rec["dtype"] or list(e.shape) != rec["shape"]:
            raise DeltaError(f"BASE tensor {name!r} is {e.dtype}{list(e.shape)}, the delta expects "
                             f"{rec['dtype']}{rec['shape']}: wrong base")
        old_digest.update(bytes.fromhex(codec.tensor_digest(base.tensor(name))))
    if old_digest.hexdigest() != m["old_digest"]:
        raise DeltaError("BASE does not match the delta's base (the digest of its tensors differs): wrong base or "
                         "a different version")
    for o in m["other_files"]:
        if o.get("same") and (not base.is_dir or o["path"] not in base.other_files):
            raise DeltaError(f"BASE lacks {o['path']!r}, which the delta takes from the base")

    # 2. Build NEW in a temporary path next to OUT, if there is room for it.
    parent = out_path.parent if str(out_path.parent) else Path(".")
    _check_room(headers, recs, parent)
    tmp = Path(tempfile.mkdtemp(prefix=out_path.name + ".", suffix=".tmp", dir=parent))
    by_file: dict[str, list[dict]] = {}
    for rec in recs:
        by_file.setdefault(rec["file"], []).append(rec)
    prog = _Progress("patch", len(recs), quiet=quiet)
    new_digest = xxhash.xxh3_128()
    try:
        for fentry in m["files"]:
            frecs = {r["name"]: r for r in by_file.get(fentry["path"], [])}
            entries = _entries_from_header(headers[fentry["path"]])

            def build(name: str, frecs: dict = frecs) -> torch.Tensor:
                t = _rebuild_tensor(base, dfile, frecs[name], new_digest)
                prog.add(t.numel() * t.element_size())
                return t

            # (write_safetensors builds the tensors in offset order, the manifest's order)
            write_safetensors(tmp / fentry["path"], headers[fentry["path"]].encode(), entries, build)
        if new_digest.hexdigest() != m["new_digest"]:
            raise DeltaError("the rebuilt tensors' digest differs from the delta's (corrupt delta or wrong base)")
        for o in m["other_files"]:
            dst = tmp / o["path"]
            if o.get("same"):
                shutil.copyfile(base.path / o["path"], dst)
            else:
                dst.write_bytes(dfile.read(o["blob"]))
            if file_digest(dst) != o["digest"]:
                raise DeltaError(f"{o['path']}: digest differs from the delta's")
        # 3. Move into place.
        if is_dir:
            if out_path.exists():
                shutil.rmtree(out_path)
            os.replace(tmp, out_path)
        else:
            if len(m["files"]) != 1:
                raise DeltaError("single-file delta with several files")
            os.replace(tmp / m["files"][0]["path"], out_path)
            shutil.rmtree(tmp)
        prog.tick(force=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        dfile.close()
    return m


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


__all__ = ["DeltaError", "DeltaFile", "diff", "patch", "stats", "CheckpointError", "dump_manifest", "load_manifest"]
