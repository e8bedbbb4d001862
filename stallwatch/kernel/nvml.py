"""The one place that talks to NVML (nvitop's `libnvml` idea).

Every NVML call in stallwatch goes through `Nvml.call`/`Nvml.query`/`Nvml.reader`, so expected failures become
values: a GPU without ECC answers NotSupported, a container without the right capabilities answers
NoPermission, a GPU that fell off the bus answers GpuIsLost. None of these may crash or stall a
watchdog tick. Library-level trouble (no libnvidia-ml.so, driver not loaded, /dev/nvidia* not
accessible) is a `status`, never an exception.

The pynvml module is injected (`Nvml(lib=...)`) so tests drive every path with a double of the
library that raises pynvml's own exception classes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import sys
import threading
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

from stallwatch.clock import Clock, SYSTEM_CLOCK

_log = logging.getLogger(__name__)

# The library pynvml loads on Linux (its _LoadNvmlLibrary), and what its nvmlInit says without it.
NVML_LIBRARY = "libnvidia-ml.so.1"
_NO_LIBRARY_ERROR = "nvmlInit: NVMLError_LibraryNotFound: NVML Shared Library Not Found"


class _NA:
    """Value of a query that could not be answered; falsy, and prints like nvidia-smi does."""

    _instance: _NA | None = None

    def __new__(cls) -> _NA:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "N/A"

    __str__ = __repr__


NA: Any = _NA()

# Library states (Nvml.status). Callers branch on these; the message is in Nvml.error.
OK, NO_LIBRARY, NO_DRIVER, NO_PERMISSION, ERROR = "ok", "no_library", "no_driver", "no_permission", "error"

# Reasons a single call gave no value. Keyed by pynvml's constant *name*, resolved against the
# injected module, because the numbers belong to the library, not to us.
_REASON_BY_CONST = {
    "NVML_ERROR_NOT_SUPPORTED": "not_supported",
    "NVML_ERROR_NO_PERMISSION": "no_permission",
    "NVML_ERROR_NOT_FOUND": "not_found",
    "NVML_ERROR_GPU_IS_LOST": "gpu_lost",
    "NVML_ERROR_UNKNOWN": "unknown",
    "NVML_ERROR_RESET_REQUIRED": "reset_required",
    "NVML_ERROR_FUNCTION_NOT_FOUND": "function_not_found",
    "NVML_ERROR_TIMEOUT": "timeout",
    "NVML_ERROR_NO_DATA": "no_data",
    "NVML_ERROR_UNINITIALIZED": "uninitialized",
    "NVML_ERROR_DRIVER_NOT_LOADED": "no_driver",
    "NVML_ERROR_LIBRARY_NOT_FOUND": "no_library",
    "NVML_ERROR_INSUFFICIENT_POWER": "insufficient_power",
    "NVML_ERROR_CORRUPTED_INFOROM": "corrupted_inforom",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": "driver_library_mismatch",
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH": "function_not_found",
    # pynvml's list wrappers (e.g. nvmlDeviceGetProcessUtilization) raise NVMLError(NVML_SUCCESS)
    # when the driver has nothing to return.
    "NVML_SUCCESS": "empty",
}

# The device is gone, whatever was asked: after Xid 79 ("fallen off the bus") the driver answers
# GpuIsLost, and in some states Unknown or ResetRequired.
LOST_REASONS = frozenset({"gpu_lost", "unknown", "reset_required"})

# The function exists in neither this pynvml nor this driver: try the older spelling.
_MISSING = frozenset({"function_not_found", "missing_in_pynvml"})


class Outcome(NamedTuple):
    value: Any  # NA when the call gave no value
    reason: str | None  # None on success, else one of the reason strings above

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def failure(self) -> str:
        """The reason of a failed call, typed as a str for code that checked `ok`; "" on success."""
        return self.reason or ""


class Nvml:
    """A lazily initialised NVML session; thread-safe, and never raises to its callers.

    Init may hang in a wedged driver. The caller (a DeadlineRunner worker) can abandon it, so a
    second caller must not wait forever on the lock the stuck one holds: it waits `init_wait_s`,
    then reports an error. A failed init is retried after `retry_after_s` (a driver may load
    later), not on every tick.
    """

    def __init__(self, lib: Any = None, *, clock: Clock = SYSTEM_CLOCK,
                 init_wait_s: float = 5.0, retry_after_s: float = 60.0) -> None:
        self._lib = lib
        self._clock = clock
        self._init_wait_s = init_wait_s
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._tried_mono: float | None = None
        self._reason_by_code: dict[int, str] = {}
        # per tuple of versioned names: the one that answered (call_first)
        self._spelling: dict[tuple[str, ...], str] = {}
        # per tuple of versioned names: a one-element list holding the bound pynvml function a
        # reader calls, or None until resolved (shutdown() empties them all: see reader())
        self._bound: dict[tuple[str, ...], list[Any]] = {}
        self.generation = 0  # moves whenever a reader's function is bound or unbound (direct())
        self._nvml_error: type | None = None  # the library's NVMLError, once loaded
        self.status: str | None = None  # None until the first init attempt
        self.error: str | None = None

    # -- session ------------------------------------------------------------------------------

    @property
    def lib(self) -> Any:
        return self._lib

    def idle(self) -> bool:
        """True while a failed init is not due for a retry and no init is running: init() then
        only returns the status it has, touching no driver (the gpu probe runs inline then)."""
        tried = self._tried_mono
        return (tried is not None and self.status not in (None, OK)
                and self._clock.monotonic() - tried < self._retry_after_s and not self._lock.locked())

    def init(self) -> str:
        """Initialise once; returns the status. Safe from any thread, bounded wait."""
        if self.status == OK:
            return OK
        if not self._lock.acquire(timeout=self._init_wait_s):
            # Leave `status` alone: the stuck thread owns it and will set it if it ever returns.
            if self.status != OK:
                self.error = "nvmlInit is still running in another thread (wedged driver?)"
            return ERROR
        try:
            if self.status == OK:
                return OK
            now = self._clock.monotonic()
            if self._tried_mono is not None and now - self._tried_mono < self._retry_after_s:
                return self.status or ERROR
            self._tried_mono = now
            return self._init_locked()
        finally:
            self._lock.release()

    def _init_locked(self) -> str:
        if self._lib is None:
            if importlib.util.find_spec("pynvml") is not None and not _library_loads():
                # pynvml is imported only where its library loads: on a host without the driver
                # it would be 1.5-4 MiB of the daemon's RSS for nothing (issue 17's bound). The
                # status and the error are what pynvml's nvmlInit answers there.
                return self._set(NO_LIBRARY, _NO_LIBRARY_ERROR)
            try:
                import pynvml  # importing is itself part of "is NVML here?"
            except ImportError as e:
                return self._set(NO_LIBRARY, f"pynvml (nvidia-ml-py) is not installed: {e}")
            self._lib = pynvml
        lib = self._lib
        self._nvml_error = getattr(lib, "NVMLError", None)
        self._reason_by_code = {
            getattr(lib, name): reason for name, reason in _REASON_BY_CONST.items() if hasattr(lib, name)
        }
        try:
            lib.nvmlInit()
        except Exception as e:  # noqa: BLE001 - every failure of init is a state
            reason = self.reason(e)
            status = {"no_library": NO_LIBRARY, "no_driver": NO_DRIVER,
                      "no_permission": NO_PERMISSION}.get(reason, ERROR)
            return self._set(status, f"nvmlInit: {describe(e)}")
        return self._set(OK, None)

    def _set(self, status: str, error: str | None) -> str:
        self.status, self.error = status, error
        return status

    def shutdown(self) -> None:
        with self._lock:
            if self.status == OK:
                self.call("nvmlShutdown")
            self.status, self._tried_mono = None, None
            self._spelling.clear()  # a later init may meet another driver
            for cell in self._bound.values():
                cell[0] = None
            self.generation += 1

    # -- calls --------------------------------------------------------------------------------

    def reason(self, e: BaseException) -> str:
        """A short, stable name for why a call failed."""
        nvml_error = self._nvml_error
        if nvml_error is None and self._lib is not None:
            nvml_error = getattr(self._lib, "NVMLError", None)
        if nvml_error is not None and isinstance(e, nvml_error):
            code = getattr(e, "value", None)
            return (self._reason_by_code.get(code, f"nvml_error_{code}") if isinstance(code, int)
                    else f"nvml_error_{code}")
        # pynvml's unversioned wrappers turn FunctionNotFound into this (driver older than pynvml).
        if type(e).__name__ == "NVMLLibraryMismatchError":
            return "function_not_found"
        return "error"

    def call(self, fn: str | Callable[..., Any], *args: Any) -> Outcome:
        """Call `fn` (a pynvml function or its name); failures come back as a reason."""
        status = self.init()
        if status != OK:
            return Outcome(NA, status)
        if isinstance(fn, str):
            f = getattr(self._lib, fn, None)
            if f is None:
                return Outcome(NA, "missing_in_pynvml")
        else:
            f = fn
        try:
            value = f(*args)
        except Exception as e:  # noqa: BLE001 - the choke point lets nothing out
            return Outcome(NA, self.reason(e))
        return Outcome(text(value), None)

    def call_first(self, names: Sequence[str], *args: Any) -> Outcome:
        """Newest API first; fall back only when a spelling is missing from pynvml or the driver.

        The spelling that answered first is remembered per `names` (nvitop's libnvml resolves
        versioned names once the same way) and tried first from then on, so an older driver
        costs one failed lookup per session, not one per call; the fallback is logged once.
        A remembered spelling that goes missing still falls through to the others in order.
        """
        names = tuple(names)
        status = self.init()
        if status != OK:
            return Outcome(NA, status)
        known = self._spelling.get(names)
        order = names if known is None else (known, *(n for n in names if n != known))
        out = Outcome(NA, "missing_in_pynvml")
        for name in order:
            out = self.call(name, *args)
            if out.reason not in _MISSING:
                if known is None:
                    self._spelling[names] = name
                    if name != names[0]:
                        _log.info("NVML: %s is not in this pynvml or driver; using %s",
                                  names[0], name)
                return out
        return out

    def reader(self, names: str | Sequence[str]) -> Callable[..., Any]:
        """A bound read of one NVML function (newest spelling first, as call_first): calling it
        returns the value itself, or an `Outcome` (NA, reason) when the call gave none.

        For the reads the gpu probe makes every tick (issue 17): once the spelling is resolved,
        one Python frame around the pynvml function instead of call_first, call, init (twice),
        text and an Outcome per read. Everything that is not the common case (not initialised,
        after shutdown, a failure, a spelling that went missing) goes through call_first, so
        the errors and fallbacks are the same as there. Tell a failure by
        `value.__class__ is Outcome`: no pynvml function returns one.
        """
        key = (names,) if isinstance(names, str) else tuple(names)
        cell = self._bound.setdefault(key, [None])

        def read(*args: Any) -> Any:
            f = cell[0]
            if f is None or self.status != OK:
                return self._read_slow(key, cell, args)
            try:
                value = f(*args)
            except Exception as e:  # noqa: BLE001 - the choke point lets nothing out
                return self._read_failed(key, cell, e, args)
            return value.decode("utf-8", "replace") if value.__class__ is bytes else value

        read.key, read.cell = key, cell  # type: ignore[attr-defined]  # for direct() and failed()
        return read

    def direct(self, rd: Callable[..., Any]) -> Callable[..., Any] | None:
        """The pynvml function a reader calls once its spelling is resolved and the session is
        up, to be called in a caller's own `try` (one Python frame less a read: the gpu probe
        makes 14 a GPU a tick): what it raises goes to failed(rd, ...), what it returns is the
        reader's value for a function that returns no bytes. None until resolved. Valid while
        `generation` stands: it moves whenever a reader's function is bound or unbound."""
        return rd.cell[0] if self.status == OK else None  # type: ignore[attr-defined]

    def failed(self, rd: Callable[..., Any], e: Exception, args: tuple[Any, ...]) -> Any:
        """What the reader `rd` returns when its function raised `e` on `args`."""
        return self._read_failed(rd.key, rd.cell, e, args)  # type: ignore[attr-defined]

    def _read_failed(self, key: tuple[str, ...], cell: list[Any], e: Exception,
                     args: tuple[Any, ...]) -> Any:
        reason = self.reason(e)
        if reason in _MISSING:  # the remembered spelling went missing: the others, in order
            return self._read_slow(key, cell, args)
        return Outcome(NA, reason)

    def _read_slow(self, key: tuple[str, ...], cell: list[Any], args: tuple[Any, ...]) -> Any:
        out = self.call_first(key, *args)
        name = self._spelling.get(key)
        # Bound only while the session is up: shutdown() clears the cell again.
        bound = getattr(self._lib, name, None) if name is not None and self.status == OK else None
        if bound is not cell[0]:
            cell[0] = bound
            self.generation += 1
        return out.value if out.reason is None else out

    def query(self, fn: str | Callable[..., Any], *args: Any, default: Any = NA) -> Any:
        out = self.call(fn, *args)
        return default if out.reason is not None else out.value

    def const(self, name: str, default: Any = None) -> Any:
        return getattr(self._lib, name, default) if self._lib is not None else default


def text(v: Any) -> Any:
    """Older pynvml returns bytes for strings; newer decodes. Normalise to str."""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def describe(e: BaseException) -> str:
    try:
        msg = str(e)
    except Exception:  # noqa: BLE001 - pynvml's __str__ itself calls into the library
        msg = repr(e)
    return f"{type(e).__name__}: {msg}"


def _library_loads() -> bool:
    """Whether NVML's library loads here, as pynvml would load it (elsewhere than Linux: ask
    pynvml). Tried at each init attempt, so a driver installed later is seen."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return False
    return True


_default: Nvml | None = None
_default_lock = threading.Lock()


def default_nvml() -> Nvml:
    """The process-wide session over the real pynvml (NVML init is per process anyway)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Nvml()
        return _default

