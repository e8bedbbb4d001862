"""stallwatch.kernel.safefs: the file layer for the job user's side of the trust boundary."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from stallwatch.kernel import safefs


def test_a_symlink_in_a_users_directory_is_never_followed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    os.symlink(tmp_path / "real" / "f", tmp_path / "flink")
    if os.geteuid() == 0:
        os.chown(tmp_path, 65534, 65534, follow_symlinks=False)  # the user's directory
        os.lchown(tmp_path / "link", 0, 0)  # root's own link, but in the user's directory
    with pytest.raises(safefs.UnsafePath, match="'link' is a symlink"):
        safefs.open_dir(tmp_path / "link")
    with pytest.raises(safefs.UnsafePath, match="is a symlink: not followed"):
        safefs.open_file(tmp_path / "flink")
    with pytest.raises(safefs.UnsafePath, match="is a symlink: not followed"):
        safefs.subdir(safefs.open_dir(tmp_path), "link")
    fd = safefs.open_file(tmp_path / "real" / "f")
    assert os.read(fd, 10) == b"x"
    os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a link only root could have made")
def test_a_link_only_root_could_make_is_followed(tmp_path: Path) -> None:
    root_dir = tmp_path / "admin"
    root_dir.mkdir(mode=0o755)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f").write_text("y")
    os.symlink(tmp_path / "data", root_dir / "data")  # /data -> /mnt/data, say
    fd = safefs.open_file(root_dir / "data" / "f")
    assert os.read(fd, 10) == b"y"
    os.close(fd)
    root_dir.chmod(0o777)  # now anyone could have replaced it: refused
    with pytest.raises(safefs.UnsafePath):
        safefs.open_file(root_dir / "data" / "f")


def test_only_regular_files_and_bounded_reads(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name in ("fifo", "dir"):  # the FIFO must not block the open
        with pytest.raises(safefs.UnsafePath, match="not a regular file"):
            safefs.open_file(tmp_path / name)
    with pytest.raises(safefs.UnsafePath, match="not a regular file"):
        safefs.open_file("/dev/zero")
    (tmp_path / "big").write_bytes(b"1" * 100)
    assert safefs.read_bounded(tmp_path / "big", 100) == b"1" * 100
    with pytest.raises(OSError) as e:
        safefs.read_bounded(tmp_path / "big", 99)
    assert e.value.errno == errno.EFBIG


def test_create_makes_private_directories(tmp_path: Path) -> None:
    fd = safefs.open_dir(tmp_path / "a" / "b", create=True)
    os.close(fd)
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o700
    assert [e.name for e in safefs.fd_dir(safefs.open_dir(tmp_path))] == ["a"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_the_walk_needs_search_permission_only() -> None:
    """As the kernel's own walk: a user passes through an exec-only (0711) directory."""
    top = Path(tempfile.mkdtemp(prefix="swsafefs-"))  # pytest's own tmp is 0700: not reachable
    try:
        _walk_as_nobody(top)
    finally:
        shutil.rmtree(top)


def _walk_as_nobody(top: Path) -> None:
    (top / "home").mkdir(parents=True)
    top.chmod(0o711)
    os.chown(top / "home", 65534, 65534)
    code = ("import os, sys; from stallwatch.kernel import safefs; "
            f"fd = safefs.open_file({str(top / 'home' / 'log')!r}, os.O_WRONLY | os.O_CREAT); "
            "os.write(fd, b'ok')")
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                        python, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert r.returncode == 0, r.stderr
    assert (top / "home" / "log").read_bytes() == b"ok"
    assert (top / "home" / "log").stat().st_uid == 65534


def test_readable_by_follows_the_mode_bits() -> None:
    st = os.stat_result((0o100640, 0, 0, 1, 1000, 100, 0, 0, 0, 0))
    assert safefs.readable_by(st, 1000, frozenset())
    assert safefs.readable_by(st, 2000, frozenset({100}))
    assert not safefs.readable_by(st, 2000, frozenset({5}))
    assert safefs.readable_by(st, 0, frozenset())


def test_no_descriptor_is_left_open(tmp_path: Path) -> None:
    """A daemon walks outputs trees for weeks: one fd lost per directory would end it."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        fd = safefs.open_dir(tmp_path)
        assert [e.name for e in safefs.fd_dir(fd)] == ["d"]
        sub = safefs.subdir(fd, "d")
        os.close(safefs.open_in(sub, "f"))
        os.close(sub)
        os.close(fd)
        safefs.read_bounded(tmp_path / "d" / "f", 10)
    assert len(os.listdir("/proc/self/fd")) == before


def _outcome(fn, path: str) -> tuple[str, object]:
    """What opening `path` gave: the directory's (dev, ino), or the error's type and text."""
    try:
        fd = fn(path)
    except OSError as e:
        return type(e).__name__, str(e)
    try:
        st = os.fstat(fd)
        return "ok", (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


def test_open_dir_split_answers_as_open_dir_whatever_the_path_became(tmp_path: Path) -> None:
    """The log follower's per-tick open (split once, issue 17): a plain path opened without the
    walk's parsing, anything else walked by open_dir's own code, so each answer is the same."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "a", tmp_path / "link")
    if os.geteuid() == 0:
        os.chown(tmp_path, 65534, 65534)  # the user's directory: its links are not followed
    root_dir = tmp_path / "admin"
    if os.geteuid() == 0:
        root_dir.mkdir(mode=0o755)
        os.chown(tmp_path / "a", 0, 0)
        os.symlink(tmp_path / "a", root_dir / "data")  # a link only root could make: followed
    cases = [tmp_path / "a" / "b", tmp_path / "a", tmp_path / "missing" / "b", tmp_path / "file" / "b",
             tmp_path / "link" / "b", tmp_path / "link", root_dir / "data" / "b", Path("/")]
    seen: list[str] = []
    for p in map(str, cases):
        parts = safefs.split_dir(p)
        want = _outcome(safefs.open_dir, p)
        assert _outcome(lambda q, parts=parts: safefs.open_dir_split(q, parts), p) == want, p
        seen.append(want[0])
    assert seen == ["ok", "ok", "FileNotFoundError", "NotADirectoryError", "UnsafePath", "UnsafePath",
                    "ok" if os.geteuid() == 0 else "FileNotFoundError", "ok"], seen
    # a component that becomes a link after the split is refused, as open_dir refuses it
    p = str(tmp_path / "a" / "b")
    parts = safefs.split_dir(p)
    os.rename(tmp_path / "a", tmp_path / "a2")
    os.symlink(tmp_path / "a2", tmp_path / "a")
    got = _outcome(lambda q: safefs.open_dir_split(q, parts), p)
    assert got == _outcome(safefs.open_dir, p) and got[0] == "UnsafePath", got
    assert safefs.split_dir("rel/path") is None
    with pytest.raises(safefs.UnsafePath, match="not an absolute path"):
        safefs.open_dir_split("rel/path", None)
