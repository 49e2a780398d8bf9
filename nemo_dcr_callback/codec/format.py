"""The chunk format: header layout, enums, the dtype table, checksums and header parsing.

docs/FORMAT.md is the byte-level specification; this module owns the header in both
directions (`assemble_chunk` writes it, `parse_header` verifies it) so the two cannot drift.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields
from enum import IntEnum

import numpy as np
import torch
import xxhash
import zstandard

from nemo_dcr_callback.codec import context
from nemo_dcr_callback.codec.streams import GapMode, gap_bound
from nemo_dcr_callback.core import kernels
from nemo_dcr_callback.core.rawbits import bits

MAGIC = b"DCRC"
FORMAT_VERSION = 3
# Versions this build decodes: 2 differs from 3 only in its rANS tables (docs/FORMAT.md),
# which the decoder rewrites into 3's before decoding (streams.from_format2).
READS = (2, 3)
DEFAULT_CHUNK_SPAN = 1 << 24  # positions per chunk: 32 MiB of BF16 per chunk at most


class ChunkError(ValueError):
    """A chunk that is corrupt, truncated, hostile or meant for another tensor."""


class Kind(IntEnum):
    XOR = 1  # value is combined with the receiver's bits (XOR or ulp difference)
    OVERWRITE = 2  # value replaces the receiver's bits (idempotent)


class ValueMode(IntEnum):
    RAW = 0  # the XOR bits (Kind.XOR) or the new bits (Kind.OVERWRITE)
    ULP = 1  # zig-zag (key(new) - key(old)) in the monotone integer order of the float


class Layout(IntEnum):
    PLANES = 0  # one stream per value byte (low byte first), zstd each
    TOKENS = 1  # a byte token per value (min(v, 255), rANS-coded) + escaped full values


@dataclass(frozen=True)
class DType:
    code: int
    name: str  # safetensors dtype string
    torch: torch.dtype
    width: int
    is_float: bool


DTYPES = [
    DType(1, "BF16", torch.bfloat16, 2, True),
    DType(2, "F16", torch.float16, 2, True),
    DType(3, "F32", torch.float32, 4, True),
    DType(4, "F64", torch.float64, 8, False),  # 8-byte values: XOR only
    DType(5, "I8", torch.int8, 1, False),
    DType(6, "U8", torch.uint8, 1, False),
    DType(7, "I16", torch.int16, 2, False),
    DType(8, "I32", torch.int32, 4, False),
    DType(9, "I64", torch.int64, 8, False),
    DType(10, "BOOL", torch.bool, 1, False),
    DType(11, "F8_E4M3", torch.float8_e4m3fn, 1, False),
    DType(12, "F8_E5M2", torch.float8_e5m2, 1, False),
]
BY_CODE = {d.code: d for d in DTYPES}
BY_NAME = {d.name: d for d in DTYPES}
BY_TORCH = {d.torch: d for d in DTYPES}


def dtype_info(dtype: torch.dtype | str) -> DType:
    """The format's entry for a torch dtype or safetensors dtype name; ValueError if unsupported."""
    table = BY_NAME if isinstance(dtype, str) else BY_TORCH
    if dtype not in table:
        raise ValueError(f"unsupported dtype {dtype}")
    return table[dtype]


_SUM = struct.Struct("<Q")
SUM_BYTES = _SUM.size
MAX_NAME = 4096
MAX_MEMBERS = 1 << 16  # tensors in one batched chunk
# What a batch's member table may expand to: its raw bytes at most MAX_TABLE_BYTES, its
# front-coded names at most NAME_EXPANSION times the raw table (plus 64 KiB) and at most
# MAX_NAME_BYTES in all. A full honest batch (65,536 members, names of about 100 bytes) needs
# about 7 MB of each; zstd stores a regular table 200x smaller, so the stored size bounds
# nothing. A 10 KB chunk claiming 65,536 members of 4 KB names took about 300 MB before its
# refusal (issue 46's probe); these bounds allow at most about 50 MB.
MAX_TABLE_BYTES = 16 << 20
NAME_EXPANSION = 16
MAX_NAME_BYTES = 32 << 20
_SLACK = 64 << 10


def _name_budget(table_bytes: int) -> int:
    return min(NAME_EXPANSION * table_bytes + _SLACK, MAX_NAME_BYTES)
MIN_CHUNK = 4 + 1 + 1 + 1 + 4 + SUM_BYTES  # magic, version, flags, dtype, four 1-byte varints, checksum
STORED, ZSTD, RANS = 0, 1, 2  # stream codecs
_BATCH = 0x40  # flags bit: a batched chunk (several small tensors, one set of streams)
_CTX = 0x80  # flags bit: context-modelled positions and tokens (codec/context.py)
MAX_CLASSES = context.MAX_CLASSES

