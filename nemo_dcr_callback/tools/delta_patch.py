"""`nemo-dcr patch`: NEW rebuilt from BASE and a delta file (tools/deltafile.py reads it).

All or nothing: the base is checked against the delta's digest before anything is written,
every chunk's tensors against their targets before the chunk is decoded, the rebuilt tensors'
digest before the result is moved into place; on any error nothing is left at OUT, and BASE
(only ever read) and the delta are never inside what OUT replaces.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
import xxhash

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec.checkpoint import Checkpoint, write_safetensors
from nemo_dcr_callback.core.rawbits import bits
from nemo_dcr_callback.tools.delta_manifest import DeltaError, _check_room, _entries_from_header
from nemo_dcr_callback.tools.deltafile import DeltaFile, _Progress, file_digest


def _rebuild_tensor(base: Checkpoint, dfile: DeltaFile, rec: dict, new_digest, recs: dict[str, dict]) -> torch.Tensor:
    """NEW's bits of one tensor: BASE's bits (or zeros for a tensor sent whole) with every
    chunk applied; its digest goes into new_digest (checked once every tensor is built).
    recs: every tensor's record by name (a batched chunk's other members are checked against
    theirs before the chunk is decoded)."""
    name = rec["name"]
    info = codec.dtype_info(rec["dtype"])
    if rec["mode"] == "xor":
        target = base.tensor(name).contiguous().clone().reshape(-1)
    else:
        _check_whole(dfile, rec)
        target = torch.zeros(rec["numel"], dtype=info.torch)
    def base_of(h: codec.ChunkHeader) -> torch.Tensor:
        """BASE's bits of a tensor a context-coded chunk holds (its header passed `check`)."""
        if h.name not in base.where:
            raise codec.ChunkError(f"chunk holds changes of {h.name!r}, which BASE does not have")
        return target if h.name == name else base.tensor(h.name).reshape(-1)

    def check(h: codec.ChunkHeader) -> None:
        """Every tensor's header in a chunk, against its target (this tensor) or its record (a
        batch's other members, whose BASE tensors step 1 matched to their records), before
        anything is decoded: decoding allocates what a header claims (a 5.7 KB delta claiming
        2^24 changes took 478 MB resident before its refusal, tests/security/test_patch_limits.py)."""
        if h.name == name:
            codec.check_target(h, target, name)
            return
        other = recs.get(h.name)
        if other is None:
            raise codec.ChunkError(f"chunk holds changes of {h.name!r}, which the delta's manifest does not list")
        if h.dtype.torch != codec.dtype_info(other["dtype"]).torch or h.numel != other["numel"]:
            raise codec.ChunkError(f"chunk for {h.name!r} spans {h.numel} {h.dtype.name} elements, the manifest "
                                   f"says {other['numel']} {other['dtype']}")

    for index, span in rec["chunks"]:
        for d in dfile.parts_for(index, span, name, base_of, check):
            codec.apply_decoded(d, target)
    new_digest.update(bytes.fromhex(codec.tensor_digest(target)))
    return bits(target)


def _check_whole(dfile: DeltaFile, rec: dict) -> None:
    """A tensor sent whole is allocated at its full size: its chunks must cover it back to
    back before that (a tiny delta claiming a huge tensor and no chunks had it allocated and
    written out before the digest refused it, issue 66). Its chunks are read twice then: such
    tensors are new ones or of a new shape or dtype, a small part of a delta."""
    name, numel, covered = rec["name"], rec["numel"], 0
    info = codec.dtype_info(rec["dtype"])
    for index, span in rec["chunks"]:
        h = dfile.header(index, span)
        if (h.batched or h.name != name or h.kind != codec.Kind.OVERWRITE or h.dtype.torch != info.torch
                or h.numel != numel or h.lo != covered or h.count != h.hi - h.lo):
            raise DeltaError(f"tensor {name!r} is sent whole, but chunk {index} is not the next dense part of it "
                             f"({h.name!r}, {h.kind.name} {h.dtype.name}, [{h.lo}, {h.hi}) of {h.numel} elements, "
                             f"{h.count} changes; expected from {covered} of {numel})")
        covered = h.hi
    if covered != numel:
        raise DeltaError(f"tensor {name!r} is sent whole, but its chunks cover {covered} of its {numel} elements: "
                         "refused before allocating it (corrupt or crafted delta)")


def _within(p: Path, folder: Path) -> bool:
    p, folder = p.resolve(), folder.resolve()
    return p == folder or folder in p.parents


def _check_patch_output(out_path: Path, base_path: Path, delta_path: Path) -> None:
    """OUT is replaced whole (with --force): it must not be, hold or lie inside BASE, nor hold
    the delta (`patch --force -o <the folder holding BASE>` deleted BASE, the delta and
    everything else there)."""
    if _within(base_path, out_path):
        raise ValueError(f"OUT {out_path} is or holds BASE {base_path}: BASE is never modified, even with --force")
    if base_path.is_dir() and _within(out_path, base_path):
        raise ValueError(f"OUT {out_path} is inside BASE {base_path}: BASE is never modified")
    if _within(delta_path, out_path):
        raise ValueError(f"OUT {out_path} holds the delta {delta_path}: it would be deleted, even with --force")


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
    _check_patch_output(out_path, Path(base_path), Path(delta_path))

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
    all_recs = {r["name"]: r for r in recs}
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
                t = _rebuild_tensor(base, dfile, frecs[name], new_digest, all_recs)
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
