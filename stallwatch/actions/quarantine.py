"""Move a broken output aside: never overwriting, never deleting, never through a link.

Everything here is on the job user's side of the trust boundary (docs/security.md): the
outputs tree is resolved once into directory fds (stallwatch.kernel.safefs) and every stat, open,
link, copy and unlink is relative to them, never by path again. A directory swapped for a
symlink after the walk, timed with inotify, then leads nowhere: a name that became a symlink,
a device node or another file is refused by O_NOFOLLOW, fstat and the (st_dev, st_ino)
recorded at the walk. The quarantine itself is root's (state_dir/quarantine/<job>, 0700).
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from collections.abc import Iterable

from stallwatch.kernel import safefs

__all__ = ["ASIDE_SUFFIX", "QUARANTINE_FULL", "move_at", "quarantine_file"]

# Where the quarantine cannot take a file (its filesystem full or read-only), the file is
# renamed aside in its own folder with this suffix, which no output pattern matches, so
# neither the resume nor a later validation takes it for an output.
ASIDE_SUFFIX = ".stallwatch-broken"
QUARANTINE_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _unique_names(name: str) -> Iterable[str]:
    yield name
    for n in range(1, 100_000):
        yield f"{name}.{n}"


def _copy_fd_verified(src_fd: int, size: int, dst_dfd: int, name: str) -> None:
    """Copy exactly `size` bytes of an open regular file into a new file `name` of dst_dfd
    (never an existing one, never through a link), fsync, re-read and compare. Raises
    FileExistsError when the name is taken, OSError when the copy is not exact."""
    h_src, h_dst = hashlib.sha256(), hashlib.sha256()
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dst_dfd)
    try:
        done = 0
        while done < size:
            chunk = os.pread(src_fd, min(1 << 20, size - done), done)
            if not chunk:
                raise OSError(errno.EIO, f"the source shrank while copied ({done} of {size} "
                                         "bytes)")
            h_src.update(chunk)
            os.write(fd, chunk)
            done += len(chunk)
        os.fsync(fd)
        pos = 0
        while chunk := os.pread(fd, 1 << 20, pos):
            h_dst.update(chunk)
            pos += len(chunk)
        if h_dst.digest() != h_src.digest() or pos != size:
            raise OSError(errno.EIO, "the copy differs from the original")
    except BaseException:
        # Our own partial copy, never the user's file: removing it loses nothing.
        try:
            os.unlink(name, dir_fd=dst_dfd)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)


def _ident_at(dfd: int, name: str) -> tuple[int, int] | None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def move_at(src_dfd: int, name: str, src_fd: int, dst_dfd: int, dst_name: str) -> str:
    """Move the open regular file `src_fd`, named `name` in src_dfd, to a free name (dst_name,
    dst_name.1 ...) in dst_dfd; returns the name used.

    Never overwrites and never deletes: within one filesystem a hard link to the new name
    (linkat fails rather than replace) then unlink of the old, so at every moment the file
    exists under at least one name; across filesystems (the quarantine in the state directory,
    the outputs elsewhere) a copy of exactly the file's size into a new file, fsync, compare,
    and only then unlink of the original. Each step checks that the name still is the file
    that was validated; a file swapped meanwhile is left where it is (OSError)."""
    st = os.fstat(src_fd)
    ident = (st.st_dev, st.st_ino)
    for cand in _unique_names(dst_name):
        try:
            os.link(name, cand, src_dir_fd=src_dfd, dst_dir_fd=dst_dfd, follow_symlinks=False)
            if _ident_at(dst_dfd, cand) != ident:  # the name was swapped before the link
                os.unlink(cand, dir_fd=dst_dfd)
                raise OSError(errno.ESTALE, "the file changed while it was moved: left in place")
        except FileExistsError:
            continue
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP,
                                 errno.EMLINK):
                raise
            try:
                _copy_fd_verified(src_fd, st.st_size, dst_dfd, cand)
            except FileExistsError:
                continue
        if _ident_at(src_dfd, name) != ident:
            raise OSError(errno.ESTALE, f"the original changed before its removal: a copy is "
                                        f"in the quarantine as {cand}, the original left")
        os.unlink(name, dir_fd=src_dfd)
        return cand
    raise FileExistsError(f"no free name for {dst_name}")


def quarantine_file(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Move src to dst, or to dst.1, dst.2 ... when taken; returns where it went (see
    move_at). Neither path's directories are followed through a link another user could
    have made (stallwatch.kernel.safefs); dst's are created 0700."""
    src, dst = Path(src), Path(dst)
    sdfd = safefs.open_dir(src.parent)
    try:
        fd = safefs.open_in(sdfd, src.name, where=str(src))
        try:
            ddfd = safefs.open_dir(dst.parent, create=True)
            try:
                return dst.parent / move_at(sdfd, src.name, fd, ddfd, dst.name)
            finally:
                os.close(ddfd)
        finally:
            os.close(fd)
    finally:
        os.close(sdfd)