Stream = tuple[int, bytes, int]  # (raw length, stored bytes, codec) of one encoded stream


@dataclass(frozen=True)
class ChunkHeader:
    """A verified header. A batched chunk's header covers its members' concatenated position
    spaces ([0, sum of numels)) and lists each member as a header of its own (name, numel,
    [0, numel), count, and `offset`: where it starts in the concatenation)."""
    name: str
    kind: Kind
    dtype: DType
    gap_mode: GapMode
    value_mode: ValueMode
    layout: Layout
    numel: int
    lo: int
    hi: int
    count: int
    streams: tuple[tuple[int, int, int], ...]  # (raw_len, stored_len, codec)
    payload_offset: int
    members: tuple[ChunkHeader, ...] = ()
    offset: int = 0
    classes: int = 0  # context-coded: the number of classes (0: not context-coded)
    version: int = FORMAT_VERSION  # the chunk's format version (READS)

    @property
    def batched(self) -> bool:
        return bool(self.members)

    def parts(self) -> tuple[ChunkHeader, ...]:
        """The tensors this chunk writes: its members, or itself."""
        return self.members or (self,)


def checksum(*parts) -> int:
    """The chunk checksum (xxh3-64) of the parts' concatenation, without joining them."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """Digest of a tensor's raw bits (xxh3-128, hex): proves a receiver holds exact bits."""
    b = bits(t.contiguous()) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return xxhash.xxh3_128_hexdigest(memoryview(b.numpy()).cast("B"))


