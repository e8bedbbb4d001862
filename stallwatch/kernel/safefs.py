"""File operations on the job user's side of the trust boundary (docs/security.md).

stallwatch runs as root; everything under a job's log, outputs and working directories is the
job's user's to forge: any name there may become a symlink, a FIFO, a device node or a hard
link between two looks at it. So on that side a path is resolved exactly once, component by
component, into directory file descriptors, and every later operation is relative to those
fds (openat/linkat/renameat/unlinkat through `dir_fd=`), never by path again:

- a symlink is never followed, except one that only root could have made and only root could
  replace: owned by root, in a directory owned by root that nobody else may write (`/var/run
  -> ../run`, an admin's `/data -> /mnt/data`). A link in a user's directory is refused,
  whoever owns it;
- files are opened with O_NOFOLLOW|O_NONBLOCK and accepted only when fstat says regular file
  (a FIFO never blocks the open, a device node is never read);
- reads are bounded (`read_bounded`).

The standard library has the primitives (`dir_fd=`, `os.O_NOFOLLOW`) but no path walk over
them (`os.fwalk` is recursive and keeps every ancestor open), and no maintained library on
PyPI for openat2-style resolution fits a pure-Python daemon, hence this short module.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator

__all__ = ["UnsafePath", "open_dir", "split_dir", "open_dir_split", "open_file", "open_in", "subdir",
           "open_rel", "read_bounded", "fd_dir", "readable_by"]

# O_PATH: walking needs search (x) permission only, as the kernel's own walk does; a job user's
# run through an exec-only directory (0711) must not fail here. fd_dir reopens for listing.
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40  # as the kernel's own limit on links in one resolution


class UnsafePath(OSError):
    """A path refused because following it would let a job's user choose what root touches."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(errno.EPERM, f"{path}: {why}")
        self.path, self.why = path, why

    def __str__(self) -> str:
        return f"{self.path}: {self.why}"


def _trusted_link(dir_fd: int, name: str) -> bool:
    """A symlink only root could have made and only root could replace."""
    try:
        lst = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        dst = os.fstat(dir_fd)
    except OSError:
        return False
    return lst.st_uid == 0 and dst.st_uid == 0 and not dst.st_mode & 0o022


