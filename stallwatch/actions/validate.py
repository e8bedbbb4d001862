"""Before a resume: find the outputs a killed job left broken, and move them aside.

A job that writes `torch.save` files straight to their final path (SpecForge does) and resumes
by skipping files that exist treats a file truncated by the kill as done, forever. So before the
resume, the files written around the failure are checked, and the broken ones are moved to a
quarantine folder — never deleted, never overwriting anything — so the job writes them again.

What `validate_file` checks, cheapest first (each one is necessary, none alone sufficient):

- every file: it exists, is a regular file, and is not empty;
- a zip archive (`torch.save` since 1.6 writes one, whatever the suffix): the end-of-central-
  directory record and the central directory are whole (`zipfile` refuses the file otherwise —
  a truncated file loses its tail, which is where they live); every member lies before the
  central directory; for torch files, `data.pkl` parses as a pickle *without running it* (every
  global is replaced by an inert stub, nothing is imported or called) and every tensor storage it
  references exists as a member of the size its element type and count say; then, unless the
  members add up to more than `crc_max_bytes` (default 256 MiB, about 0.1 s a 64 MiB file),
  every member is read and its CRC-32 compared;
- a legacy (non-zip) torch file: the magic number, protocol, system-info, object and
  storage-key pickles parse the same inert way, and the file is exactly as long as the storages
  they announce (8-byte count + data each);
- `.safetensors`: the 8-byte header length, the JSON header, and the tensors' byte ranges, which
  must tile the data section to the very last byte of the file;
- with torch importable (and `use_torch` not False): `torch.load(path, weights_only=True,
  map_location="cpu")` as the final word for torch files. A file torch refuses only because
  `weights_only` does not allow one of its classes is structurally whole: it is reported valid,
  with that note, rather than quarantined (recomputing it would not change it).

A file of another type is only checked to be non-empty.
"""

from __future__ import annotations

import errno
import fnmatch
import gzip
import hashlib
import importlib.util
import json
import os
import pickle
import stat as _stat
import struct
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import IO, Any, Callable, Collection, Iterable, NamedTuple

from stallwatch import safefs
from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.model import Frozen

__all__ = [
    "DEFAULT_PATTERNS", "FileCheck", "Quarantined", "Skipped", "ValidationReport",
    "quarantine_file", "validate_file", "validate_outputs",
]

DEFAULT_PATTERNS = ("*.pt", "*.ckpt", "*.pth", "*.safetensors", "*.ckpt.gz", "*.pt.gz")
TORCH_SUFFIXES = (".pt", ".ckpt", ".pth")
# SpecForge's --compress writes gzip-wrapped torch.save as data_N.ckpt.gz (docs/upstream.md §2). The
# whole stream is inflated (gzip's own CRC-32 and length trailer are checked at its end) into an
# anonymous temporary file outside the outputs, then checked as the torch file it holds.
GZIP_MAX_BYTES = 4 << 30
CRC_MAX_BYTES = 256 << 20
PICKLE_MAX_BYTES = 64 << 20  # data.pkl of a tensor dict is a few KiB; a bigger one is not parsed
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
MANIFEST = "MANIFEST.jsonl"

# Bytes per element of torch's typed storage classes, as data.pkl names them.
ELEMENT_SIZES = {
    "DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2,
    "LongStorage": 8, "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1,
    "BoolStorage": 1, "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16,
    "UntypedStorage": 1, "QInt8Storage": 1, "QUInt8Storage": 1, "QInt32Storage": 4,
    "QUInt4x2Storage": 1, "QUInt2x4Storage": 1,
}
SAFETENSORS_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
    "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8,
}


class FileCheck(NamedTuple):
    ok: bool
    reason: str


class Quarantined(NamedTuple):
    src: str
    dst: str
    reason: str


class Skipped(NamedTuple):
    path: str
    reason: str


