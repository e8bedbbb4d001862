"""`torch.save` files without torch: write them, read them back, check them.

torch's format (since 1.6) is a plain zip archive, every record STORED (uncompressed) and
64-byte aligned, under one top-level folder:

    archive/data.pkl                 the object, pickle protocol 2; each tensor is a call to
                                     torch._utils._rebuild_tensor_v2 whose storage is a
                                     persistent id ('storage', torch.FloatStorage, '0', 'cpu', numel)
    archive/.format_version          b"1"
    archive/.storage_alignment       b"64"
    archive/byteorder                b"little"
    archive/data/0, data/1 ...       the raw bytes of each storage
    archive/version                  b"3\\n"
    archive/.data/serialization_id   40 decimal digits

`torch.load` (also with `weights_only=True`, the default since torch 2.6) reads what `save`
writes here, and `load` reads what torch writes, with no torch installed. When torch is
installed, `save` simply calls `torch.save`.

The zip's central directory is written last, when the file is closed: a writer killed mid-file
leaves a file with no central directory, which `check` reports (and `torch.load` refuses with
"failed finding central directory"). By default `save` writes straight to the final path, like
SpecForge's `torch.save(data_point, output_file)`, so a killed job leaves such a file behind,
and a resume that skips files that exist treats it as done. `save(..., atomic=True)` writes a
temporary file in the same folder, fsyncs it and renames it over the final path: the fix users
should adopt, since a reader then sees either no file or a whole one.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import struct
import sys
import zipfile
import zlib
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Sequence

__all__ = ["Tensor", "PtFileError", "save", "load", "check", "DTYPES", "torch_available"]

# dtype -> (torch storage class name, item size, array typecode or None)
DTYPES: dict[str, tuple[str, int, str | None]] = {
    "float32": ("FloatStorage", 4, "f"),
    "float64": ("DoubleStorage", 8, "d"),
    "float16": ("HalfStorage", 2, None),
    "bfloat16": ("BFloat16Storage", 2, None),
    "int64": ("LongStorage", 8, "q"),
    "int32": ("IntStorage", 4, "i"),
    "int16": ("ShortStorage", 2, "h"),
    "int8": ("CharStorage", 1, "b"),
    "uint8": ("ByteStorage", 1, "B"),
    "bool": ("BoolStorage", 1, "B"),
}
_STORAGE_TO_DTYPE = {v[0]: k for k, v in DTYPES.items()}
ALIGNMENT = 64
_LITTLE = sys.byteorder == "little"


class PtFileError(Exception):
    """The file is not a complete, readable torch.save archive."""


def torch_available() -> bool:
    try:
        import torch  # noqa: F401 - whether it imports is the question
    except Exception:  # noqa: BLE001 - a broken torch install is "not available"
        return False
    return True


# --------------------------------------------------------------------------------- tensors


class Tensor:
    """A minimal CPU tensor: dtype, shape, and its storage's raw little-endian bytes.

    What `load` returns for each tensor, and what `save` accepts without torch. Views that
    torch saved with an offset or strides are kept as such; `tolist()` follows them.
    """

    __slots__ = ("dtype", "shape", "stride", "storage_offset", "storage")

    def __init__(self, dtype: str, shape: Sequence[int], storage: bytes,
                 stride: Sequence[int] | None = None, storage_offset: int = 0) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r} (have {', '.join(DTYPES)})")
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.stride = tuple(stride) if stride is not None else _contiguous_stride(self.shape)
        self.storage_offset = int(storage_offset)
        self.storage = bytes(storage)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_list(cls, values: Any, dtype: str = "float32") -> Tensor:
        """From a (rectangular) nested list of numbers, like torch.tensor(values, dtype=...)."""
        shape = _infer_shape(values)
        flat = _flatten(values, len(shape))
        return cls(dtype, shape, _pack(flat, dtype))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    def is_contiguous(self) -> bool:
        return self.stride == _contiguous_stride(self.shape)

    def contiguous_bytes(self) -> bytes:
        """The elements in row-major order, as raw bytes."""
        size = self.itemsize
        if self.is_contiguous():
            start = self.storage_offset * size
            return self.storage[start:start + self.numel * size]
        out = bytearray()
        for i in _indices(self.shape, self.stride, self.storage_offset):
            out += self.storage[i * size:(i + 1) * size]
        return bytes(out)

    def flat(self) -> list:
        return _unpack(self.contiguous_bytes(), self.dtype)

    def tolist(self) -> Any:
        flat = self.flat()
        if not self.shape:
            return flat[0]
        return _nest(flat, self.shape)

    def __repr__(self) -> str:
        return f"Tensor(dtype={self.dtype}, shape={list(self.shape)})"


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def _indices(shape: Sequence[int], stride: Sequence[int], offset: int) -> Iterable[int]:
    if not shape:
        yield offset
        return
    idx = [0] * len(shape)
    if any(s == 0 for s in shape):
        return
    while True:
        # shape and stride both come from the file: a short stride is not a crash here
        yield offset + sum(i * st for i, st in zip(idx, stride, strict=False))
        d = len(shape) - 1
        while d >= 0:
            idx[d] += 1
            if idx[d] < shape[d]:
                break
            idx[d] = 0
            d -= 1
        if d < 0:
            return


def _infer_shape(values: Any) -> tuple[int, ...]:
    shape = []
    v = values
    while isinstance(v, (list, tuple)):
        shape.append(len(v))
        if not v:
            break
        v = v[0]
    return tuple(shape)


def _flatten(values: Any, depth: int) -> list:
    if depth == 0:
        return [values]
    out = values
    for _ in range(depth - 1):
        nxt = []
        for row in out:
            nxt.extend(row)
        out = nxt
    return list(out)


def _nest(flat: list, shape: Sequence[int]) -> list:
    out: Any = flat
    for s in reversed(shape[1:]):
        out = [out[i:i + s] for i in range(0, len(out), s)] if s else [[] for _ in range(len(out))]
    return out


def _f32_to_bf16(words: Sequence[int]) -> list[int]:
    """float32 bit patterns -> bfloat16 bit patterns, round to nearest even (as torch does)."""
    out = []
    for u in words:
        if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN: keep it a (quiet) NaN
            out.append((u >> 16) | 0x40)
        else:
            out.append(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)
    return out


def _typecode(dtype: str) -> str:
    """The array module's typecode of a dtype that has one (bfloat16, float16, bool do not)."""
    code = DTYPES[dtype][2]
    if code is None:
        raise ValueError(f"{dtype}: no array typecode")
    return code


