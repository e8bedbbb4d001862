"""One output file: is it whole? `validate_file`, which actions/validate.py runs before a resume.

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

import gc
import gzip
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
from typing import IO, Any, NamedTuple

__all__ = ["CRC_MAX_BYTES", "FileCheck", "LEGACY_MAGIC", "validate_file"]

TORCH_SUFFIXES = (".pt", ".ckpt", ".pth")
# SpecForge's --compress writes gzip-wrapped torch.save as data_N.ckpt.gz (docs/upstream.md §2). The
# whole stream is inflated (gzip's own CRC-32 and length trailer are checked at its end) into an
# anonymous temporary file outside the outputs, then checked as the torch file it holds.
GZIP_MAX_BYTES = 4 << 30
CRC_MAX_BYTES = 256 << 20
PICKLE_MAX_BYTES = 64 << 20  # data.pkl of a tensor dict is a few KiB; a bigger one is not parsed
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER

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



class _Stub:
    """Base of what every global in a checked pickle becomes: a real class (NEWOBJ needs one)
    whose instances accept any arguments, state and items, and do nothing."""

    _module = _name = ""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._args = args

    def __call__(self, *args: Any, **kw: Any) -> _Stub:
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
                except Exception as exc:  # noqa: BLE001 - the user's pickle may break the parser in any way: a bad file
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
            except Exception as exc:  # noqa: BLE001 - the user's pickle may break the parser in any way: a bad file
                return FileCheck(False, f"neither a zip archive nor a pickle: {_what(exc)}")
            if magic != LEGACY_MAGIC:
                return FileCheck(False, "a pickle without torch's magic number: not a "
                                        "torch.save file")
            try:
                for _ in range(2):  # protocol version, sys_info
                    _parse_pickle(f)
                _, u = _parse_pickle(f)  # the object
                keys, _ = _parse_pickle(f)  # storage keys, in the order of the data
            except Exception as exc:  # noqa: BLE001 - the user's pickle may break the parser in any way: a bad file
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
            # torch's import leaves ~160,000 objects for the cyclic GC to walk: every full
            # collection of the daemon walked them again (50 ms each), and so did its teardown
            # at exit: its stop after SIGTERM took 2.5 s beside six CPU hogs on two cores and
            # 20 s at a load of 34 (the unit's TimeoutStopSec is 30 s). Moved once to the
            # permanent generation, after a collection, they are skipped: 0.9 s beside the hogs
            # (torch is imported well after daemon/gcpolicy.py froze the start-up objects).
            gc.collect()
            gc.freeze()
    return _torch_mod or None


def _torch_load(path: Path, structural: FileCheck) -> FileCheck:
    torch = _torch()
    try:
        torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - torch.load raises anything on a bad file
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