class ValidationReport(Frozen):
    outputs_dir: str
    quarantine_dir: str
    since_wall: float | None
    dry_run: bool = False
    scanned: int = 0  # files seen in the walk (any name, any age)
    checked: int = 0  # files validated
    valid: int = 0
    quarantined: tuple[Quarantined, ...] = ()  # in a dry run: what would have been moved
    skipped: tuple[Skipped, ...] = ()  # candidates not checked, and why
    errors: tuple[str, ...] = ()  # broken files that could NOT be moved, walk errors
    notes: tuple[str, ...] = ()  # worth knowing, not in the way of a resume
    duration_s: float = 0.0

    @property
    def safe_to_resume(self) -> bool:
        """Every candidate was checked and every broken one moved aside."""
        return not self.errors and not self.skipped and not self.dry_run


# ------------------------------------------------------------------------------ one file


class _Stub:
    """Base of what every global in a checked pickle becomes: a real class (NEWOBJ needs one)
    whose instances accept any arguments, state and items, and do nothing."""

    _module = _name = ""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._args = args

    def __call__(self, *args: Any, **kw: Any) -> "_Stub":
        return _Stub(*args)  # what a stub returned, called in turn (getattr(x, "f")(...))

    def __setstate__(self, state: Any) -> None:
        self._state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


class _InertUnpickler(pickle.Unpickler):
    """Parses a pickle completely without importing or calling anything it names; collects
    torch's storage references (persistent ids)."""

    def __init__(self, f: IO[bytes]) -> None:
        super().__init__(f)
        self.storages: list[tuple[str, str, int]] = []  # (key, storage type name, numel)
        self._classes: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        cls = self._classes.get(key)
        if cls is None:
            cls = type("Stub", (_Stub,), {"_module": module, "_name": name})
            self._classes[key] = cls
        return cls

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            stype = pid[1]
            tname = getattr(stype, "_name", None) or str(stype)
            try:
                self.storages.append((str(pid[2]), tname, int(pid[4])))
            except (TypeError, ValueError):
                pass
        return _Stub()


def _parse_pickle(f: IO[bytes]) -> tuple[Any, _InertUnpickler]:
    u = _InertUnpickler(f)
    return u.load(), u


def _is_zip(head: bytes) -> bool:
    return head[:4] in (b"PK\x03\x04", b"PK\x05\x06")


def _check_zip(path: Path | IO[bytes], size: int, torch_file: bool,
               crc_max_bytes: int | None) -> FileCheck:
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        return FileCheck(False, f"zip archive not whole (truncated?): {_what(exc)}")
    except (OSError, ValueError, EOFError) as exc:
        return FileCheck(False, f"zip archive unreadable: {_what(exc)}")
    with zf:
        infos = zf.infolist()
        start_dir = getattr(zf, "start_dir", size)
        for n, info in enumerate(infos):
            # 30 bytes of local header + name: the member's data must end before the directory.
            if info.header_offset + 30 + len(info.filename) + info.compress_size > start_dir:
                return FileCheck(False, f"member #{n} runs past the central directory")
        notes = []
        if torch_file:
            pkls = [i for i in infos if i.filename.endswith("data.pkl")]
            if not pkls:
                return FileCheck(False, "zip archive without data.pkl: not a torch.save file")
            pkl = min(pkls, key=lambda i: i.filename.count("/"))
            prefix = pkl.filename[: -len("data.pkl")]
            if pkl.file_size > PICKLE_MAX_BYTES:
                notes.append(f"data.pkl is {pkl.file_size} bytes: not parsed")
            else:
                try:
                    with zf.open(pkl) as f:
                        _, u = _parse_pickle(f)
                except Exception as exc:
                    return FileCheck(False, f"data.pkl does not parse: {_what(exc)}")
                members = {i.filename: i for i in infos}
                for n, (key, tname, numel) in enumerate(u.storages):
                    m = members.get(f"{prefix}data/{key}")
                    if m is None:
                        return FileCheck(False, f"storage #{n} missing from the archive")
                    elem = ELEMENT_SIZES.get(tname)
                    if elem is not None and m.file_size != numel * elem:
                        return FileCheck(False, f"storage #{n} holds {m.file_size} bytes, "
                                                f"{numel} x {tname} needs {numel * elem}")
        total = sum(i.file_size for i in infos)
        if crc_max_bytes is not None and total > crc_max_bytes:
            notes.append(f"CRC not checked: {total} bytes of members > {crc_max_bytes}")
        else:
            for n, info in enumerate(infos):
                try:
                    with zf.open(info) as f:
                        while f.read(1 << 20):
                            pass  # ZipExtFile compares the CRC-32 at the end of the member
                except zipfile.BadZipFile as exc:
                    return FileCheck(False, f"member #{n}: bad CRC-32 or data ({_what(exc)})")
                except (OSError, EOFError, ValueError, zipfile.LargeZipFile) as exc:
                    return FileCheck(False, f"member #{n} unreadable: {_what(exc)}")
        what = "torch zip archive" if torch_file else "zip archive"
        return FileCheck(True, f"{what} whole, {len(infos)} members"
                               + (f"; {'; '.join(notes)}" if notes else ""))