def _pack(flat: list, dtype: str) -> bytes:
    if dtype == "bfloat16":
        words = array("I", array("f", flat).tobytes())
        halves = array("H", _f32_to_bf16(words))
        if not _LITTLE:
            halves.byteswap()
        return halves.tobytes()
    if dtype == "float16":
        return struct.pack(f"<{len(flat)}e", *flat)
    if dtype == "bool":
        return bytes(1 if v else 0 for v in flat)
    arr = array(_typecode(dtype), flat)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def _unpack(raw: bytes, dtype: str) -> list:
    if dtype == "bfloat16":
        halves = array("H", raw)
        if not _LITTLE:
            halves.byteswap()
        return array("f", array("I", [h << 16 for h in halves]).tobytes()).tolist()
    if dtype == "float16":
        return list(struct.unpack(f"<{len(raw) // 2}e", raw))
    if dtype == "bool":
        return [b != 0 for b in raw]
    arr = array(_typecode(dtype), raw)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


# ----------------------------------------------------------------------------- pickle out


class _PickleWriter:
    """Protocol-2 pickle of plain data and Tensors, written opcode by opcode.

    The standard pickler would have to import torch to emit `torch._utils._rebuild_tensor_v2`
    and `torch.FloatStorage` as globals; writing the opcodes directly needs no torch, and the
    result is what torch.save emits (minus memo opcodes, which are optional).
    """

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")  # PROTO 2
        self.storages: list[bytes] = []

    def dump(self, obj: Any) -> bytes:
        self._save(obj)
        self.out += b"."  # STOP
        return bytes(self.out)

    def _global(self, module: str, name: str) -> None:
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    def _save(self, obj: Any) -> None:  # one branch per type, flat on purpose
        o = self.out
        if obj is None:
            o += b"N"
        elif obj is True:
            o += b"\x88"
        elif obj is False:
            o += b"\x89"
        elif isinstance(obj, int):
            if 0 <= obj < 0x100:
                o += b"K" + bytes([obj])
            elif 0 <= obj < 0x10000:
                o += b"M" + struct.pack("<H", obj)
            elif -0x80000000 <= obj < 0x80000000:
                o += b"J" + struct.pack("<i", obj)
            else:
                enc = pickle.encode_long(obj)
                o += b"\x8a" + bytes([len(enc)]) + enc
        elif isinstance(obj, float):
            o += b"G" + struct.pack(">d", obj)
        elif isinstance(obj, str):
            enc = obj.encode("utf-8", "surrogatepass")
            o += b"X" + struct.pack("<I", len(enc)) + enc
        elif isinstance(obj, Tensor):
            self._save_tensor(obj)
        elif isinstance(obj, tuple):
            if not obj:
                o += b")"
                return
            o += b"("
            for item in obj:
                self._save(item)
            o += b"t"
        elif isinstance(obj, list):
            o += b"]"
            for i in range(0, len(obj), 1000):
                o += b"("
                for item in obj[i:i + 1000]:
                    self._save(item)
                o += b"e"  # APPENDS
        elif isinstance(obj, dict):
            o += b"}"
            items = list(obj.items())
            for i in range(0, len(items), 1000):
                o += b"("
                for k, v in items[i:i + 1000]:
                    self._save(k)
                    self._save(v)
                o += b"u"  # SETITEMS
        else:
            raise TypeError(f"cannot save {type(obj).__name__} without torch "
                            "(plain data and ptfile.Tensor only)")

    def _save_tensor(self, t: Tensor) -> None:
        key = str(len(self.storages))
        data = t.contiguous_bytes()
        self.storages.append(data)
        o = self.out
        self._global("torch._utils", "_rebuild_tensor_v2")
        o += b"("  # args
        o += b"("  # persistent id tuple
        self._save("storage")
        self._global("torch", DTYPES[t.dtype][0])
        self._save(key)
        self._save("cpu")
        self._save(t.numel)
        o += b"tQ"  # TUPLE, BINPERSID
        self._save(0)  # storage offset
        self._save(t.shape)
        self._save(_contiguous_stride(t.shape))
        self._save(False)  # requires_grad
        self._global("collections", "OrderedDict")
        o += b")R"  # backward hooks: OrderedDict()
        o += b"tR"  # TUPLE, REDUCE