# ----------------------------------------------------------------------------- varints
def varint(n: int) -> bytes:
    """LEB128: 7 bits a byte, low first; most header fields fit one or two bytes."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class _Short(Exception):
    """The buffer ends inside the header (a partial download: wait for more)."""


class _Reader:
    def __init__(self, mv: memoryview, off: int = 0):
        self.mv, self.off = mv, off

    def byte(self) -> int:
        if self.off >= len(self.mv):
            raise _Short
        self.off += 1
        return self.mv[self.off - 1]

    def varint(self) -> int:
        n = shift = 0
        while True:
            b = self.byte()
            n |= (b & 0x7F) << shift
            if b < 0x80:
                return n
            shift += 7
            if shift > 63:
                raise ChunkError("varint longer than 64 bits (corrupt header)")

    def take(self, n: int) -> memoryview:
        if self.off + n > len(self.mv):
            raise _Short
        self.off += n
        return self.mv[self.off - n:self.off]


def _flags(kind: Kind, gm: GapMode, vm: ValueMode, lay: Layout, batch: bool, ctx: bool) -> int:
    return ((int(kind) - 1) | (int(gm) << 2) | (int(vm) << 4) | (int(lay) << 5) | (_BATCH if batch else 0)
            | (_CTX if ctx else 0))


def _n_streams(gm: GapMode, lay: Layout, width: int, classes: int) -> int:
    if classes:  # class map, gaps and tokens per class, escapes
        return 2 + 2 * classes
    return (0 if gm == GapMode.DENSE else 1) + (width if lay == Layout.PLANES else 2)


def member_table(members: list[tuple[str, int, int]]) -> bytes:
    """A batch's members (name, numel, count) as bytes: each name front-coded against the one
    before it (a checkpoint's neighbouring names share most of their length)."""
    out, prev = bytearray(), b""
    for name, numel, count in members:
        nb = name.encode()
        if len(nb) > MAX_NAME:
            raise ValueError("tensor name too long")
        k = 0
        while k < min(len(nb), len(prev)) and nb[k] == prev[k]:
            k += 1
        out += varint(k) + varint(len(nb) - k) + nb[k:] + varint(numel) + varint(count)
        prev = nb
    return bytes(out)


def assemble_chunk(name: str, kind: Kind, info: DType, gm: GapMode, vm: ValueMode, lay: Layout, numel: int,
                   lo: int, hi: int, count: int, streams: list[Stream],
                   members: tuple[int, bytes, int, int] | None = None, classes: int = 0) -> bytes:
    """Header, stream table, payloads and checksum: the chunk's bytes. members: a batched
    chunk's (member count, stored member table, its codec, its raw length); name is unused then.
    classes: a context-coded chunk's number of classes."""
    head = bytearray(MAGIC)
    head += bytes((FORMAT_VERSION, _flags(kind, gm, vm, lay, members is not None, classes > 0), info.code))
    head += varint(numel) + varint(lo) + varint(hi - lo) + varint(count)
    if classes:
        head += varint(classes)
    if members is None:
        name_b = name.encode()
        head += varint(len(name_b)) + name_b
    else:
        m, table, tcodec, traw = members
        head += varint(m) + varint(traw) + varint(len(table)) + bytes((tcodec,)) + table
    for r, p, c in streams:
        head += varint(r) + varint(len(p)) + bytes((c,))
    parts = [bytes(head), *(p for _, p, _ in streams)]
    parts.append(_SUM.pack(checksum(*parts)))  # the body's checksum without joining it first: one copy, not two
    return b"".join(parts)


def _stream_specs(gm: GapMode, lay: Layout, info: DType, count: int, span: int,
                  classes: int = 0) -> list[tuple[int, bool, tuple]]:
    """(limit on raw length, exact?, allowed codecs) for every stream a header must declare, in order."""
    if classes:
        return ([(context.map_size(info.name), True, (STORED, ZSTD))]
                + [(gap_bound(GapMode.GAP8, count, span), False, (STORED, ZSTD, RANS))] * classes
                + [(count, False, (RANS, STORED))] * classes + [(count * info.width, False, (STORED, ZSTD))])
    specs = [] if gm == GapMode.DENSE else [(gap_bound(gm, count, span), False, (STORED, ZSTD))]
    if lay == Layout.PLANES:
        specs += [(count, True, (STORED, ZSTD))] * info.width
    else:
        specs += [(count, True, (RANS, STORED)), (count * info.width, False, (STORED, ZSTD))]
    return specs


_FIELDS = tuple(f.name for f in fields(ChunkHeader))


class _MemberHeaders:
    """Builds a batch's member headers. ChunkHeader is frozen: its __init__ sets each field
    through object.__setattr__, twice the cost of filling the instance dict, and a batch
    makes hundreds; the fields all members share are filled from one template."""

    def __init__(self, h: dict):
        self.tmpl = dict(zip(_FIELDS, ("", h["kind"], h["dtype"], h["gm"], h["vm"], h["lay"], 0, 0, 0, 0, (), 0, (),
                                       0, h["classes"], h["version"]), strict=True))

    def make(self, name: str, numel: int, count: int, offset: int) -> ChunkHeader:
        mh = object.__new__(ChunkHeader)
        d = mh.__dict__
        d.update(self.tmpl)
        d["name"], d["numel"], d["hi"], d["count"], d["offset"] = name, numel, numel, count, offset
        return mh


def _members(raw: bytes, m: int, h: dict, total: int, count: int) -> tuple[ChunkHeader, ...]:
    """A batch's member headers from its (decompressed) member table, every field checked.
    The compiled kernels read the varints (a batch has up to MAX_MEMBERS entries, parsed on
    every decode); anything they refuse, and every machine without them, goes through the
    Python parser, which names the problem."""
    lib = kernels.native()
    if lib is None or m == 0:
        return _members_py(raw, m, h, total, count)
    buf = bytes(raw)
    fields_ = np.empty(5 * m, dtype=np.int64)
    if lib.dcr_member_table(buf, len(buf), m, MAX_NAME, fields_.ctypes.data) != 0:
        return _members_py(raw, m, h, total, count)
    f = fields_.reshape(m, 5)
    if (int(f[:, 3].sum()) != total or int(f[:, 4].sum()) != count
            or int(f[:, 0].sum() + f[:, 1].sum()) > _name_budget(len(buf))):
        return _members_py(raw, m, h, total, count)
    make = _MemberHeaders(h).make
    out, prev, off = [], b"", 0
    try:
        for k, s, o, numel, c in f.tolist():
            nb = prev[:k] + buf[o:o + s]
            out.append(make(nb.decode(), numel, c, off))
            off += numel
            prev = nb
    except UnicodeDecodeError:
        return _members_py(raw, m, h, total, count)
    if len({x.name for x in out}) != m:
        return _members_py(raw, m, h, total, count)
    return tuple(out)


def _members_py(raw: bytes, m: int, h: dict, total: int, count: int) -> tuple[ChunkHeader, ...]:
    """_members in Python, with the error naming each problem."""
    r, out, prev, off, seen, n_sum = _Reader(memoryview(raw)), [], b"", 0, set(), 0
    make = _MemberHeaders(h).make
    names, most = 0, _name_budget(len(raw))
    try:
        for i in range(m):
            k, s = r.varint(), r.varint()
            if k > len(prev) or k + s > MAX_NAME:
                raise ChunkError(f"member table entry {i}: name refers to {k} bytes of a {len(prev)}-byte name "
                                 "(corrupt member table)")
            names += k + s
            if names > most:
                raise ChunkError(f"member table's names expand past {most} bytes from {len(raw)} (corrupt or "
                                 "crafted member table)")
            nb = prev[:k] + bytes(r.take(s))
            numel, c = r.varint(), r.varint()
            try:
                name = nb.decode()
            except UnicodeDecodeError:
                raise ChunkError(f"member table entry {i}: name is not UTF-8 (corrupt member table)") from None
            if c > numel or name in seen:
                raise ChunkError(f"member table entry {i} ({name!r}): count {c} of {numel} elements, or named twice")
            seen.add(name)
            out.append(make(name, numel, c, off))
            off += numel
            n_sum += c
            prev = nb
    except _Short:
        raise ChunkError(f"member table ends inside entry {len(out)} of {m} (corrupt member table)") from None
    if r.off != len(raw):
        raise ChunkError("member table has trailing bytes (corrupt member table)")
    if off != total or n_sum != count:
        raise ChunkError(f"member table covers {off} elements and {n_sum} changes, the chunk {total} and {count} "
                         "(corrupt member table)")
    return tuple(out)


def _unzstd_table(data: bytes, raw: int) -> bytes:
    try:
        if zstandard.frame_content_size(data) != raw:
            raise ChunkError("member table's zstd frame declares another size (corrupt member table)")
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw)
    except zstandard.ZstdError as exc:
        raise ChunkError(f"member table does not decompress ({exc}): corrupt member table") from None
    if len(out) != raw:
        raise ChunkError("member table has the wrong length (corrupt member table)")
    return out


