"""File-level deltas between two safetensors checkpoints (`nemo-dcr diff / patch / stats`).

A delta file is the codec's chunks back to back, then a JSON manifest, then a fixed footer
(docs/FORMAT.md): the writer streams chunks as they are encoded and needs no second pass.
The manifest names every tensor of NEW with its dtype, shape, digests of the old and new
bits and its chunks, plus each safetensors header of NEW verbatim, so `patch` rebuilds
NEW's files byte for byte. Patching verifies everything it can before writing (manifest
checksum, base digests), writes into a temporary path and renames it into place only when
every tensor's new digest matched: a bad delta or a wrong base leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
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
from nemo_dcr_callback.core.bitops import bits
from nemo_dcr_callback.sender.delta import take_delta
from nemo_dcr_callback.tools.checkpoint import Checkpoint, CheckpointError, TensorEntry, write_safetensors

MAGIC = b"DCRD"
END_MAGIC = b"DCRDEND\x00"
SIGNED_MAGIC = b"DCRDSIG\x00"  # the footer of a signed file: an HMAC-SHA256 sits before it
SIG_BYTES = 32
MIN_KEY_BYTES = 16
VERSION = 1
_HEAD = struct.Struct("<4sHH")  # magic, version, reserved
_FOOT = struct.Struct("<QQQ8s")  # manifest offset, manifest length, xxh3-64 of manifest, end magic
MAX_MANIFEST = 1 << 30


class DeltaError(ValueError):
    """A delta file that is corrupt, truncated, of another version or for another base."""


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
         key: bytes | None = None) -> dict:
    """Write the delta OLD -> NEW to out_path (atomically). Returns the manifest. With a key,
    the file is signed: an HMAC-SHA256 of everything before it (docs/FORMAT.md), for deltas
    passed between parties, where the unkeyed checksums prove nothing."""
    out_path = Path(out_path)
    _check_output(out_path, [Path(old_path), Path(new_path)], force)
    old, new = Checkpoint(old_path), Checkpoint(new_path)
    fd, tmp = tempfile.mkstemp(prefix=out_path.name + ".", suffix=".tmp", dir=out_path.parent or ".")
    tensors, files = [], []
    prog = _Progress("diff", len(new.where), quiet=quiet)
    try:
        with os.fdopen(fd, "wb") as raw:
            f = _Out(raw, hmac.new(key, digestmod=hashlib.sha256) if key is not None else None)
            f.write(_HEAD.pack(MAGIC, VERSION, 0))
            for fname, sf in new.files.items():
                files.append({"path": fname, "header": sf.header_bytes.decode()})
                for name, e in sorted(sf.entries.items(), key=lambda kv: kv[1].begin):
                    cur = sf.tensor(name)
                    rec = {"name": name, "file": fname, "dtype": e.dtype, "shape": list(e.shape),
                           "numel": cur.numel(), "new_digest": codec.tensor_digest(cur)}
                    same_kind = (name in old.where and old.entry(name).dtype == e.dtype
                                 and old.entry(name).shape == e.shape)
                    if same_kind:
                        base = old.tensor(name).clone()
                        rec["old_digest"] = codec.tensor_digest(base)
                        d = take_delta(cur, base, keep_new=True)
                        chunks = codec.encode_delta(name, d, span=span, level=level)
                        rec.update(mode="xor", changed=d.count, bound_bits=codec.delta_bound_bits(d))
                    else:
                        chunks = codec.encode_overwrite(name, cur.contiguous(), span=span, level=level)
                        rec.update(mode="full", changed=cur.numel(), old_digest=None)
                    spans = []
                    for c in chunks:
                        spans.append([f.tell(), len(c)])
                        f.write(c)
                    rec["chunks"] = spans
                    rec["bytes"] = sum(s[1] for s in spans)
                    tensors.append(rec)
                    prog.add(e.end - e.begin)
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
                "files": files, "tensors": tensors, "other_files": others,
                "removed": sorted(set(old.where) - set(new.where)),
            }
            mbytes = json.dumps(manifest, separators=(",", ":")).encode()
            moff = f.tell()
            f.write(mbytes)
            if f.mac is not None:
                raw.write(f.mac.digest())
            raw.write(_FOOT.pack(moff, len(mbytes), xxhash.xxh3_64_intdigest(mbytes),
                                 END_MAGIC if key is None else SIGNED_MAGIC))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, out_path)
        prog.tick(force=True)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return manifest


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
        moff, mlen, msum, end = _FOOT.unpack(self._f.read(_FOOT.size))
        if end not in (END_MAGIC, SIGNED_MAGIC):
            raise DeltaError(f"{self.path}: truncated delta file (no footer)")
        self.signed = end == SIGNED_MAGIC
        sig = SIG_BYTES if self.signed else 0
        if mlen > MAX_MANIFEST or moff + mlen + sig != size - _FOOT.size or moff < _HEAD.size:
            raise DeltaError(f"{self.path}: corrupt footer")
        if key is not None:
            self._check_signature(key, moff + mlen)
        self._f.seek(moff)
        mbytes = self._f.read(mlen)
        if xxhash.xxh3_64_intdigest(mbytes) != msum:
            raise DeltaError(f"{self.path}: manifest checksum mismatch (corrupt delta)")
        try:
            self.manifest = json.loads(mbytes)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise DeltaError(f"{self.path}: manifest is not JSON") from None
        if self.manifest.get("format") != "nemo-dcr-delta" or self.manifest.get("version") != VERSION:
            raise DeltaError(f"{self.path}: unsupported manifest")
        try:
            _check_manifest(self.manifest)
        except DeltaError as exc:
            raise DeltaError(f"{self.path}: {exc}") from None
        self.data_end = moff

    def _check_signature(self, key: bytes, signed_end: int) -> None:
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

    def close(self) -> None:
        self._f.close()


def _safe_name(p) -> str:
    """A manifest's file path must be a plain file name: the checksum is unkeyed, so an edited
    manifest is re-signed at will, and only this check keeps patch inside OUT."""
    if (not isinstance(p, str) or not p or p in (".", "..") or "/" in p or "\\" in p or "\0" in p
            or Path(p).is_absolute()):
        raise DeltaError(f"manifest names the file {p!r}: only plain file names inside OUT are allowed")
    return p


def _check_manifest(m: dict) -> None:
    """Refuse a manifest whose paths leave OUT or whose records disagree, before any write."""
    if m.get("layout") not in ("dir", "file"):
        raise DeltaError(f"unknown layout {m.get('layout')!r}")
    files = [_safe_name(f.get("path") if isinstance(f, dict) else None) for f in m.get("files", [])]
    others = [_safe_name(o.get("path") if isinstance(o, dict) else None) for o in m.get("other_files", [])]
    for p in files:
        if not p.endswith(".safetensors"):
            raise DeltaError(f"manifest file {p!r} is not a .safetensors file")
    names = files + others
    if len(set(names)) != len(names):
        raise DeltaError("manifest names a file twice")
    if m["layout"] == "file" and (len(files) != 1 or others):
        raise DeltaError("single-file delta with several files")
    for rec in m.get("tensors", []):
        if rec.get("file") not in files:
            raise DeltaError(f"tensor {rec.get('name')!r} is in {rec.get('file')!r}, which the manifest does not write")
        if rec.get("mode") not in ("xor", "full"):
            raise DeltaError(f"tensor {rec.get('name')!r}: unknown mode {rec.get('mode')!r}")
        shape = rec.get("shape")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or rec.get("numel") != math.prod(shape)):
            raise DeltaError(f"tensor {rec.get('name')!r}: numel {rec.get('numel')!r} does not match shape {shape!r}")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) << 10 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def _check_room(m: dict, parent: Path) -> None:
    """Sizes come from the manifest, which whoever made the delta wrote: a claim larger than
    the disk (the new files) or the memory (a tensor sent whole is built in memory) is refused
    with the figures, before anything is written or allocated."""
    need = 0
    for f in m["files"]:
        entries = _entries_from_header(f["header"])
        need += 8 + len(f["header"].encode()) + max((e.end for e in entries.values()), default=0)
    free = shutil.disk_usage(parent).free
    if need > free:
        raise DeltaError(f"the new checkpoint takes {need / 1e9:.1f} GB by the delta's manifest, more than the "
                         f"{free / 1e9:.1f} GB free at {parent}: refused (a wrong or crafted delta?)")
    mem = _mem_available()
    for rec in m["tensors"]:
        size = rec["numel"] * codec.dtype_info(rec["dtype"]).width
        if rec["mode"] == "full" and mem is not None and size > mem:
            raise DeltaError(f"tensor {rec['name']!r} is sent whole and takes {size / 1e9:.1f} GB by the delta's "
                             f"manifest, more than the {mem / 1e9:.1f} GB of memory available: refused")


def _entries_from_header(header: str) -> dict[str, TensorEntry]:
    try:
        h = json.loads(header)
        h.pop("__metadata__", None)
        out = {n: TensorEntry(n, e["dtype"], tuple(e["shape"]), *e["data_offsets"]) for n, e in h.items()}
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise DeltaError(f"a file's safetensors header in the manifest is malformed ({type(exc).__name__})") from None
    for e in out.values():
        if not (isinstance(e.begin, int) and isinstance(e.end, int) and 0 <= e.begin <= e.end):
            raise DeltaError(f"tensor {e.name!r}: bad data offsets in its file's header")
    return out


def _rebuild_tensor(base: Checkpoint, dfile: DeltaFile, rec: dict) -> torch.Tensor:
    """NEW's bits of one tensor: BASE's bits (or zeros for a tensor sent whole) with every
    chunk applied, then checked against the delta's digest of the new bits."""
    name = rec["name"]
    info = codec.dtype_info(rec["dtype"])
    if rec["mode"] == "xor":
        target = base.tensor(name).contiguous().clone().reshape(-1)
    else:
        target = torch.zeros(rec["numel"], dtype=info.torch)
    for span in rec["chunks"]:
        codec.apply_chunk(dfile.read(span), target, name)
    if codec.tensor_digest(target) != rec["new_digest"]:
        raise DeltaError(f"tensor {name!r}: result digest differs from the delta's (corrupt delta or wrong base)")
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
    for rec in m["tensors"]:
        if rec["mode"] != "xor":
            continue
        name = rec["name"]
        if name not in base.where:
            raise DeltaError(f"BASE has no tensor {name!r}: wrong base for this delta")
        e = base.entry(name)
        if e.dtype != rec["dtype"] or list(e.shape) != rec["shape"]:
            raise DeltaError(f"BASE tensor {name!r} is {e.dtype}{list(e.shape)}, the delta expects "
                             f"{rec['dtype']}{rec['shape']}: wrong base")
        if codec.tensor_digest(base.tensor(name)) != rec["old_digest"]:
            raise DeltaError(f"BASE tensor {name!r} does not match the delta's base (digest differs): "
                             "wrong base or a different version")
    for o in m["other_files"]:
        if o.get("same") and (not base.is_dir or o["path"] not in base.other_files):
            raise DeltaError(f"BASE lacks {o['path']!r}, which the delta takes from the base")

    # 2. Build NEW in a temporary path next to OUT, if there is room for it.
    parent = out_path.parent if str(out_path.parent) else Path(".")
    _check_room(m, parent)
    tmp = Path(tempfile.mkdtemp(prefix=out_path.name + ".", suffix=".tmp", dir=parent))
    by_file: dict[str, list[dict]] = {}
    for rec in m["tensors"]:
        by_file.setdefault(rec["file"], []).append(rec)
    prog = _Progress("patch", len(m["tensors"]), quiet=quiet)
    try:
        for fentry in m["files"]:
            recs = {r["name"]: r for r in by_file.get(fentry["path"], [])}
            entries = _entries_from_header(fentry["header"])
            if set(entries) != set(recs):
                raise DeltaError(f"manifest for {fentry['path']} does not match its header")
            for name, e in entries.items():
                r = recs[name]
                if e.dtype != r["dtype"] or list(e.shape) != r["shape"]:
                    raise DeltaError(f"manifest for {fentry['path']}: tensor {name!r} differs from its header")

            def build(name: str, recs: dict = recs) -> torch.Tensor:
                t = _rebuild_tensor(base, dfile, recs[name])
                prog.add(t.numel() * t.element_size())
                return t

            write_safetensors(tmp / fentry["path"], fentry["header"].encode(), entries, build)
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
    params = sum(r["numel"] for r in m["tensors"])
    dense = sum(r["numel"] * codec.dtype_info(r["dtype"]).width for r in m["tensors"])
    xor = [r for r in m["tensors"] if r["mode"] == "xor"]
    changed = sum(r["changed"] for r in xor)
    payload = sum(r["bytes"] for r in m["tensors"])
    full = [r for r in m["tensors"] if r["mode"] == "full"]
    bx = sum(r["bound_bits"]["positions"] + r["bound_bits"]["xor"] for r in xor)
    bu = sum(r["bound_bits"]["positions"] + (r["bound_bits"]["ulp"] if r["bound_bits"]["ulp"] is not None
                                              else r["bound_bits"]["xor"]) for r in xor)
    xbytes = sum(r["bytes"] for r in xor)
    xparams = sum(r["numel"] for r in xor)
    out = {
        "tensors": len(m["tensors"]), "params": params, "changed": changed,
        "change_rate": changed / xparams if xparams else 0.0,
        "full_tensors": len(full), "removed_tensors": len(m["removed"]),
        "bytes": os.path.getsize(delta_path), "payload_bytes": payload, "dense_bytes": dense,
        "bits_per_param": 8 * payload / params if params else 0.0,
        "ratio_vs_dense": dense / os.path.getsize(delta_path),
        "xor_bound_bytes": bx / 8, "ulp_bound_bytes": bu / 8,
        "efficiency_vs_xor_bound": (bx / 8) / xbytes if xbytes else 1.0,
        "efficiency_vs_ulp_bound": (bu / 8) / xbytes if xbytes else 1.0,
    }
    # Whole file: every byte a receiver downloads (manifest, chunk headers, tensors sent whole),
    # against the bound plus what must be sent whole anyway. Real checkpoints have hundreds of
    # tensors, and their per-tensor costs hide behind the payload-only figure.
    size = os.path.getsize(delta_path)
    whole = sum(r["bytes"] for r in full)
    out["efficiency_whole_vs_xor_bound"] = (bx / 8 + whole) / size if size else 1.0
    out["efficiency_whole_vs_ulp_bound"] = (bu / 8 + whole) / size if size else 1.0
    out["non_payload_bytes"] = size - payload
    return out


__all__ = ["DeltaError", "DeltaFile", "diff", "patch", "stats", "CheckpointError"]
