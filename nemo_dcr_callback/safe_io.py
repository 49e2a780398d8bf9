"""File access that another user of a folder cannot redirect (docs/SECURITY.md).

A store root, an RL rollout folder, a checkpoint directory: folders that other parties may
write into. Checking a path and then opening it again races with a party swapping a file
for a link in between (a relay served /proc/self/environ so, 198 times in 20 s). So every
open here is made on a descriptor, component by component from a trusted root, with
O_NOFOLLOW: a link anywhere below the root is refused on the descriptor that is read or
written, not on a path checked before. Writes go to an unpredictable name created with
O_EXCL|O_NOFOLLOW and are renamed into place, so a link planted at a temporary name is
never written through.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkRefused(OSError):
    """A path below a trusted root passes through a link (or something not a folder where a
    folder must be): refused, whatever the link points at."""


def _parts(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts) or rel.startswith("/"):
        raise ValueError(f"bad relative path {rel!r}")
    return parts


def open_dir(root: str | os.PathLike, rel: str = "", create: bool = False) -> int:
    """A descriptor of the folder root/rel, reached without following any link below root
    (create: make missing folders on the way). FileNotFoundError if a folder is missing,
    LinkRefused if a component is a link or not a folder."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in _parts(rel):
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise LinkRefused(exc.errno, f"{rel}: {name} is a link or not a folder") from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_file(root: str | os.PathLike, rel: str) -> int:
    """A read descriptor of the regular file root/rel, no link followed below root.
    FileNotFoundError if absent; LinkRefused if any component is a link; IsADirectoryError
    (or LinkRefused for a FIFO, device or socket) if it is not a regular file."""
    parts = _parts(rel)
    if not parts:
        raise IsADirectoryError(errno.EISDIR, "the root itself")
    dfd = open_dir(root, "/".join(parts[:-1]))
    try:
        try:
            # O_NONBLOCK: a FIFO planted there must not hang the reader (refused just below)
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LinkRefused(exc.errno, f"{rel} is a link") from None
            raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, f"{rel} is a folder")
        raise LinkRefused(errno.EINVAL, f"{rel} is not a regular file")
    os.set_blocking(fd, True)
    return fd


class TooLarge(ValueError):
    """An object larger than its reader states it may be: refused by its size, unread."""

    def __init__(self, what: str, size: int, limit: int):
        super().__init__(f"{what}: {size} bytes, more than the {limit} such an object may have")
        self.size, self.limit = size, limit


def read_fd(fd: int, what: str, limit: int | None = None) -> bytes:
    """The whole file behind fd, refused by its size before any byte is read if over limit
    (a sparse 3 GiB file costs nothing). Closes fd."""
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise TooLarge(what, size, limit)
        pieces, got = [], 0
        while got < size:  # (one read for most files: Linux returns at most ~2 GiB a call)
            piece = os.read(fd, size - got)
            if not piece:
                break  # truncated since the stat: what is there
            pieces.append(piece)
            got += len(piece)
        if limit is not None and got == size and os.read(fd, 1):
            raise TooLarge(what, size + 1, limit)  # grew since the stat
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)
    finally:
        os.close(fd)


def read_beneath(root: str | os.PathLike, rel: str, limit: int | None = None) -> bytes:
    """root/rel's bytes, no link followed below root, refused over `limit` bytes unread."""
    return read_fd(open_file(root, rel), rel, limit)


def _tmp_name(name: str) -> str:
    return f".{name}.{secrets.token_hex(8)}.tmp"


def create_temp(dfd: int, name: str) -> tuple[int, str]:
    """A new file next to `name` in the folder dfd, under an unpredictable name, created with
    O_EXCL|O_NOFOLLOW (a link or file planted there is never opened)."""
    for _ in range(16):
        tmp = _tmp_name(name)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dfd)
            return fd, tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name next to {name}")


def write_temp(dfd: int, name: str, write, durable: bool = False) -> str:
    """A new temporary file next to `name` in the folder dfd (create_temp) holding what
    write(f) writes, fsynced if durable; its name. Removed again on any error."""
    fd, tmp = create_temp(dfd, name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        unlink_at(dfd, tmp)
        raise
    return tmp


def unlink_at(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass


def write_streamed(path: str | os.PathLike, write, durable: bool = False) -> None:
    """Write path's whole content, as write(f) streams it (torch.save: nothing held twice),
    atomically: to an unpredictable temporary name (O_EXCL, O_NOFOLLOW) in its folder, then
    renamed over it. A link planted at the path is replaced as a directory entry, never
    written through; readers see the old or the new file whole."""
    path = Path(path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        tmp = write_temp(dfd, path.name, write, durable)
        try:
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            unlink_at(dfd, tmp)
            raise
    finally:
        os.close(dfd)


def write_whole(path: str | os.PathLike, data: bytes | str, durable: bool = False) -> None:
    """write_streamed of bytes (or text, as UTF-8)."""
    data = data.encode() if isinstance(data, str) else data
    write_streamed(path, lambda f: f.write(data), durable)
