"""Object stores behind one small interface: file:// (the embedded default) and s3:// (transport.s3).

Keys are '/'-separated relative paths. `put` is atomic (a reader sees the whole object or
none): write to a temporary name in the same directory, fsync, rename. `put_if_absent` is
the conditional write the commit protocol relies on (exactly one writer wins).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from nemo_dcr_callback.protocol import keys
from nemo_dcr_callback.protocol.store import StoreError, put_once, redact
from nemo_dcr_callback.transport.relay_store import FailoverStore, RelayStore


class FileStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.url = "file://" + str(self.root.resolve())

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad key {key!r}")
        return self.root / key

    def _inside(self, p: Path) -> bool:
        """Does p, with every symlink followed, stay inside the store? A link placed in the
        store must not let a reader (a relay serving this store) read any file it points at,
        nor gc delete what it points at: such links are no objects, listed or served."""
        real = os.path.realpath(p)
        return real == self._real or real.startswith(self._real + os.sep)

    @property
    def _real(self) -> str:
        return os.path.realpath(self.root)

    def _staged(self, key: str, data: bytes, durable: bool) -> tuple[Path, str]:
        """Write data to a temporary file next to the key's path (fsynced if durable)."""
        p = self._path(key)
        # A linked folder on the way: writes stay in the store, as reads do (checked on the
        # nearest folder that exists before any is made, then on the one written into).
        have = p.parent
        while not have.exists() and have != self.root and have.parent != have:
            have = have.parent
        if not self._inside(have):
            raise StoreError(f"{key}: its folder is a link leading out of the store {redact(self.url)}: not written")
        p.parent.mkdir(parents=True, exist_ok=True)
        if not self._inside(p.parent):
            raise StoreError(f"{key}: its folder is a link leading out of the store {redact(self.url)}: not written")
        fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".part", dir=p.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return p, tmp

    def put(self, key: str, data: bytes, durable: bool = True) -> None:
        """Atomic put; durable also fsyncs (commit records need it, re-creatable data need not).
        History objects (keys.is_history) are created once (put_once)."""
        if keys.is_history(key):
            return put_once(self, key, data, durable=durable)
        p, tmp = self._staged(key, data, durable)
        try:
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_if_absent(self, key: str, data: bytes, durable: bool = True) -> bool:
        """Write only if the key does not exist; True if this call created it."""
        p, tmp = self._staged(key, data, durable)
        try:
            os.link(tmp, p)  # atomic, fails if p exists
            return True
        except FileExistsError:
            return False
        finally:
            Path(tmp).unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        """The object's bytes; KeyError for a key that is no object here (absent, a folder, or
        a link leading out of the store)."""
        p = self._path(key)
        try:
            if not self._inside(p):
                raise KeyError(key)
            return p.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        p = self._path(key)
        return p.is_file() and self._inside(p)

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            self._path(k).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> list[str]:
        """Delete every object under prefix, and the emptied directories."""
        keys = self.list(prefix)
        p = self._path(prefix.rstrip("/"))
        if p.is_symlink():  # the store's entry goes, never what it points at
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)  # (does not follow links inside: they are unlinked)
        return keys

    def children(self, prefix: str) -> list[str]:
        """Names directly under prefix (one level, like an S3 listing with a delimiter)."""
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir() or not self._inside(base):
            return []
        return sorted(p.name for p in base.iterdir()
                      if not p.name.endswith(".part") and (not p.is_symlink() or self._inside(p)))

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir() or not self._inside(base):
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*")
                      if p.is_file() and not p.name.endswith(".part") and (not p.is_symlink() or self._inside(p)))


def freeze_long_lived() -> None:
    """Take every object alive now out of the cyclic collector's scans (gc.freeze), in a
    long-running process once its stores are open. A store chain that reaches S3 holds
    boto3's service model, about 220K tracked objects, and each full collection scanned them
    all: about 120 ms of CPU, in a relay once every few versions (its busiest version then
    took twice the CPU) and in every receiver. The objects stay alive as they would anyway."""
    gc.collect()
    gc.freeze()


def open_store(url: str):
    """A store for a URL: file:///abs/path, file://rel/path, a plain path,
    s3://bucket/prefix[?endpoint=http://host:port&region=...], relay://host:port (a relay
    node, transport.relay), or a comma-separated failover chain of these (nearest first)."""
    if "," in url:
        return FailoverStore([open_store(u.strip()) for u in url.split(",") if u.strip()])
    u = urlparse(url)
    if u.scheme in ("", "file"):
        path = (u.netloc + u.path) if u.scheme == "file" else url
        return FileStore(path)
    if u.scheme == "s3":
        from nemo_dcr_callback.transport.s3 import S3Store  # start-up cost: boto3 (~130 ms), only for s3://

        return S3Store(url)
    if u.scheme in ("relay", "relays"):
        return RelayStore(url)
    raise StoreError(f"unsupported store URL scheme {u.scheme!r} in {redact(url)!r} (use file://, s3:// or relay://)")