def _version_error(ver: int) -> str:
    return (f"unsupported chunk format version {ver} (this build reads {' and '.join(map(str, READS))}; "
            "re-encode the delta with this build)")


def _read_header(mv: memoryview, off: int = 0) -> tuple[int, dict]:
    """(end of the chunk, raw header fields) of the chunk at off; _Short if the header is not
    all there yet; ChunkError if no chunk starts there. Only sizes are checked here."""
    r = _Reader(mv, off)
    if bytes(r.take(4)) != MAGIC:
        raise ChunkError(f"no chunk at offset {off} (not a nemo-dcr chunk: bad magic)")
    ver = r.byte()
    if ver not in READS:
        raise ChunkError(_version_error(ver))
    flags, dcode = r.byte(), r.byte()
    f = {"flags": flags, "dcode": dcode, "numel": r.varint(), "lo": r.varint()}
    f["hi"] = f["lo"] + r.varint()
    f["count"] = r.varint()
    f["classes"] = r.varint() if flags & _CTX else 0
    if f["classes"] > MAX_CLASSES:
        raise ChunkError(f"{f['classes']} context classes (at most {MAX_CLASSES}: corrupt header)")
    if flags & _BATCH:
        f["m"], f["traw"], tstored = r.varint(), r.varint(), r.varint()
        f["tcodec"] = r.byte()
        if f["m"] > MAX_MEMBERS or tstored > len(mv) or f["traw"] > MAX_MEMBERS * (MAX_NAME + 40):
            raise ChunkError("bad member table size (corrupt header)")
        if f["traw"] > MAX_TABLE_BYTES:
            raise ChunkError(f"member table claims {f['traw']} bytes, more than {MAX_TABLE_BYTES} (corrupt or "
                             "crafted header)")
        f["table"] = bytes(r.take(tstored))
    else:
        nlen = r.varint()
        if nlen > MAX_NAME:
            raise ChunkError("bad tensor name length")
        f["name"] = bytes(r.take(nlen))
    gm, lay = (flags >> 2) & 3, (flags >> 5) & 1
    width = BY_CODE[dcode].width if dcode in BY_CODE else 1
    streams = []
    for _ in range(_n_streams(GapMode(gm) if gm in (0, 1, 2) else GapMode.DENSE, Layout(lay), width, f["classes"])):
        streams.append((r.varint(), r.varint(), r.byte()))
    f["streams"], f["payload"] = streams, r.off - off
    return r.off + sum(s[1] for s in streams) + SUM_BYTES, f


