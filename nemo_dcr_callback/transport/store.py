"""Object stores behind one small interface: file:// (the embedded default) and s3:// (transport.s3).

Keys are '/'-separated relative paths. `put` is atomic (a reader sees the whole object or
none): write to a temporary name in the same directory, fsync, rename. `put_if_absent` is
the conditional write the commit protocol relies on (exactly one writer wins).
"""

from __future__ import annotations

import gc
import os
import shutil
import stat
from pathlib import Path
from urllib.parse import urlparse

from nemo_dcr_callback import safe_io
from nemo_dcr_callback.protocol import keys
from nemo_dcr_callback.protocol.store import StoreError, put_once, redact
from nemo_dcr_callback.transport.relay_store import FailoverStore, RelayStore


class FileStore:
    """file:// store. Every access goes down from the root on descriptors, refusing a link at
    any component (safe_io): a party that may write into the store (receivers write
    registrations and acks) cannot make a reader (a relay serving this store) open what a
    link points at, not even by swapping a file for a link between a check and the open."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.url = "file://" + str(self.root.resolve())

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/") or "\0" in key:
            raise ValueError(f"bad key {key!r}")
        return self.root / key

    @staticmethod
    def _split(key: str) -> tuple[str, str]:
        d, _, name = key.rpartition("/")
        return d, name

    def _open(self, key: str) -> int | None:
        """A read descriptor of the object, or None where the key is no object here (absent, a
        folder, a link anywhere on its path, not a regular file)."""
        try:
            self._path(key)
            return safe_io.open_file(self.root, key)
        except ValueError:  # a key no object can have (a NUL, "..")
            return None
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, safe_io.LinkRefused):
            return None
        except OSError as exc:
            raise StoreError(f"{key}: cannot be read in {redact(self.url)} ({exc.strerror or exc})") from None

    def _folder(self, key: str) -> int:
        """A descriptor of the key's folder, made where missing, no link followed."""
        self._path(key)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            return safe_io.open_dir(self.root, self._split(key)[0], create=True)
        except (safe_io.LinkRefused, FileExistsError, NotADirectoryError):
            raise StoreError(f"{key}: a folder on its way is a link or a file (a link leading out of the store "
                             f"{redact(self.url)} is never written through): not written") from None

    def _staged(self, key: str, data: bytes, durable: bool) -> tuple[int, str, str]:
        """Write data to a new temporary file next to the key (fsynced if durable): (folder
        descriptor, the key's name, the temporary name). The caller closes the descriptor."""
        dfd = self._folder(key)
        try:
            return dfd, self._split(key)[1], safe_io.write_temp(dfd, self._split(key)[1], lambda f: f.write(data),
                                                                durable)
        except BaseException:
            os.close(dfd)
            raise

    def put(self, key: str, data: bytes, durable: bool = True) -> None:
        """Atomic put; durable also fsyncs (commit records need it, re-creatable data need not).
        History objects (keys.is_history) are created once (put_once)."""
        if keys.is_history(key):
            return put_once(self, key, data, durable=durable)
        dfd, name, tmp = self._staged(key, data, durable)
        try:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            safe_io.unlink_at(dfd, tmp)
            raise
        finally:
            os.close(dfd)

    def put_if_absent(self, key: str, data: bytes, durable: bool = True) -> bool:
        """Write only if the key does not exist; True if this call created it."""
        dfd, name, tmp = self._staged(key, data, durable)
        try:
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)  # fails if it exists
            return True
        except FileExistsError:
            return False
        finally:
            safe_io.unlink_at(dfd, tmp)
            os.close(dfd)

    def get(self, key: str, limit: int | None = None) -> bytes:
        """The object's bytes; KeyError for a key that is no object here (absent, a folder, a
        link); safe_io.TooLarge, by its size and unread, for one over `limit` bytes."""
        fd = self._open(key)
        if fd is None:
            raise KeyError(key)
        return safe_io.read_fd(fd, key, limit)

    def exists(self, key: str) -> bool:
        fd = self._open(key)
        if fd is None:
            return False
        os.close(fd)
        return True

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            self._path(k)
            d, name = self._split(k)
            try:
                dfd = safe_io.open_dir(self.root, d)
            except (FileNotFoundError, NotADirectoryError, safe_io.LinkRefused):
                continue  # nothing of the store's there
            try:
                safe_io.unlink_at(dfd, name)
            finally:
                os.close(dfd)

    def delete_prefix(self, prefix: str) -> list[str]:
        """Delete every object under prefix, and the emptied directories; a link there goes as
        the link alone (never what it points at)."""
        found = self.list(prefix)
        d, name = self._split(prefix.rstrip("/"))
        if not name:
            return found
        try:
            dfd = safe_io.open_dir(self.root, d)
        except (FileNotFoundError, NotADirectoryError, safe_io.LinkRefused):
            return found
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return found
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=dfd)  # (descriptor-based: links inside are unlinked, not followed)
            elif stat.S_ISLNK(st.st_mode):
                safe_io.unlink_at(dfd, name)
        finally:
            os.close(dfd)
        return found

    def _entries(self, prefix: str):
        """(descriptor of prefix's folder, its entries), or None if it is no folder of the store."""
        try:
            fd = safe_io.open_dir(self.root, prefix.rstrip("/"))
        except (FileNotFoundError, NotADirectoryError, safe_io.LinkRefused, ValueError):
            return None
        return fd

    def children(self, prefix: str) -> list[str]:
        """Names directly under prefix (one level, like an S3 listing with a delimiter); links
        are no objects and not shown."""
        fd = self._entries(prefix)
        if fd is None:
            return []
        try:
            with os.scandir(fd) as it:
                return sorted(e.name for e in it if not e.name.endswith(".part") and not e.name.endswith(".tmp")
                              and not e.is_symlink())
        finally:
            os.close(fd)

    def list(self, prefix: str) -> list[str]:
        """Every object (regular file) under prefix, walked on descriptors without following links."""
        base = prefix.rstrip("/")
        fd = self._entries(base)
        if fd is None:
            return []
        out: list[str] = []

        def walk(dfd: int, rel: str) -> None:
            with os.scandir(dfd) as it:
                entries = list(it)
            for e in entries:
                key = f"{rel}/{e.name}" if rel else e.name
                if e.is_file(follow_symlinks=False):
                    if not e.name.endswith((".part", ".tmp")):
                        out.append(key)
                elif e.is_dir(follow_symlinks=False):
                    try:
                        sub = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                    except OSError:
                        continue  # gone or swapped for a link since the scan
                    try:
                        walk(sub, key)
                    finally:
                        os.close(sub)

        try:
            walk(fd, base)
        finally:
            os.close(fd)
        return sorted(out)


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
