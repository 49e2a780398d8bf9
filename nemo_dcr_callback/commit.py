"""Versions in a store: per-rank chunk objects and manifests, then one version record.

Layout (keys under the store's root):

    keyframe/{v}/...                    a full canonical checkpoint (safetensors + config.json)
    versions/{v:010d}/rank-{r:05d}.dcr  the rank's chunks, back to back
    versions/{v:010d}/rank-{r:05d}.json its manifest (RankManifest)
    versions/{v:010d}/VERSION.json      the version record (VersionRecord), written once every
                                        rank's manifest exists, with a conditional write
    verify/{v:010d}/model.safetensors   verify mode only: the dense export of the version

A receiver applies version v only once VERSION.json exists and its `base` is the version it
holds. Receiver acks, the joint commit that moves the senders' baselines, quorum policies
and garbage collection are the commit-protocol issue's; this module is the part they build on.
"""

from __future__ import annotations

import json
import time
from typing import TypedDict

import xxhash


class ChunkRef(TypedDict):
    offset: int
    length: int
    tensor: str
    count: int
    checksum: str  # xxh3-64 of the chunk bytes (hex)


class RankManifest(TypedDict):
    version: int
    rank: int
    world: int
    object: str  # key of the chunks object
    bytes: int
    chunks: list[ChunkRef]
    params: int
    changed: int


class VersionRecord(TypedDict):
    version: int
    base: int  # the version a receiver must hold to apply this one
    world: int
    ranks: list[str]  # manifest keys
    bytes: int
    params: int
    changed: int
    time: float


def vdir(v: int) -> str:
    return f"versions/{v:010d}"


def rank_object(v: int, r: int) -> str:
    return f"{vdir(v)}/rank-{r:05d}.dcr"


def rank_manifest(v: int, r: int) -> str:
    return f"{vdir(v)}/rank-{r:05d}.json"


def version_record(v: int) -> str:
    return f"{vdir(v)}/VERSION.json"


def keyframe_dir(v: int) -> str:
    return f"keyframe/{v:010d}"


def verify_key(v: int) -> str:
    return f"verify/{v:010d}/model.safetensors"


def write_rank(store, v: int, rank: int, world: int, chunks: list[bytes], params: int, changed: int,
               headers: list) -> RankManifest:
    """Upload one rank's chunks as one object, then its manifest (the manifest last, so a
    manifest always names a complete object)."""
    refs: list[ChunkRef] = []
    off = 0
    for c, h in zip(chunks, headers, strict=True):
        refs.append(ChunkRef(offset=off, length=len(c), tensor=h.name, count=h.count,
                             checksum=xxhash.xxh3_64_hexdigest(c)))
        off += len(c)
    # Rank objects and manifests can be re-published; the version record is the durable commit.
    store.put(rank_object(v, rank), b"".join(chunks), durable=False)
    m = RankManifest(version=v, rank=rank, world=world, object=rank_object(v, rank), bytes=off, chunks=refs,
                     params=params, changed=changed)
    store.put(rank_manifest(v, rank), json.dumps(m).encode(), durable=False)
    return m


def seal_version(store, v: int, base: int, world: int, timeout: float = 600.0, poll: float = 0.02) -> VersionRecord:
    """Wait for every rank's manifest of version v, then write its record (conditional
    write: if another writer got there first, theirs stands). Returns the record."""
    deadline = time.monotonic() + timeout
    keys = [rank_manifest(v, r) for r in range(world)]
    while not all(store.exists(k) for k in keys):
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.exists(k)]
            raise TimeoutError(f"version {v}: manifests missing after {timeout:.0f} s: {missing[:4]}")
        time.sleep(poll)
    ms = [json.loads(store.get(k)) for k in keys]
    rec = VersionRecord(version=v, base=base, world=world, ranks=keys, bytes=sum(m["bytes"] for m in ms),
                        params=sum(m["params"] for m in ms), changed=sum(m["changed"] for m in ms),
                        time=time.time())
    if not store.put_if_absent(version_record(v), json.dumps(rec).encode()):
        rec = json.loads(store.get(version_record(v)))
    return rec


def read_record(store, v: int) -> VersionRecord | None:
    try:
        return json.loads(store.get(version_record(v)))
    except KeyError:
        return None


def list_versions(store) -> list[int]:
    return sorted({int(k.split("/")[1]) for k in store.list("versions") if k.endswith("/VERSION.json")})
