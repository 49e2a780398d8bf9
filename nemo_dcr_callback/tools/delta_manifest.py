"""The delta file's manifest (docs/FORMAT.md, "Delta file"): stored as zstd-compressed JSON,
checked before anything is believed, and joined with the files' safetensors headers into one
record per tensor. Whoever made a delta wrote its manifest (its checksum is unkeyed), so every
path, index and size in it is checked here."""

from __future__ import annotations

import json
import math
import re
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
# What parsing a manifest may take, estimated from its bytes before json.loads builds anything:
# the text, its strings (at most the text again, or four times it where an escape beyond
# U+00FF makes a string wide) and PARSE_ITEM_BYTES per container or element, above the most
# json builds for one `{`, `[` or `,` (a dict counts twice: its first entry has no comma). The
# count includes the headers carried as strings, since they are parsed too. The frame's bounds
# alone let a small delta hold millions of `{}`, each an object of its own (issue 66).
PARSE_BUDGET = 192 << 20
PARSE_ITEM_BYTES = 144
MAX_INT = (1 << 63) - 1  # any count, size or offset in a manifest or a header
MAX_FILE_NAME = 255  # bytes: the usual NAME_MAX (a longer name failed only when written)
_WIDE = re.compile(rb"\\u(?!00)")
_HEX = re.compile(r"[0-9a-f]{32}")
_MZ = zstandard.ZstdCompressor(level=19)  # the manifest is small: the strongest level costs little


class DeltaError(ValueError):
    """A delta file that is corrupt, truncated, of another version or for another base."""


def _safe_name(p) -> str:
    """A manifest's file path must be a plain file name: the checksum is unkeyed, so an edited
    manifest is re-signed at will, and only this check keeps patch inside OUT."""
    shown = f"{p[:80]!r}" if isinstance(p, str) else _kind(p)
    if (not isinstance(p, str) or not p or p in (".", "..") or "/" in p or "\\" in p or "\0" in p
            or Path(p).is_absolute()):
        raise DeltaError(f"manifest names the file {shown}: only plain file names inside OUT are allowed")
    try:
        size = len(p.encode())
    except UnicodeEncodeError:  # (a lone surrogate escaped in the JSON)
        raise DeltaError(f"manifest names the file {shown}, which is not UTF-8") from None
    if size > MAX_FILE_NAME:
        raise DeltaError(f"manifest names a file of {size} bytes ({shown}): longer than a file name may be "
                         f"({MAX_FILE_NAME})")
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
    check_json_cost(raw, "manifest")
    text = raw.decode("ascii")
    del raw  # (the text and what is built from it are what the estimate allowed for)
    try:
        m = json.loads(text)
    except (ValueError, RecursionError):  # (not JSON, a 5,000-digit number, deep nesting)
        raise DeltaError("manifest is not JSON, or not JSON this reader takes") from None
    del text
    if not isinstance(m, dict) or m.get("format") != "nemo-dcr-delta" or m.get("version") != VERSION:
        raise DeltaError(f"unsupported manifest (version {m.get('version') if isinstance(m, dict) else None!r}, "
                         f"this build reads {VERSION})")
    _check_manifest(m)
    return m


def dump_manifest(m: dict) -> bytes:
    return _MZ.compress(json.dumps(m, separators=(",", ":")).encode())


def check_json_cost(raw: bytes, what: str) -> None:
    """Refuse JSON whose parse would take more than PARSE_BUDGET, before anything is built: a
    byte scan, no tokens. The writer escapes every non-ASCII character (json.dumps), so other
    bytes are refused too: an unescaped one could make the whole text four bytes a character."""
    if not raw.isascii():
        raise DeltaError(f"{what} JSON holds bytes beyond ASCII, which the writer escapes: corrupt or crafted {what}")
    items = 2 * raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    wide = b"\\u" in raw and _WIDE.search(raw) is not None
    cost = len(raw) * (5 if wide else 2) + PARSE_ITEM_BYTES * items
    if cost > PARSE_BUDGET:
        raise DeltaError(f"{what} JSON counts {items:,} items (objects twice, lists, elements) in {len(raw):,} bytes: "
                         f"parsing it would take about {cost >> 20} MiB, more than the {PARSE_BUDGET >> 20} MiB a "
                         f"{what} may; refused before parsing (corrupt or crafted delta)")


_MISSING = object()