def parse_header(buf: bytes | memoryview, verify: bool = True) -> ChunkHeader:
    """Verify the checksum and every header field; raise ChunkError naming the problem."""
    mv = memoryview(buf)
    if len(mv) < MIN_CHUNK:
        raise ChunkError(f"truncated chunk ({len(mv)} bytes)")
    if bytes(mv[:4]) != MAGIC:
        raise ChunkError("not a nemo-dcr chunk (bad magic)")
    if mv[4] not in READS:
        raise ChunkError(_version_error(mv[4]))
    if verify and _SUM.unpack_from(mv, len(mv) - SUM_BYTES)[0] != checksum(mv[:-SUM_BYTES]):
        raise ChunkError("chunk checksum mismatch (corrupt or truncated)")
    try:
        end, f = _read_header(mv[:-SUM_BYTES])
    except _Short:
        raise ChunkError("truncated chunk header") from None
    flags, dcode, classes = f["flags"], f["dcode"], f["classes"]
    try:
        kind, gm = Kind((flags & 3) + 1), GapMode((flags >> 2) & 3)
        vm, lay = ValueMode((flags >> 4) & 1), Layout((flags >> 5) & 1)
    except ValueError as exc:
        raise ChunkError(f"bad chunk header field: {exc}") from None
    if dcode not in BY_CODE:
        raise ChunkError(f"unknown dtype code {dcode}")
    info = BY_CODE[dcode]
    numel, lo, hi, count = f["numel"], f["lo"], f["hi"], f["count"]
    if vm == ValueMode.ULP and (kind != Kind.XOR or not info.is_float):
        raise ChunkError("ulp coding on a non-float or overwrite chunk")
    if not (lo <= hi <= numel) or count > hi - lo:
        raise ChunkError(f"bad range [{lo}, {hi}) / count {count} for {numel} elements")
    if gm == GapMode.DENSE and count != hi - lo:
        raise ChunkError("dense chunk does not cover its range")
    if flags & _CTX:
        if (not classes or kind != Kind.XOR or gm != GapMode.GAP8 or lay != Layout.TOKENS
                or not context.supported(info.name)):
            raise ChunkError("context coding on a chunk that cannot have it (corrupt header)")
    streams = []
    for s, ((raw, stored, codec), (limit, exact, codecs)) in enumerate(
            zip(f["streams"], _stream_specs(gm, lay, info, count, hi - lo, classes), strict=True)):
        if codec not in codecs or (codec == STORED and raw != stored):
            raise ChunkError(f"stream {s}: bad codec {codec}")
        if raw != limit if exact else raw > limit:
            raise ChunkError(f"stream {s} declares {raw} bytes (limit {limit})")
        streams.append((raw, stored, codec))
    if end != len(mv):
        raise ChunkError("chunk length does not match its stream table (truncated or padded)")
    if classes and sum(st[0] for st in streams[1 + classes:1 + 2 * classes]) != count:
        raise ChunkError(f"context classes' token streams do not add up to the {count} changes")
    members: tuple[ChunkHeader, ...] = ()
    name = ""
    if flags & _BATCH:
        if kind != Kind.XOR or lo != 0 or hi != numel or f["m"] == 0:
            raise ChunkError("a batched chunk must be XOR over its members' whole tensors")
        table, tcodec = f["table"], f["tcodec"]
        if tcodec == ZSTD:
            table = _unzstd_table(table, f["traw"])
        elif tcodec != STORED or len(table) != f["traw"]:
            raise ChunkError(f"member table: bad codec {tcodec} (corrupt member table)")
        members = _members(table, f["m"], {"kind": kind, "dtype": info, "gm": gm, "vm": vm, "lay": lay,
                                           "classes": classes, "version": mv[4]},
                           numel, count)
    else:
        try:
            name = f["name"].decode()
        except UnicodeDecodeError:
            raise ChunkError("tensor name is not UTF-8") from None
    return ChunkHeader(name, kind, info, gm, vm, lay, numel, lo, hi, count, tuple(streams), f["payload"], members,
                       classes=classes, version=mv[4])


def chunk_end(mv: memoryview, off: int) -> int | None:
    """Where the chunk starting at `off` ends (its header and stream table give its length),
    or None while those are not all there yet; ChunkError if no chunk starts at `off`."""
    try:
        return _read_header(mv, off)[0]
    except _Short:
        if len(mv) - off >= 4 and bytes(mv[off:off + 4]) != MAGIC:
            raise ChunkError(f"no chunk at offset {off} (corrupt)") from None
        return None


def split_chunks(blob: bytes | memoryview) -> list[memoryview]:
    """The chunks of a blob of chunks written back to back (a part object): each one's length
    comes from its own header and stream table; parse_header still verifies every chunk."""
    mv = memoryview(blob)
    out, off = [], 0
    while off < len(mv):
        end = chunk_end(mv, off)
        if end is None:
            raise ChunkError(f"truncated chunk header at offset {off} of {len(mv)}")
        if end > len(mv):
            raise ChunkError(f"chunk at offset {off} runs past the end ({end} > {len(mv)} bytes: truncated)")
        out.append(mv[off:end])
        off = end
    return out