def _check_legacy_torch(path: Path, size: int) -> FileCheck:
    try:
        with open(path, "rb") as f:
            try:
                magic, _ = _parse_pickle(f)
            except Exception as exc:
                return FileCheck(False, f"neither a zip archive nor a pickle: {_what(exc)}")
            if magic != LEGACY_MAGIC:
                return FileCheck(False, "a pickle without torch's magic number: not a "
                                        "torch.save file")
            try:
                for _ in range(2):  # protocol version, sys_info
                    _parse_pickle(f)
                _, u = _parse_pickle(f)  # the object
                keys, _ = _parse_pickle(f)  # storage keys, in the order of the data
            except Exception as exc:
                return FileCheck(False, f"legacy torch file cut inside its pickles: "
                                        f"{_what(exc)}")
            pos = f.tell()
    except OSError as exc:
        return FileCheck(False, f"unreadable: {_what(exc)}")
    by_key = {k: (t, n) for k, t, n in u.storages}
    if not isinstance(keys, list) or any(k not in by_key for k in keys):
        return FileCheck(False, "legacy torch file: storage keys do not match its object")
    expected = pos
    for k in keys:
        tname, numel = by_key[k]
        elem = ELEMENT_SIZES.get(tname)
        if elem is None:
            return FileCheck(True, f"legacy torch file: pickles whole; length not checked "
                                   f"({tname} unknown)")
        expected += 8 + numel * elem
    if size != expected:
        return FileCheck(False, f"legacy torch file is {size} bytes, its storages need "
                                f"{expected}")
    return FileCheck(True, f"legacy torch file whole, {len(keys)} storages")


def _check_safetensors(path: Path, size: int) -> FileCheck:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return FileCheck(False, f"safetensors file of {size} bytes has no header")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 << 20):
                return FileCheck(False, f"safetensors header length {n} exceeds the file")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        return FileCheck(False, f"safetensors header unreadable: {_what(exc)}")
    if not isinstance(header, dict):
        return FileCheck(False, "safetensors header is not an object")
    data = size - 8 - n
    end = 0
    try:
        for n, (name, t) in enumerate(header.items()):
            if name == "__metadata__":
                continue
            b, e = (int(x) for x in t["data_offsets"])
            elem = SAFETENSORS_SIZES.get(t["dtype"])
            numel = 1
            for d in t["shape"]:
                numel *= int(d)
            if not 0 <= b <= e or (elem is not None and e - b != numel * elem):
                return FileCheck(False, f"tensor #{n}: bad byte range {b}..{e}")
            end = max(end, e)
    except (KeyError, TypeError, ValueError) as exc:
        return FileCheck(False, f"safetensors header malformed: {_what(exc)}")
    if end != data:
        return FileCheck(False, f"safetensors data is {data} bytes, its tensors need {end}")
    return FileCheck(True, f"safetensors whole, {len(header)} entries")


_torch_mod: Any = None


def _torch() -> Any:
    global _torch_mod
    if _torch_mod is None:
        if importlib.util.find_spec("torch") is None:
            _torch_mod = False
        else:
            import torch  # optional: the final word when installed (several seconds to import)
            _torch_mod = torch
    return _torch_mod or None


def _torch_load(path: Path, structural: FileCheck) -> FileCheck:
    torch = _torch()
    try:
        torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:
        if "Weights only load failed" in str(exc) and structural.ok:
            return FileCheck(True, f"{structural.reason}; torch.load(weights_only=True) refused "
                                   "one of its classes (the file itself is whole)")
        return FileCheck(False, f"torch.load failed: {_what(exc)}")
    return FileCheck(True, f"{structural.reason}; torch.load ok")