def _kind(v) -> str:
    """A JSON value as an error message names it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"the boolean {'true' if v else 'false'}"
    if isinstance(v, int):
        return f"the integer {v}" if abs(v) < 1 << 80 else "a huge integer"
    if isinstance(v, float):
        return f"the number {v!r}"
    if isinstance(v, str):
        return f"the string {v[:40]!r}" + ("..." if len(v) > 40 else "")
    return {list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def _bad(path: str, v, want: str) -> DeltaError:
    return DeltaError(f"manifest field {path!r} is malformed: {_kind(v)}, not {want} (corrupt or crafted manifest)")


def _get(obj: dict, key: str, path: str, want: str, ok) -> object:
    """obj[key], which must satisfy ok (a predicate); an error naming the field otherwise."""
    v = obj.get(key, _MISSING)
    if v is _MISSING:
        raise DeltaError(f"manifest has no field {path!r} (corrupt or crafted manifest)")
    if not ok(v):
        raise _bad(path, v, want)
    return v


def _is_uint(v) -> bool:
    return type(v) is int and 0 <= v <= MAX_INT


def _is_text(v) -> bool:
    """A string that can be written: a lone surrogate (an escape in the JSON) cannot."""
    if not isinstance(v, str):
        return False
    try:
        v.encode()
    except UnicodeEncodeError:
        return False
    return True


def _is_hex(v) -> bool:
    return isinstance(v, str) and _HEX.fullmatch(v) is not None


def _is_amount(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and 0 <= v <= MAX_INT


def _items(v: list, path: str, want: str, ok) -> list:
    for i, x in enumerate(v):
        if not ok(x):
            raise _bad(f"{path}[{i}]", x, want)
    return v


def _is_list(v) -> bool:
    return isinstance(v, list)


def _is_dict(v) -> bool:
    return isinstance(v, dict)


def _check_manifest(m: dict) -> None:
    """Every field's type and shape, then: paths inside OUT, the tensor table holding
    together, before any write. Whoever made the delta wrote all of it: a field of another
    type (`"other_files": null`) was a traceback in stats or patch (issue 66's fuzzing)."""
    layout = _get(m, "layout", "layout", "'dir' or 'file'", lambda v: v in ("dir", "file"))
    files = _get(m, "files", "files", "a list of files", lambda v: _is_list(v) and v)
    _items(files, "files", "an object", _is_dict)
    names = []
    for i, f in enumerate(files):
        p = _safe_name(f.get("path"))
        if not p.endswith(".safetensors"):
            raise DeltaError(f"manifest file {p!r} is not a .safetensors file")
        if ("header" in f) == ("header_digest" in f):
            raise DeltaError(f"manifest file {p!r} needs either a header or a header digest, not "
                             f"{'both' if 'header' in f else 'neither'} (corrupt or crafted manifest)")
        if "header" in f:
            _get(f, "header", f"files[{i}].header", "a string of UTF-8", _is_text)
        else:
            _get(f, "header_digest", f"files[{i}].header_digest", "a 32-digit hex digest", _is_hex)
        names.append(p)
    others = _get(m, "other_files", "other_files", "a list", _is_list)
    _items(others, "other_files", "an object", _is_dict)
    for i, o in enumerate(others):
        p = _safe_name(o.get("path"))
        _get(o, "digest", f"other_files[{i}].digest", "a 32-digit hex digest", _is_hex)
        blob, same = o.get("blob"), o.get("same")
        if not ((same is True and blob is None) or (same is None and isinstance(blob, list) and len(blob) == 2
                                                    and all(_is_uint(x) for x in blob))):
            raise DeltaError(f"manifest's entry for {p!r} is malformed: needs \"same\": true or \"blob\": [offset, "
                             "length] (corrupt or crafted manifest)")
        names.append(p)
    if len(set(names)) != len(names):
        raise DeltaError("manifest names a file twice")
    if layout == "file" and (len(files) != 1 or others):
        raise DeltaError("single-file delta with several files")

    t = _get(m, "tensors", "tensors", "an object", _is_dict)
    mode = _get(t, "mode", "tensors.mode", "a string of 'x' and 'f'", lambda v: isinstance(v, str))
    if mode.strip("xf"):
        raise _bad("tensors.mode", mode, "a string of 'x' and 'f' only")
    changed = _items(_get(t, "changed", "tensors.changed", "a list", _is_list), "tensors.changed",
                     "a count of changes", _is_uint)
    chunks = _items(_get(t, "chunks", "tensors.chunks", "a list", _is_list), "tensors.chunks",
                    "[first chunk, number of chunks]",
                    lambda c: isinstance(c, list) and len(c) == 2 and all(_is_uint(x) for x in c))
    lengths = _items(_get(m, "chunk_lengths", "chunk_lengths", "a list", _is_list), "chunk_lengths",
                     "a chunk length", lambda n: _is_uint(n) and n > 0)
    if not len(mode) == len(changed) == len(chunks):
        raise DeltaError(f"manifest's tensor table is malformed: {len(mode)} modes, {len(changed)} change counts, "
                         f"{len(chunks)} chunk lists")
    for c in chunks:
        if c[0] + c[1] > len(lengths):
            raise DeltaError(f"manifest's tensor table refers to chunks {c!r} of {len(lengths)} (corrupt manifest)")
    # The work patch and stats do per chunk reference: a tensor's own chunks are its alone, and
    # a batched chunk is named once by each tensor in it, so honest references number at most
    # the chunks plus the tensors. 300 tensors naming 20,000 chunks each (an 851-byte manifest)
    # cost 1.36 GB and 13 s before they were refused (issue 46's probe).
    refs = sum(c[1] for c in chunks)
    if refs > len(lengths) + len(chunks):
        raise DeltaError(f"manifest's tensor table names {refs} chunk references for {len(lengths)} chunks and "
                         f"{len(chunks)} tensors (corrupt or crafted manifest)")
    for key in ("old_digest", "new_digest"):
        _get(m, key, key, "a 32-digit hex digest", _is_hex)
    bb = _get(m, "bound_bits", "bound_bits", "an object", _is_dict)
    for key in ("positions", "xor", "ulp"):
        _get(bb, key, f"bound_bits.{key}", "a non-negative number", _is_amount)
    tot = _get(m, "totals", "totals", "an object", _is_dict)
    for key in ("params", "dense_bytes", "xor_params", "full_bytes"):
        _get(tot, key, f"totals.{key}", "a non-negative integer", _is_uint)
    _items(_get(m, "removed", "removed", "a list", _is_list), "removed", "a tensor name", lambda v: isinstance(v, str))


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
    """A safetensors header's tensors, each entry checked as the safetensors reader checks a
    file's: a dtype this build reads, offsets spanning exactly the shape's bytes (patch writes
    what the shape takes, whatever the offsets say: a huge tensor claiming a few bytes got past
    the disk check and was written out, issue 66). Where the spans lie is checked by
    _check_room (_check_spans)."""
    try:
        h = json.loads(header)
    except (ValueError, RecursionError):
        raise DeltaError("a file's safetensors header in the manifest is not JSON") from None
    if not isinstance(h, dict):
        raise DeltaError(f"a file's safetensors header in the manifest is {_kind(h)}, not an object")
    h.pop("__metadata__", None)
    out = {}
    for name, e in h.items():
        if not isinstance(e, dict):
            raise DeltaError(f"tensor {name!r}: its header entry is {_kind(e)}, not an object")
        dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in codec.BY_NAME:
            raise DeltaError(f"tensor {name!r}: dtype {_kind(dtype)} is not one this build reads")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise DeltaError(f"tensor {name!r}: its shape is {_kind(shape)}, not a list of sizes")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_uint(x) for x in offs)):
            raise DeltaError(f"tensor {name!r}: its data offsets are {_kind(offs)}, not [begin, end]")
        nbytes = math.prod(shape) * codec.BY_NAME[dtype].width
        if offs[1] - offs[0] != nbytes:
            raise DeltaError(f"tensor {name!r}: data offsets [{offs[0]}, {offs[1]}] span {offs[1] - offs[0]} bytes, "
                             f"its shape {shape} of {dtype} takes {nbytes} (corrupt or crafted header)")
        out[name] = TensorEntry(name, dtype, tuple(shape), offs[0], offs[1])
    return out


