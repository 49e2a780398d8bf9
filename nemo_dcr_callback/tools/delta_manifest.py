"""The delta file's manifest (docs/FORMAT.md, "Delta file"): stored as zstd-compressed JSON,
checked before anything is believed, and joined with the files' safetensors headers into one
record per tensor. Whoever made a delta wrote its manifest (its checksum is unkeyed), so every
path, index and size in it is checked here."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import xxhash
import zstandard

from nemo_dcr_callback import codec
from nemo_dcr_callback.codec.checkpoint import TensorEntry

VERSION = 2
HEAD_BYTES = 8  # the file header before the first chunk
MAX_MANIFEST = 64 << 20  # stored (compressed) manifest bytes, at most
# The JSON a manifest may inflate to: at most this, and at most EXPANSION times its stored
# size (plus 1 MiB). Honest manifests compress 5-20x at level 19; a crafted frame can claim
# anything, and python-zstandard allocates what a frame declares whatever max_output_size says.
MAX_MANIFEST_JSON = 64 << 20
EXPANSION = 256
_MZ = zstandard.ZstdCompressor(level=19)  # the manifest is small: the strongest level costs little


class DeltaError(ValueError):
    """A delta file that is corrupt, truncated, of another version or for another base."""


def _safe_name(p) -> str:
    """A manifest's file path must be a plain file name: the checksum is unkeyed, so an edited
    manifest is re-signed at will, and only this check keeps patch inside OUT."""
    if (not isinstance(p, str) or not p or p in (".", "..") or "/" in p or "\\" in p or "\0" in p
            or Path(p).is_absolute()):
        raise DeltaError(f"manifest names the file {p!r}: only plain file names inside OUT are allowed")
    return p


def load_manifest(mbytes: bytes) -> dict:
    """The manifest object from its stored bytes (zstd, bounded), its format and version checked."""
    try:
        declared = zstandard.frame_content_size(mbytes)
    except zstandard.ZstdError:
        declared = -2
    limit = min(MAX_MANIFEST_JSON, EXPANSION * len(mbytes) + (1 << 20))
    if declared > limit:
        raise DeltaError(f"manifest declares {declared} bytes of JSON, more than this delta may hold ({limit}): "
                         "refused (corrupt or crafted delta)")
    if declared == -1:  # the writer always records the size; without it the allocation is unbounded
        raise DeltaError("manifest frame does not declare its size: refused (corrupt or crafted delta)")
    try:
        d = zstandard.ZstdDecompressor().decompressobj()
        raw = d.decompress(mbytes)
        # One frame and nothing after it: bytes past the frame are not the manifest (a reader
        # that ignored them let a footer point at a manifest hidden at the start of a blob).
        if not d.eof or d.unused_data:
            raise DeltaError("manifest has data after its zstd frame, or its frame is cut (corrupt delta)")
    except zstandard.ZstdError:
        if mbytes[:1] == b"{":
            raise DeltaError("delta format version 1 (an uncompressed manifest): this build reads version "
                             f"{VERSION}; make the delta again with this build") from None
        raise DeltaError("manifest does not decompress (corrupt delta)") from None
    try:
        m = json.loads(raw)
    except (ValueError, RecursionError):  # (not JSON, a 5,000-digit number, deep nesting)
        raise DeltaError("manifest is not JSON, or not JSON this reader takes") from None
    if not isinstance(m, dict) or m.get("format") != "nemo-dcr-delta" or m.get("version") != VERSION:
        raise DeltaError(f"unsupported manifest (version {m.get('version') if isinstance(m, dict) else None!r}, "
                         f"this build reads {VERSION})")
    _check_manifest(m)
    return m


def dump_manifest(m: dict) -> bytes:
    return _MZ.compress(json.dumps(m, separators=(",", ":")).encode())


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
    for f in m["files"]:
        if not isinstance(f.get("header"), str) and not isinstance(f.get("header_digest"), str):
            raise DeltaError(f"manifest file {f['path']!r} has neither a header nor a header digest")
    t, lengths = m.get("tensors"), m.get("chunk_lengths")
    if (not isinstance(t, dict) or not isinstance(t.get("mode"), str) or not isinstance(t.get("changed"), list)
            or not isinstance(t.get("chunks"), list) or not isinstance(lengths, list)
            or not len(t["mode"]) == len(t["changed"]) == len(t["chunks"])
            or not all(isinstance(n, int) and n > 0 for n in lengths)):
        raise DeltaError("manifest's tensor table is malformed")
    for c in t["chunks"]:
        if (not isinstance(c, list) or len(c) != 2 or not all(isinstance(x, int) for x in c)
                or c[0] < 0 or c[1] < 0 or c[0] + c[1] > len(lengths)):
            raise DeltaError(f"manifest's tensor table refers to chunks {c!r} of {len(lengths)} (corrupt manifest)")
    # The work patch and stats do per chunk reference: a tensor's own chunks are its alone, and
    # a batched chunk is named once by each tensor in it, so honest references number at most
    # the chunks plus the tensors. 300 tensors naming 20,000 chunks each (an 851-byte manifest)
    # cost 1.36 GB and 13 s before they were refused (issue 46's probe).
    refs = sum(c[1] for c in t["chunks"])
    if refs > len(lengths) + len(t["chunks"]):
        raise DeltaError(f"manifest's tensor table names {refs} chunk references for {len(lengths)} chunks and "
                         f"{len(t['chunks'])} tensors (corrupt or crafted manifest)")
    for o in m.get("other_files", []):
        blob, same = o.get("blob"), o.get("same")
        if not isinstance(o.get("digest"), str) or not (
                (same is True and blob is None) or (same is None and isinstance(blob, list) and len(blob) == 2
                                                    and all(type(x) is int and x >= 0 for x in blob))):
            raise DeltaError(f"manifest's entry for {o['path']!r} is malformed (corrupt manifest)")


def _records(m: dict, headers: dict[str, str]) -> list[dict]:
    """One record per tensor of NEW (name, file, dtype, shape, numel, mode, changed, chunk
    indices and spans), joined from the files' headers and the manifest's tensor table."""
    offsets, at = [], HEAD_BYTES
    for n in m["chunk_lengths"]:
        offsets.append(at)
        at += n
    t = m["tensors"]
    recs, k = [], 0
    for f in m["files"]:
        entries = sorted(_entries_from_header(headers[f["path"]]).values(), key=lambda e: e.begin)
        for e in entries:
            if k >= len(t["mode"]):
                raise DeltaError(f"manifest's tensor table is shorter than the headers ({k} tensors)")
            mode = {"x": "xor", "f": "full"}.get(t["mode"][k])
            if mode is None:
                raise DeltaError(f"tensor {e.name!r}: unknown mode {t['mode'][k]!r}")
            first, n = t["chunks"][k]
            recs.append({"name": e.name, "file": f["path"], "dtype": e.dtype, "shape": list(e.shape),
                         "numel": math.prod(e.shape), "mode": mode, "changed": t["changed"][k],
                         "chunks": [(i, [offsets[i], m["chunk_lengths"][i]]) for i in range(first, first + n)]})
            k += 1
    if k != len(t["mode"]):
        raise DeltaError(f"manifest's tensor table has {len(t['mode'])} tensors, the headers {k}")
    return recs


def _file_header(f: dict, base_headers: dict[str, bytes]) -> str:
    """A file's safetensors header: in the manifest, or BASE's where NEW's is the same (its
    digest checked)."""
    if isinstance(f.get("header"), str):
        return f["header"]
    h = base_headers.get(f["path"])
    if h is None or xxhash.xxh3_128_hexdigest(h) != f["header_digest"]:
        raise DeltaError(f"{f['path']}: the delta takes its header from BASE, and BASE's differs: wrong base")
    return h.decode()


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


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) << 10 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def _check_room(headers: dict[str, str], recs: list[dict], parent: Path) -> None:
    """Sizes come from the manifest, which whoever made the delta wrote: a claim larger than
    the disk (the new files) or the memory (a tensor sent whole is built in memory) is refused
    with the figures, before anything is written or allocated."""
    need = 0
    for header in headers.values():
        entries = _entries_from_header(header)
        need += 8 + len(header.encode()) + max((e.end for e in entries.values()), default=0)
    free = shutil.disk_usage(parent).free
    if need > free:
        raise DeltaError(f"the new checkpoint takes {need / 1e9:.1f} GB by the delta's manifest, more than the "
                         f"{free / 1e9:.1f} GB free at {parent}: refused (a wrong or crafted delta?)")
    mem = _mem_available()
    for rec in recs:
        size = rec["numel"] * codec.dtype_info(rec["dtype"]).width
        if rec["mode"] == "full" and mem is not None and size > mem:
            raise DeltaError(f"tensor {rec['name']!r} is sent whole and takes {size / 1e9:.1f} GB by the delta's "
                             f"manifest, more than the {mem / 1e9:.1f} GB of memory available: refused")