def _what(exc: BaseException) -> str:
    """An exception as a reason: its type, and its text only for an OSError (errno words).
    Parsers' messages quote the bytes they choke on ("invalid load key, 'x'", a member's name):
    a reason travels into alerts and logs, and file bytes are the job user's to choose."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    return type(exc).__name__


def validate_file(path: str | os.PathLike[str], *, crc_max_bytes: int | None = CRC_MAX_BYTES,
                  use_torch: bool | None = None, name: str | None = None) -> FileCheck:
    """(ok, reason) for one output file. use_torch: None = when importable, False = never,
    True = when importable, noting its absence. Reads only this file; never raises for a bad
    file (an OSError reading it is a reason). `name`: the file's name when `path` is not it
    (/proc/self/fd/N); its suffix says the type. Reasons never quote the file's bytes."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return FileCheck(False, "missing")
    except OSError as exc:
        return FileCheck(False, f"cannot stat: {_what(exc)}")
    if not _stat.S_ISREG(st.st_mode):
        return FileCheck(False, "not a regular file")
    if st.st_size == 0:
        return FileCheck(False, "empty: 0 bytes (killed before its first write)")
    try:
        with open(p, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        return FileCheck(False, f"unreadable: {_what(exc)}")
    suffix = Path(name or p.name).suffix.lower()
    if suffix == ".gz":
        return _check_gzip(p, crc_max_bytes, name or p.name)
    torch_file = suffix in TORCH_SUFFIXES
    if suffix == ".safetensors":
        return _check_safetensors(p, st.st_size)
    if _is_zip(head):
        res = _check_zip(p, st.st_size, torch_file, crc_max_bytes)
    elif torch_file:
        res = _check_legacy_torch(p, st.st_size)
    else:
        return FileCheck(True, f"{st.st_size} bytes; type not known, only non-emptiness checked")
    if torch_file and res.ok and use_torch is not False:
        if _torch() is not None:
            return _torch_load(p, res)
        if use_torch:
            return FileCheck(True, f"{res.reason}; torch not installed: not loaded")
    return res


def _check_gzip(p: Path, crc_max_bytes: int | None, name: str) -> FileCheck:
    """`data_N.ckpt.gz`: gunzip whole (a truncated stream fails at its end: EOFError; a damaged
    one at its CRC), then the torch zip checks on what it held. torch.load is not run: the zip,
    pickle, storage sizes and member CRCs already say whether the inner file is whole."""
    inner_suffix = Path(name[: -len(".gz")]).suffix.lower()
    try:
        with gzip.open(p, "rb") as src, tempfile.TemporaryFile() as tmp:
            n = 0
            while chunk := src.read(1 << 20):
                n += len(chunk)
                if n > GZIP_MAX_BYTES:
                    return FileCheck(True, f"gzip stream over {GZIP_MAX_BYTES} bytes inflated: "
                                           "not checked further")
                tmp.write(chunk)
            tmp.seek(0)
            head = tmp.read(8)
            tmp.seek(0)
            if not _is_zip(head):
                if inner_suffix in TORCH_SUFFIXES:
                    return FileCheck(False, "gzip whole, but what it holds is not a torch zip archive")
                return FileCheck(True, f"gzip whole ({n} bytes inflated); inner type not checked")
            res = _check_zip(tmp, n, inner_suffix in TORCH_SUFFIXES, crc_max_bytes)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        return FileCheck(False, f"gzip stream not whole (truncated or a bad CRC): {_what(exc)}")
    except OSError as exc:
        return FileCheck(False, f"gzip unreadable: {_what(exc)}")
    return FileCheck(res.ok, f"gzip whole ({n} bytes inflated); {res.reason}")


# --------------------------------------------------------------------------- quarantine
#
# Everything below is on the job user's side of the trust boundary (docs/security.md): the
# outputs tree is resolved once into directory fds (stallwatch.safefs) and every stat, open,
# link, copy and unlink is relative to them, never by path again. A directory swapped for a
# symlink after the walk, timed with inotify, then leads nowhere: a name that became a symlink,
# a device node or another file is refused by O_NOFOLLOW, fstat and the (st_dev, st_ino)
# recorded at the walk. The quarantine itself is root's (state_dir/quarantine/<job>, 0700).


# Where the quarantine cannot take a file (its filesystem full or read-only), the file is
# renamed aside in its own folder with this suffix, which no output pattern matches, so
# neither the resume nor a later validation takes it for an output.
ASIDE_SUFFIX = ".stallwatch-broken"
_QUARANTINE_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


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


def _move_at(src_dfd: int, name: str, src_fd: int, dst_dfd: int, dst_name: str) -> str:
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
    _move_at). Neither path's directories are followed through a link another user could
    have made (stallwatch.safefs); dst's are created 0700."""
    src, dst = Path(src), Path(dst)
    sdfd = safefs.open_dir(src.parent)
    try:
        fd = safefs.open_in(sdfd, src.name, where=str(src))
        try:
            ddfd = safefs.open_dir(dst.parent, create=True)
            try:
                return dst.parent / _move_at(sdfd, src.name, fd, ddfd, dst.name)
            finally:
                os.close(ddfd)
        finally:
            os.close(fd)
    finally:
        os.close(sdfd)


