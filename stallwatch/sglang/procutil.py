"""Process helpers shared by the stand-in server's processes: titles, parent death, logging.

Part of the stand-in SGLang server (stallwatch.sglang.protocol_server; docs/sglang-templates.md).
"""

from __future__ import annotations

import ctypes
import logging
import signal
import socket
import sys
from typing import Any

logger = logging.getLogger("sglang")
access_logger = logging.getLogger("uvicorn.access")


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Die with the parent, as SGLang's children do (kill_itself_when_parent_died)."""
    try:
        _libc().prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: nothing to do
        pass


def set_process_title(title: str) -> None:
    """What `ps`, /proc/PID/cmdline and psutil show: `sglang::scheduler`, like setproctitle.

    Uses the setproctitle module when installed (SGLang's dependency); otherwise sets the
    thread name (comm, 15 bytes) with prctl(PR_SET_NAME) and rewrites the argv area in place,
    found from /proc/self/stat, with its last byte non-NUL so the kernel reports only the title.
    """
    try:
        import setproctitle

        setproctitle.setproctitle(title)
        return
    except Exception:  # noqa: BLE001 - cosmetic: a process title is never worth failing for
        pass
    try:
        _libc().prctl(15, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except Exception:  # noqa: BLE001 - cosmetic: a process title is never worth failing for
        pass
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rfind(b")") + 2:].split()
        arg_start, arg_end = int(fields[45]), int(fields[46])
        size = arg_end - arg_start
        if size < 3:
            return
        raw = title.encode()[: size - 2]
        buf = raw + b"\0" + b" " * (size - len(raw) - 1)
        ctypes.memmove(arg_start, buf, size)
    except Exception:  # noqa: BLE001 - cosmetic: never fatal
        pass


def configure_logging(log_file: str | None, prefix: str = "", access_log: bool = True) -> None:
    """SGLang's format: `[2026-11-29 12:00:00 TP0] message`; uvicorn's for access lines."""
    fmt = logging.Formatter(f"[%(asctime)s{prefix}] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    afmt = logging.Formatter("%(levelname)s:     %(message)s")
    for lg, f, on in ((logger, fmt, True), (access_logger, afmt, access_log)):
        lg.handlers.clear()
        lg.propagate = False
        lg.setLevel(logging.INFO if on else logging.WARNING)
        handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
        if log_file:
            handlers.append(logging.FileHandler(log_file, mode="a", encoding="utf-8"))
        for h in handlers:
            h.setFormatter(f)
            lg.addHandler(h)


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def flush_logs() -> None:
    for h in logger.handlers:
        h.flush()