# -------------------------------------------------------------------------------- writing


def _archive_writer(fp: io.BufferedIOBase, prefix: str, records: list[tuple[str, bytes]]) -> None:
    with zipfile.ZipFile(fp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data in records:
            zi = zipfile.ZipInfo(f"{prefix}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            zi.compress_type = zipfile.ZIP_STORED
            # Pad the local header's extra field (id "FB", as torch does) so the data starts on
            # a 64-byte boundary: torch.load(mmap=True) maps storages in place.
            pos = fp.tell()
            fixed = 30 + len(zi.filename.encode("utf-8")) + 4
            pad = (-(pos + fixed)) % ALIGNMENT
            zi.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
            zf.writestr(zi, data)


def _records(obj: Any) -> list[tuple[str, bytes]]:
    writer = _PickleWriter()
    pkl = writer.dump(obj)
    recs = [("data.pkl", pkl), (".format_version", b"1"), (".storage_alignment", b"64"),
            ("byteorder", b"little")]
    recs += [(f"data/{i}", data) for i, data in enumerate(writer.storages)]
    serial = "".join(random.choice("0123456789") for _ in range(40)).encode()
    recs += [("version", b"3\n"), (".data/serialization_id", serial)]
    return recs


def _to_torch(obj: Any, torch: Any) -> Any:
    if isinstance(obj, Tensor):
        dt = getattr(torch, obj.dtype)
        buf = bytearray(obj.contiguous_bytes())
        if not buf:
            return torch.empty(obj.shape, dtype=dt)
        return torch.frombuffer(buf, dtype=dt).reshape(obj.shape).clone()
    if isinstance(obj, dict):
        return type(obj)((k, _to_torch(v, torch)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_to_torch(v, torch) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_torch(v, torch) for v in obj)
    return obj


def save(obj: Any, path: str | os.PathLike, *, atomic: bool = False, use_torch: bool | None = None,
         fsync: bool | None = None) -> None:
    """Write `obj` (dicts, lists, tuples, numbers, strings, ptfile.Tensor, torch.Tensor) to `path`.

    `use_torch`: None picks torch.save when torch is installed; False always writes the archive
    here (no torch needed); True requires torch.
    `atomic=False` (default, like SpecForge): write straight to `path`; a crash leaves a partial
    file there. `atomic=True`: write `path`.tmp-PID-N in the same folder, fsync, rename over
    `path`, fsync the folder — a reader sees no file or a whole one.
    `fsync` defaults to `atomic`.
    """
    path = Path(path)
    torch: Any = None
    if use_torch or use_torch is None:
        try:
            import torch
        except Exception:
            if use_torch:
                raise
            torch = None
    fsync = atomic if fsync is None else fsync
    target = path
    if atomic:
        target = path.with_name(f"{path.name}.tmp-{os.getpid()}-{random.randrange(1 << 30)}")
    try:
        if torch is not None:
            with open(target, "wb") as fp:
                torch.save(_to_torch(obj, torch), fp)
                _finish(fp, fsync)
        else:
            records = _records(obj)
            with open(target, "wb") as fp:
                _archive_writer(fp, "archive", records)
                _finish(fp, fsync)
        if atomic:
            os.replace(target, path)
            if fsync:
                _fsync_dir(path.parent)
    except BaseException:
        if atomic:
            try:
                os.unlink(target)
            except OSError:
                pass
        raise


def _finish(fp: Any, fsync: bool) -> None:
    fp.flush()
    if fsync:
        os.fsync(fp.fileno())


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -------------------------------------------------------------------------------- reading


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _Storage:
    __slots__ = ("dtype", "data")

    def __init__(self, dtype: str, data: bytes) -> None:
        self.dtype, self.data = dtype, data


def _rebuild_tensor_v2(storage: _Storage, storage_offset: int, size: Sequence[int],
                       stride: Sequence[int], requires_grad: bool = False, backward_hooks: Any = None,
                       metadata: Any = None) -> Tensor:
    return Tensor(storage.dtype, size, storage.data, stride=stride, storage_offset=storage_offset)


def _rebuild_parameter(data: Tensor, requires_grad: bool = False, backward_hooks: Any = None) -> Tensor:
    return data


_SAFE_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
}


class _Unpickler(pickle.Unpickler):
    """Like torch.load(weights_only=True): only tensors and plain data, never arbitrary code."""

    def __init__(self, data: bytes, zf: zipfile.ZipFile, prefix: str, byteorder: str) -> None:
        super().__init__(io.BytesIO(data))
        self._zf, self._prefix, self._byteorder = zf, prefix, byteorder
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGE_TO_DTYPE:
            return _StorageType(_STORAGE_TO_DTYPE[name])
        try:
            return _SAFE_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor file") from None

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType):
            raise pickle.UnpicklingError(f"unsupported storage type {stype!r}")
        if key in self._storages:
            return self._storages[key]
        name = f"{self._prefix}/data/{key}"
        try:
            raw = self._zf.read(name)
        except KeyError:
            raise PtFileError(f"record {name} is missing") from None
        size = DTYPES[stype.dtype][1]
        if len(raw) != numel * size:
            raise PtFileError(f"record {name} has {len(raw)} bytes, expected {numel} x {size}")
        if self._byteorder != sys.byteorder and size > 1:
            raw = _swap(raw, size)
        st = _Storage(stype.dtype, raw)
        self._storages[key] = st
        return st


def _swap(raw: bytes, size: int) -> bytes:
    b = bytearray(raw)
    for i in range(0, len(b), size):
        b[i:i + size] = b[i:i + size][::-1]
    return bytes(b)


def _prefix(zf: zipfile.ZipFile) -> str:
    for name in zf.namelist():
        if name.endswith("/data.pkl") and name.count("/") == 1:
            return name.split("/", 1)[0]
    raise PtFileError("no <archive>/data.pkl record: not a torch.save file")


def load(path: str | os.PathLike) -> Any:
    """Read a torch.save file without torch; tensors come back as ptfile.Tensor.

    Raises PtFileError for a file that is not a whole, readable archive (truncated, corrupt,
    unexpected globals).
    """
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise PtFileError(f"not a complete zip archive ({e}); a writer killed mid-file leaves "
                          "one without its central directory") from None
    with zf:
        prefix = _prefix(zf)
        names = set(zf.namelist())
        if f"{prefix}/version" not in names and f"{prefix}/.data/version" not in names:
            raise PtFileError(f"record {prefix}/version is missing")
        byteorder = "little"
        if f"{prefix}/byteorder" in names:
            byteorder = zf.read(f"{prefix}/byteorder").decode("ascii", "replace").strip()
        try:
            data = zf.read(f"{prefix}/data.pkl")
            return _Unpickler(data, zf, prefix, byteorder).load()
        except PtFileError:
            raise
        except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, struct.error,
                zlib.error) as e:
            raise PtFileError(f"unreadable: {type(e).__name__}: {e}") from None


def check(path: str | os.PathLike) -> str | None:
    """None if `path` is a whole torch.save archive whose records pass their CRCs and whose
    pickle loads; otherwise a one-line reason. Never raises for a bad file (OSError aside)."""
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
            if bad is not None:
                return f"CRC mismatch in record {bad}"
    except zipfile.BadZipFile as e:
        return f"not a complete zip archive ({e})"
    try:
        load(path)
    except PtFileError as e:
        return str(e)
    return None