# ------------------------------------------------------------------------------ the tree


def _matches(name: str, patterns: Collection[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


class _Found(NamedTuple):
    mtime: float
    ident: tuple[int, int]


def _walk(out_fd: int, out_dir: Path, patterns: Collection[str], since_wall: float | None,
          skip_ident: tuple[int, int] | None, max_depth: int, errors: list[str],
          skipped: list[Skipped]) -> tuple[int, dict[tuple[str, ...], _Found]]:
    """Iterative (a stack of relative paths, no recursion), one open directory at a time,
    never below `max_depth` levels (a 1,500-deep tree is reported, not followed into a
    RecursionError). Returns (names seen, matching regular files)."""
    found: dict[tuple[str, ...], _Found] = {}
    scanned = 0
    stack: list[tuple[str, ...]] = [()]
    while stack:
        parts = stack.pop()
        try:
            dfd = safefs.open_rel(out_fd, parts)
        except FileNotFoundError:
            continue  # removed during the walk
        except OSError as exc:
            errors.append(f"walk {out_dir.joinpath(*parts)}: {exc.strerror or exc}")
            continue
        try:
            for entry in safefs.fd_dir(dfd):
                # d_type first (no system call): a name is stat'ed only when it is a directory
                # or matches a pattern, as on a 10^6-file tree most names do not.
                is_dir = entry.is_dir(follow_symlinks=False)
                if not is_dir:
                    scanned += 1
                    if not _matches(entry.name, patterns):
                        continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if is_dir:
                    if (st.st_dev, st.st_ino) == skip_ident:
                        continue  # the quarantine, inside the tree
                    if len(parts) + 1 > max_depth:
                        skipped.append(Skipped(str(out_dir.joinpath(*parts, entry.name)),
                                               f"deeper than max_depth={max_depth}: not walked"))
                        continue
                    stack.append((*parts, entry.name))
                    continue
                if not _stat.S_ISREG(st.st_mode):
                    continue  # symlinks, FIFOs, devices: not outputs the job wrote
                if since_wall is None or st.st_mtime >= since_wall:
                    found[(*parts, entry.name)] = _Found(st.st_mtime, (st.st_dev, st.st_ino))
        except OSError as exc:
            errors.append(f"walk {out_dir.joinpath(*parts)}: {exc.strerror or exc}")
        finally:
            os.close(dfd)
    return scanned, found


def _rel_parts(path: str | os.PathLike[str], out_dir: Path) -> tuple[str, ...] | None:
    """path's components below out_dir, lexically (never resolved), or None when outside."""
    rel = os.path.relpath(os.path.normpath(os.path.abspath(path)), os.path.normpath(out_dir))
    if rel == "." or rel.startswith(".." + os.sep) or rel == "..":
        return None
    return tuple(rel.split(os.sep))


def validate_outputs(
    outputs_dir: str | os.PathLike[str],
    since_wall: float | None,
    quarantine_dir: str | os.PathLike[str],
    *,
    patterns: Collection[str] = DEFAULT_PATTERNS,
    max_files: int = 10_000,
    max_depth: int = 64,
    open_paths: Collection[str | os.PathLike[str]] = (),
    candidates: Iterable[str | os.PathLike[str]] = (),
    dry_run: bool = False,
    budget_s: float | None = None,
    clock: Clock = SYSTEM_CLOCK,
    check: Callable[[Path], FileCheck] | None = None,
    crc_max_bytes: int | None = CRC_MAX_BYTES,
    use_torch: bool | None = None,
) -> ValidationReport:
    """Check the outputs written at or after `since_wall` (mtime; None: all) and move the broken
    ones to `quarantine_dir`, keeping their path relative to `outputs_dir`.

    This blocks on the outputs filesystem: run it in a worker with a deadline, after the kill is
    `done`, never on the daemon's tick. It walks the whole tree (one stat per name) but
    validates only recent files, newest first, at most `max_files` of them and within
    `budget_s`; `candidates` (e.g. the files the job had open for writing when it was killed)
    are checked whatever their age. Files in `open_paths` (open for writing by a live process)
    are skipped: moving a file under its writer helps nobody. A quarantine folder inside the
    outputs tree is left out of the walk. Anything skipped makes the report not
    `safe_to_resume`. Each file is validated through the fd it was opened by
    (/proc/self/fd/N), so what is checked is what is moved.
    """
    t0 = clock.monotonic()
    out_dir = Path(os.path.normpath(os.path.abspath(outputs_dir)))
    qdir = Path(quarantine_dir)
    errors: list[str] = []
    notes: list[str] = []
    skipped: list[Skipped] = []
    quarantined: list[Quarantined] = []

    def report(scanned: int = 0, checked: int = 0, valid: int = 0) -> ValidationReport:
        return ValidationReport(
            outputs_dir=str(out_dir), quarantine_dir=str(qdir), since_wall=since_wall,
            dry_run=dry_run, scanned=scanned, checked=checked, valid=valid,
            quarantined=tuple(quarantined), skipped=tuple(skipped), errors=tuple(errors),
            notes=tuple(notes), duration_s=clock.monotonic() - t0)

    try:
        out_fd = safefs.open_dir(out_dir)
    except FileNotFoundError:
        notes.append(f"{out_dir} does not exist: nothing was written, nothing to check")
        return report()
    except OSError as exc:
        errors.append(f"outputs: {exc}")
        return report()
    q_fd: int | None = None
    try:
        try:
            q_fd = safefs.open_dir(qdir, create=not dry_run)
            qst = os.fstat(q_fd)
            q_ident: tuple[int, int] | None = (qst.st_dev, qst.st_ino)
        except FileNotFoundError:
            q_ident = None  # a dry run creates nothing
        except OSError as exc:
            errors.append(f"quarantine: {exc}")
            return report()
        scanned, found = _walk(out_fd, out_dir, patterns, since_wall, q_ident, max_depth,
                               errors, skipped)
        for c in candidates:
            parts = _rel_parts(c, out_dir)
            if parts is None:
                skipped.append(Skipped(str(c), "outside the outputs directory: not touched"))
                continue
            if parts in found:
                continue
            try:
                pfd = safefs.open_rel(out_fd, parts[:-1])
                try:
                    st = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
                finally:
                    os.close(pfd)
            except FileNotFoundError:
                continue  # never written: the resume writes it
            except OSError as exc:
                errors.append(f"stat {c}: {exc.strerror or exc}")
                continue
            if _stat.S_ISREG(st.st_mode):
                found[parts] = _Found(st.st_mtime, (st.st_dev, st.st_ino))

        writing = {p for p in (_rel_parts(o, out_dir) for o in open_paths) if p is not None}
        order = sorted(found, key=lambda p: (-found[p].mtime, p))  # newest first
        checked = valid = 0
        for i, parts in enumerate(order):
            path = str(out_dir.joinpath(*parts))
            if i >= max_files:
                skipped.extend(Skipped(str(out_dir.joinpath(*p)), f"over max_files={max_files}")
                               for p in order[i:])
                break
            if budget_s is not None and clock.monotonic() - t0 > budget_s:
                skipped.extend(Skipped(str(out_dir.joinpath(*p)),
                                       f"over the time budget of {budget_s:g} s")
                               for p in order[i:])
                break
            if parts in writing:
                skipped.append(Skipped(path, "open for writing by a live process"))
                continue
            ok = _check_one(out_fd, parts, found[parts].ident, path, q_fd, qdir, check, dry_run,
                            crc_max_bytes, use_torch, clock, errors, notes, quarantined)
            if ok is None:
                continue
            checked += 1
            valid += ok
        return report(scanned, checked, valid)
    finally:
        os.close(out_fd)
        if q_fd is not None:
            os.close(q_fd)


def _check_one(out_fd: int, parts: tuple[str, ...], ident: tuple[int, int], path: str,
               q_fd: int | None, qdir: Path, check: Callable[[Path], FileCheck] | None,
               dry_run: bool, crc_max_bytes: int | None, use_torch: bool | None, clock: Clock,
               errors: list[str], notes: list[str], quarantined: list[Quarantined]) -> bool | None:
    """Validate one file through its fd; move it when broken. True/False: valid or not; None:
    not checked (gone, or no longer the file the walk saw)."""
    try:
        pfd = safefs.open_rel(out_fd, parts[:-1])
    except FileNotFoundError:
        return None
    except OSError as exc:
        errors.append(f"{path}: {exc.strerror or exc}")
        return None
    try:
        try:
            fd = safefs.open_in(pfd, parts[-1], where=path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            errors.append(f"{path}: not checked: {exc.strerror or exc}")
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != ident:
                errors.append(f"{path}: replaced during the validation: not checked")
                return None
            via = Path(f"/proc/self/fd/{fd}")
            try:
                if check is not None:
                    ok, reason = check(via)
                else:
                    ok, reason = validate_file(via, crc_max_bytes=crc_max_bytes,
                                               use_torch=use_torch, name=parts[-1])
            except Exception as exc:  # a checker bug must not stop the others
                ok, reason = False, f"check failed: {type(exc).__name__}"
            if ok:
                return True
            dst = qdir.joinpath(*parts)
            if dry_run:
                quarantined.append(Quarantined(path, str(dst), reason))
                return False
            try:
                assert q_fd is not None
                qpfd = safefs.open_rel(q_fd, parts[:-1], create=True)
                try:
                    moved = _move_at(pfd, parts[-1], fd, qpfd, parts[-1])
                finally:
                    os.close(qpfd)
                dst = dst.parent / moved
            except OSError as exc:
                if exc.errno not in _QUARANTINE_FULL:
                    errors.append(f"{path} is broken ({reason}) but could not be quarantined: "
                                  f"{exc.strerror or exc}")
                    return False
                # The quarantine's filesystem (the state directory's) is full or read-only:
                # the broken file is renamed aside in its own directory instead, relative to
                # the same fd (a hard link to a free name, then the old name unlinked: never
                # replacing a name, never following one). Giving up here would stop a job
                # over a full /var; leaving the file would make the resume skip it forever.
                try:
                    moved = _move_at(pfd, parts[-1], fd, pfd, parts[-1] + ASIDE_SUFFIX)
                except OSError as exc2:
                    errors.append(f"{path} is broken ({reason}) but could not be quarantined "
                                  f"({exc.strerror or exc}) nor renamed aside: "
                                  f"{exc2.strerror or exc2}")
                    return False
                dst = Path(path).parent / moved
                reason = (f"{reason}; renamed aside in place: the quarantine could not take it "
                          f"({exc.strerror or exc})")
            quarantined.append(Quarantined(path, str(dst), reason))
            _manifest(q_fd, parts, path, dst, reason, clock, notes)
            return False
        finally:
            os.close(fd)
    finally:
        os.close(pfd)


def _manifest(q_fd: int, parts: tuple[str, ...], src: str, dst: Path, reason: str,
              clock: Clock, notes: list[str]) -> None:
    """One JSON line per moved file, in the quarantine (root's), so a person finds out later
    why it is there. Names are data: JSON strings, every non-ASCII or undecodable byte escaped
    (`\\udcXX` for a byte that is not UTF-8), never text a shell could read."""
    line = json.dumps({"at": clock.time(), "src": src, "dst": str(dst),
                       "relative": list(parts), "reason": reason}, ensure_ascii=True) + "\n"
    try:
        fd = safefs.open_in(q_fd, MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode("ascii"))
        finally:
            os.close(fd)
    except OSError as exc:
        notes.append(f"manifest not written for {dst}: {exc.strerror or exc}")