def _walk(path: str, *, create: bool, mode: int) -> int:
    """An O_DIRECTORY fd for `path`, resolved component by component without following an
    untrusted symlink; missing components created (0700 by default) when `create`."""
    if not os.path.isabs(path):
        raise UnsafePath(path, "not an absolute path")
    todo = [c for c in path.split("/") if c not in ("", ".")]
    todo.reverse()  # a stack: pop() gives the next component
    fd = os.open("/", _DIR)
    links = 0
    try:
        while todo:
            name = todo.pop()
            try:
                nfd = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create or name == "..":
                    raise FileNotFoundError(errno.ENOENT, f"{path}: {name!r} does not exist") from None
                try:
                    os.mkdir(name, mode, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile: opened (and checked) below like any other
                nfd = os.open(name, _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                try:
                    is_link = stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
                except OSError:
                    is_link = False
                if not is_link:
                    raise NotADirectoryError(errno.ENOTDIR, f"{path}: {name!r} is not a directory") from e
                if not _trusted_link(fd, name):
                    raise UnsafePath(path, f"{name!r} is a symlink in a directory another user "
                                           "can write (or not root's): not followed") from e
                links += 1
                if links > MAX_LINKS:
                    raise UnsafePath(path, "too many levels of symbolic links") from e
                target = os.readlink(name, dir_fd=fd)
                todo.extend(reversed([c for c in target.split("/") if c not in ("", ".")]))
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", _DIR)
                continue
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_dir(path: str | os.PathLike[str], *, create: bool = False, mode: int = 0o700) -> int:
    """An O_DIRECTORY fd for `path` (see the module doc); the caller closes it."""
    return _walk(os.fspath(path), create=create, mode=mode)


def split_dir(path: str) -> tuple[str, ...] | None:
    """The components _walk resolves `path` by, for open_dir_split; None for a relative path."""
    if not os.path.isabs(path):
        return None
    return tuple(c for c in path.split("/") if c not in ("", "."))


def open_dir_split(path: str, parts: tuple[str, ...] | None) -> int:
    """open_dir(path), `parts` being split_dir(path), split once by a caller that opens the same
    directory every tick (the log's, probes/logfollow.py: the walk's parsing and its stack were
    half of the follower's fixed cost, issue 17). While every component is a plain directory
    this is the walk's own openat and close for each, nothing more; at the first that is not
    (a link, missing, not a directory, refused) the path is walked again by _walk from "/",
    so every answer and every error is open_dir's."""
    if parts is None:
        return _walk(path, create=False, mode=0o700)
    fd = os.open("/", _DIR)
    try:
        for name in parts:
            try:
                nfd = os.open(name, _DIR, dir_fd=fd)
            except OSError:
                break
            os.close(fd)
            fd = nfd
        else:
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return _walk(path, create=False, mode=0o700)


def subdir(dir_fd: int, name: str, *, create: bool = False, mode: int = 0o700) -> int:
    """An O_DIRECTORY fd for one entry of `dir_fd`, never through a symlink."""
    _one(name)
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    raise UnsafePath(name, "is a symlink: not followed") from None
            except FileNotFoundError:
                pass
        if not isinstance(e, FileNotFoundError) or not create:
            raise
        try:
            os.mkdir(name, mode, dir_fd=dir_fd)
        except FileExistsError:
            pass
        return os.open(name, _DIR, dir_fd=dir_fd)


def open_rel(root_fd: int, parts: tuple[str, ...] | list[str], *, create: bool = False) -> int:
    """A directory fd for root_fd/parts[0]/parts[1]/..., each component through `subdir`."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            nfd = subdir(fd, part, create=create)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _one(name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise UnsafePath(name, "not a single file name")


def open_in(dir_fd: int, name: str, flags: int = os.O_RDONLY, mode: int = 0o600, *,
            where: str = "") -> int:
    """openat(dir_fd, name) without following a symlink; a regular file or UnsafePath."""
    _one(name)
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode,
                 dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(where or name, "not a regular file")
        os.set_blocking(fd, True)  # O_NONBLOCK was for the open only (a FIFO must not block it)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_file(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A regular file's fd, its directory resolved as open_dir does, the file itself never a
    symlink (ELOOP is turned into UnsafePath)."""
    p = os.fspath(path)
    parent, name = os.path.split(os.path.normpath(p))
    dfd = open_dir(parent or "/")
    try:
        return open_in(dfd, name, flags, mode, where=p)
    except OSError as e:
        if e.errno == errno.ELOOP and not isinstance(e, UnsafePath):
            raise UnsafePath(p, "is a symlink: not followed") from None
        raise
    finally:
        os.close(dfd)


def read_bounded(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The whole of a small regular file; OSError (EFBIG) when it is larger than max_bytes."""
    fd = open_file(path)
    try:
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"{os.fspath(path)}: larger than {max_bytes} bytes: not read")
    return data


def fd_dir(fd: int) -> Iterator[os.DirEntry[str]]:
    """Entries of a directory fd (an O_PATH fd cannot be read: scandir gets a readable
    reopening, which it duplicates and so is closed here)."""
    rfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    try:
        with os.scandir(rfd) as it:
            yield from it
    finally:
        os.close(rfd)


def readable_by(st: os.stat_result, uid: int, gids: set[int] | frozenset[int]) -> bool:
    """Could `uid` (with groups `gids`) read a file of this stat by its mode bits? (root: yes)"""
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IRUSR)
    if st.st_gid in gids:
        return bool(st.st_mode & stat.S_IRGRP)
    return bool(st.st_mode & stat.S_IROTH)