def _check_spans(entries: dict[str, TensorEntry]) -> None:
    """A header's spans must lie back to back from 0: patch writes the tensors one after
    another, so a hole or an overlap would leave a file whose header lies about its data."""
    pos = 0
    for e in sorted(entries.values(), key=lambda e: e.begin):
        if e.begin != pos:
            raise DeltaError(f"tensor {e.name!r}: its data starts at {e.begin}, the tensors before it end at {pos} "
                             "(a hole or an overlap in its file's header): refused")
        pos = e.end


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) << 10 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def _check_room(headers: dict[str, str], recs: list[dict], parent: Path) -> None:
    """Sizes come from the manifest, which whoever made the delta wrote: the new files larger
    than the free disk, or a tensor larger than the available memory (each is built in memory
    in turn: BASE's bits copied, or zeros for one sent whole), is refused with the figures
    before anything is written or allocated. The headers' offsets were checked against their
    shapes, so their spans are the bytes that will be written; then they must lie back to back,
    and each tensor's count of changes fit it."""
    need, layouts = 0, []
    for header in headers.values():
        entries = _entries_from_header(header)
        need += 8 + len(header.encode()) + sum(e.end - e.begin for e in entries.values())
        layouts.append(entries)
    free = shutil.disk_usage(parent).free
    if need > free:
        raise DeltaError(f"the new checkpoint takes {need / 1e9:.1f} GB by the delta's manifest, more than the "
                         f"{free / 1e9:.1f} GB free at {parent}: refused (a wrong or crafted delta?)")
    mem = _mem_available()
    if mem is not None and recs:
        rec = max(recs, key=lambda r: r["numel"] * codec.BY_NAME[r["dtype"]].width)
        size = rec["numel"] * codec.BY_NAME[rec["dtype"]].width
        if size > mem:
            raise DeltaError(f"tensor {rec['name']!r} {'is sent whole and ' if rec['mode'] == 'full' else ''}takes "
                             f"{size / 1e9:.1f} GB by the delta's manifest, more than the {mem / 1e9:.1f} GB of "
                             "memory available: refused")
    # (after the sizes, so that a claim too large is refused with its figures)
    for entries in layouts:
        _check_spans(entries)
    for rec in recs:
        if rec["changed"] > rec["numel"] or (rec["mode"] == "full" and rec["changed"] != rec["numel"]):
            raise DeltaError(f"tensor {rec['name']!r}: the manifest says {rec['changed']} of its {rec['numel']} "
                             "elements change" + (" (it is sent whole: all of them)" if rec["mode"] == "full" else "")
                             + ": refused")
