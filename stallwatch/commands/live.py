"""What `stallwatch run`/`watch` show while the job runs: a footer on a terminal, plain lines
elsewhere, and the job's own output passed through unchanged.

The footer. The job's output must reach the screen byte for byte (tqdm's `\\r`, colours, cursor
moves), so it is not re-printed through rich (which drops control characters): the terminal's
scroll region (DECSTBM, as apt and pv do) is set to every row above the footer, the job's bytes are
written raw into it, and the footer's rows below it are redrawn in place, the cursor saved and
restored around each redraw. rich renders the footer's content (bars, colours) into a string of
the terminal's width. One lock orders every write to the terminal.

The pass-through reads the job's log (which the wrapper writes) from where it ended when the run
began, rather than sitting in a pipe between the job and its log: the job never depends on
stallwatch being alive to write its output, so a killed stallwatch never kills the job with
SIGPIPE. The log is opened through stallwatch.kernel.safefs (no link followed on the way, a regular
file only) and, for a job run as another user, passed through only if that user could read it.

Plain lines (no terminal): one line when the verdict or phase changes, and a progress line every
`every_s`: `stallwatch: extract: healthy · 120/1000 (12%) · 3.2/s · ETA 4 min 40 s · restarts 0/3`.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
from collections import deque
from typing import Any
from collections.abc import Callable, Sequence

from stallwatch.kernel import safefs
from stallwatch.engine.features import human_bytes, human_s
from stallwatch.engine.history import sparklines

__all__ = ["Tee", "Footer", "PlainView", "job_view", "footer_text", "plain_line"]

COLORS = {"healthy": "green", "finished": "green", "slow": "yellow", "unknown": "bright_black"}
SPARK_WINDOW_S = 300.0
SPARK_WIDTH = 16  # columns per series: three fit in 100 columns with their labels and values
SPARK_LABELS = {"rate": "rate", "gpu": "GPU", "gpu_mem": "GPU mem", "cpu": "CPU", "io": "I/O"}


# ---------------------------------------------------------------------------- the job's output

class Tee:
    """Follow a log from its current end and hand every new chunk to `write`, unchanged."""

    def __init__(self, path: os.PathLike[str] | str, write: Callable[[bytes], None],
                 poll_s: float = 0.05, reader: Any = None) -> None:
        self.path = os.fspath(path)
        self.reader = reader  # a RunAs: pass only what that user could read
        self.write = write
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._fd: int | None = None
        self._offset = 0
        try:
            self._offset = os.stat(self.path, follow_symlinks=False).st_size
        except OSError:
            self._offset = 0  # not there yet: the wrapper creates it; read it from its start
        self._thread = threading.Thread(target=self._run, name="stallwatch-tee", daemon=True)

    def start(self) -> Tee:
        self._thread.start()
        return self

    def _open(self) -> int | None:
        # On the job user's side of the trust boundary (docs/security.md): no link followed on
        # the way, a regular file only (a FIFO or a device under the log's name is never read).
        try:
            fd = safefs.open_file(self.path)
        except OSError:
            return None
        if self.reader is not None and not safefs.readable_by(
                os.fstat(fd), self.reader.uid, frozenset((self.reader.gid, *self.reader.groups))):
            os.close(fd)
            return None
        self._fd = fd
        return fd

    def pump(self) -> int:
        """Pass on what is new now; returns the number of bytes passed."""
        fd = self._fd if self._fd is not None else self._open()
        if fd is None:
            return 0
        n = 0
        size = os.fstat(fd).st_size
        if size < self._offset:  # truncated (copytruncate rotation): from the start again
            self._offset = 0
        while n < (4 << 20):  # a bound per call: the stop flag is looked at between calls
            chunk = os.pread(fd, 1 << 16, self._offset)
            if not chunk:
                break
            self._offset += len(chunk)
            n += len(chunk)
            self.write(chunk)
        return n

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                moved = self.pump()
            except OSError:
                moved = 0
            if not moved:
                self._stop.wait(self.poll_s)

    def stop(self) -> None:
        """Stop, after passing on what the job wrote last (its final lines)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        try:
            self.pump()
        except OSError:
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ------------------------------------------------------------------------------- what is shown

class Pace:
    """Rate and ETA of each rank's bar. The log's bars (stallwatch.probes.text.bars) carry done and total,
    not a rate: the rate is done now against done `window_s` ago, as this view saw them."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self.seen: dict[tuple[str, int], deque[tuple[float, float]]] = {}

    def rate(self, key: tuple[str, int], t: float, done: float) -> float | None:
        q = self.seen.setdefault(key, deque())
        if q and done < q[-1][1]:
            q.clear()  # a new run: its bar starts over
        q.append((t, done))
        while len(q) > 2 and t - q[1][0] >= self.window_s:
            q.popleft()
        t0, d0 = q[0]
        return (done - d0) / (t - t0) if t > t0 else None


def _rank_bars(name: str, lg: dict[str, Any], pace: Pace | None, now: float) -> list[dict]:
    bars = [b for b in lg.get("bars") or () if isinstance(b, dict)]
    if len(bars) < 2:
        return []  # one bar is the job's own progress, shown already
    out = []
    for b in bars:
        total = b["total"] if (b.get("total") or -1) > 0 else None
        rate = pace.rate((name, b["position"]), now, b["done"]) if pace is not None else None
        eta = (total - b["done"]) / rate if total and rate and rate > 0 else None
        out.append({"rank": b["position"], "done": b["done"], "total": total,
                    "rate_per_s": rate, "eta_s": None if b.get("complete") else eta,
                    "idle_s": None if b.get("complete") else b.get("idle_s")})
    return out


def job_view(runner: Any, pace: Pace | None = None, now: float | None = None,
             since_wall: float | None = None) -> dict[str, Any]:
    """What the views show of one job, from its runner (read only, once per tick); an incident
    only if it started after `since_wall` (the view's own run, Unix seconds) when given."""
    v = runner.last_vars or {}
    verdict = runner.verdict
    incident = None
    try:
        rows = runner.db.incidents(runner.name, limit=1)
    except Exception:  # noqa: BLE001 - the view never stops the watch
        rows = []
    if rows and (since_wall is None or rows[-1]["started_at"] >= since_wall - 1.0):  # this run's
        inc = rows[-1]
        try:
            acts = [f"{a['what']}: {a['outcome']}" for a in runner.db.actions(inc["id"])
                    if a["what"] not in ("detect", "evidence") and a["outcome"] != "pending"]
        except Exception:  # noqa: BLE001 - the view never stops the watch
            acts = []
        incident = {"id": inc["id"], "kind": inc["kind"], "started_at": inc["started_at"],
                    "resolved_at": inc["resolved_at"], "last_action": acts[-1] if acts else ""}
    try:
        row = runner.db.job(runner.name) or {}
    except Exception:  # noqa: BLE001 - the view never stops the watch
        row = {}
    gpu = v.get("gpu") or {}
    mine = set(gpu.get("job_gpus") or ())
    gpus = [g for g in gpu.get("list") or () if g.get("index") in mine]
    lg = v.get("log") or {}
    return {
        "name": runner.name,
        "phase": runner.phase,
        "detail": row.get("phase_detail") or "",
        "verdict": verdict.kind if verdict is not None else "unknown",
        "summary": verdict.summary if verdict is not None else "",
        "pid": (runner.run_row or {}).get("pid") or (v.get("job") or {}).get("pid"),
        "run": (runner.run_row or {}).get("seq"),
        "supervised": runner.cfg.supervised,
        "restarts": int(row.get("restarts") or 0) if runner.cfg.restartable else None,
        "max_restarts": runner.cfg.max_restarts if runner.cfg.restart == "on-failure" else None,
        "progress": _progress(lg),
        "ranks": _rank_bars(runner.name, lg, pace, time.monotonic() if now is None else now),
        "gpus": [{"index": g["index"], "util_pct": g.get("util_pct", -1.0),
                  "mem_used_bytes": g.get("mem_used_bytes", 0.0),
                  "mem_total_bytes": g.get("mem_total_bytes", 0.0)} for g in gpus],
        "incident": incident,
        "sparks": sparklines(list(runner.history.samples), SPARK_WINDOW_S, width=SPARK_WIDTH),
    }


def _progress(lg: dict[str, Any]) -> dict[str, Any] | None:
    if not lg.get("has_progress") and lg.get("done", -1) < 0:
        return None
    total = lg.get("total") if lg.get("total_known", (lg.get("total") or -1) > 0) else None
    rate = lg.get("rate_per_s")
    eta = lg.get("eta_s")
    idle = lg.get("idle_s", lg.get("last_progress_age_s"))
    return {"done": lg.get("done"), "total": total if total and total > 0 else None,
            "rate_per_s": rate if rate is not None and rate >= 0 else None,
            "eta_s": eta if eta is not None and eta >= 0 else None,
            "idle_s": idle if idle is not None and idle >= 0 else None}


def _count(x: float | None) -> str:
    return "?" if x is None else (f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}")


def _progress_text(p: dict[str, Any]) -> str:
    parts = [f"{_count(p['done'])}/{_count(p['total'])}" if p["total"] else _count(p["done"])]
    if p["total"]:
        parts[0] += f" ({100.0 * p['done'] / p['total']:.0f}%)"
    if p["rate_per_s"] is not None:
        parts.append(f"{p['rate_per_s']:.3g}/s")
    if p["eta_s"] is not None and not (p["total"] and p["done"] >= p["total"]):
        parts.append(f"ETA {human_s(p['eta_s'])}")
    if p["idle_s"] is not None and p["idle_s"] >= 10:
        parts.append(f"no progress for {human_s(p['idle_s'])}")
    return " · ".join(parts)


def plain_line(view: dict[str, Any]) -> str:
    parts = [view["verdict"] + (f" ({view['phase']})" if view["phase"] not in
                                ("running", "attached") else "")]
    if view["progress"]:
        parts.append(_progress_text(view["progress"]))
    for g in view["gpus"]:
        parts.append(f"GPU{g['index']} {g['util_pct']:.0f}% {human_bytes(g['mem_used_bytes'])}")
    if view["max_restarts"] is not None:
        parts.append(f"restarts {view['restarts']}/{view['max_restarts']}")
    line = f"stallwatch: {view['name']}: " + " · ".join(parts)
    if view["verdict"] not in ("healthy", "finished", "unknown") and view["summary"]:
        line += f" — {view['summary']}"
    return line


def footer_text(views: list[dict[str, Any]], width: int, notes: Sequence[str] = (),
                color: bool = True) -> list[str]:
    """The footer's rows, rendered (ANSI) to `width` columns, one string per row."""
    from rich.console import Console
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=color, no_color=not color,
                  color_system="standard" if color else None, highlight=False,
                  emoji=False, legacy_windows=False, soft_wrap=False)
    rule = Text("─" * width, style="bright_black")
    con.print(rule, no_wrap=True, overflow="crop", crop=True)
    for v in views:
        c = COLORS.get(v["verdict"], "red")
        head = Text.assemble(("stallwatch ", "bold"), (v["name"], "bold"), "  ",
                             (f" {v['verdict']} ", f"bold reverse {c}"))
        if v["phase"] not in ("running", "attached", v["verdict"]):
            head.append(f"  {v['phase']}" + (f": {v['detail']}" if v["phase"] in
                                              ("stopped", "recovering") and v["detail"] else ""),
                        style="yellow")
        if v["pid"]:
            head.append(f"  pid {v['pid']}" + (f" run {v['run']}" if v["run"] else ""))
        if v["max_restarts"] is not None:
            head.append(f"  restarts {v['restarts']}/{v['max_restarts']}")
        if v["verdict"] not in ("healthy", "finished", "unknown") and v["summary"]:
            head.append(f"  {v['summary']}", style=c)
        con.print(head, no_wrap=True, overflow="ellipsis", crop=True)
        bars = [("", v["progress"])] if v["progress"] else []
        bars += [(f"rank {r['rank']}", r) for r in v["ranks"]]
        if bars:
            grid = Table.grid(padding=(0, 1))
            grid.add_column(no_wrap=True, min_width=max(len(lb or "progress") for lb, _ in bars))
            grid.add_column(width=max(10, min(40, width // 3)))
            grid.add_column(no_wrap=True, overflow="ellipsis")
            for label, p in bars[:9]:
                grid.add_row(label or "progress", ProgressBar(total=p["total"] or None,
                                                              completed=p["done"] or 0,
                                                              pulse=False, animation_time=0.0),
                             _progress_text(p))
            con.print(grid, crop=True)
        if v["gpus"]:
            con.print(Text("  ".join(
                f"GPU{g['index']} {g['util_pct']:.0f}% {human_bytes(g['mem_used_bytes'])}"
                + (f"/{human_bytes(g['mem_total_bytes'])}" if g["mem_total_bytes"] else "")
                for g in v["gpus"])), no_wrap=True, overflow="ellipsis", crop=True)
        if v["sparks"]:
            line = Text()
            for s in v["sparks"]:
                line.append(f"{SPARK_LABELS.get(s['key'], s['label'])} ", style="bright_black")
                line.append(s["spark"], style="cyan")
                line.append(f" {s['now_text']}  ")
            con.print(line, no_wrap=True, overflow="ellipsis", crop=True)
        inc = v["incident"]
        if inc:
            when = time.strftime("%H:%M:%S", time.localtime(inc["started_at"]))
            state = "open" if inc["resolved_at"] is None else "resolved"
            con.print(Text(f"last incident #{inc['id']} {inc['kind']} at {when} ({state})"
                           + (f": {inc['last_action']}" if inc["last_action"] else ""),
                           style="bright_black"), no_wrap=True, overflow="ellipsis", crop=True)
    for n in notes[-2:]:
        con.print(Text(n, style="yellow"), no_wrap=True, overflow="ellipsis", crop=True)
    return buf.getvalue().rstrip("\n").split("\n")


# ------------------------------------------------------------------------------------ the views

class Footer:
    """The live footer on a terminal (file descriptor `fd`), below the job's scrolling output."""

    def __init__(self, fd: int = 1) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        self.height = 0  # rows the footer holds now
        self.rows, self.cols = 24, 80
        self.notes: list[str] = []
        self._resized = True
        self._last: list[str] = []
        self._old_winch: Any = None
        self.draw_s = 0.0  # CPU time spent drawing (the benchmark reads it)
        self.draws = 0
        self.pace = Pace()

    def start(self) -> Footer:
        try:
            self._old_winch = signal.signal(signal.SIGWINCH, self._on_winch)
        except ValueError:  # not the main thread (tests): size is read at each draw instead
            self._old_winch = None
        return self

    def _on_winch(self, _s: int, _f: Any) -> None:
        self._resized = True

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except InterruptedError:
                continue
            except BlockingIOError:
                time.sleep(0.01)
                continue
            view = view[n:]

    def output(self, data: bytes) -> None:
        """The job's bytes, into the scroll region, unchanged."""
        with self.lock:
            self._write(data)

    def log_line(self, text: str) -> None:
        self.output(f"\x1b[2m{text}\x1b[0m\r\n".encode("utf-8", "replace"))

    def note(self, text: str) -> None:
        self.notes.append(text)
        self._redraw(self._last)

    def _layout(self, height: int) -> bytes:
        """Make room for `height` footer rows and confine scrolling to the rows above them."""
        try:
            self.cols, self.rows = os.get_terminal_size(self.fd)
        except OSError:
            pass
        height = max(1, min(height, self.rows // 2))
        grow = max(0, height - self.height)
        self.height = height
        top = self.rows - height
        # Newlines scroll what is on screen up to make room; then the region, which homes the
        # cursor, so it is saved before and restored after (into the region's last row).
        return (b"\n" * grow + (f"\x1b[{grow}A".encode() if grow else b"") + b"\x1b7"
                + f"\x1b[1;{top}r".encode() + b"\x1b8")

    def _redraw(self, lines: list[str]) -> None:
        lines = list(lines) + [f"\x1b[33m{n}\x1b[0m" for n in self.notes[-1:]]
        with self.lock:
            out = b""
            if self._resized or len(lines) != self.height:
                self._resized = False
                out += self._layout(len(lines))
            top = self.rows - self.height
            out += b"\x1b7"
            for i in range(self.height):
                text = lines[i] if i < len(lines) else ""
                out += f"\x1b[{top + 1 + i};1H\x1b[2K{text}".encode("utf-8", "replace")
            out += b"\x1b8"
            self._write(out)

    def update(self, daemon: Any) -> None:
        t0 = time.process_time()
        views = [job_view(r, self.pace, since_wall=daemon.opened_wall) for r in daemon.jobs.values()]
        self._last = footer_text(views, max(20, self.cols))
        self._redraw(self._last)
        self.draw_s += time.process_time() - t0
        self.draws += 1

    def close(self, views: list[dict[str, Any]] | None = None) -> None:
        """Leave the last footer on screen as the summary, the terminal as it was."""
        if views:
            try:
                self._last = footer_text(views, max(20, self.cols))
                self._redraw(self._last)
            except Exception:  # noqa: BLE001 - the view never stops the watch
                pass
        with self.lock:
            self._write(f"\x1b[r\x1b[{self.rows};1H\r\n".encode())
        if self._old_winch is not None:
            signal.signal(signal.SIGWINCH, self._old_winch)


class PlainView:
    """No terminal: a line when the verdict or phase changes, and one every `every_s`."""

    def __init__(self, out: Any = None, every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.out = out or sys.stderr
        self.every_s = every_s
        self.clock = clock
        self._last: dict[str, tuple[str, str]] = {}
        self._at: dict[str, float] = {}
        self._printed = ""

    def _print(self, line: str) -> None:
        if line == self._printed:
            return  # the closing line when nothing changed since the last one
        self._printed = line
        try:
            print(line, file=self.out, flush=True)
        except (OSError, ValueError):
            pass

    def note(self, text: str) -> None:
        self._print(f"stallwatch: {text}")

    def update(self, daemon: Any) -> None:
        now = self.clock()
        for r in daemon.jobs.values():
            v = job_view(r, since_wall=daemon.opened_wall)
            key = (v["verdict"], v["phase"])
            if key != self._last.get(r.name) or now - self._at.get(r.name, -1e9) >= self.every_s:
                self._last[r.name] = key
                self._at[r.name] = now
                self._print(plain_line(v))

    def close(self, views: list[dict[str, Any]] | None = None) -> None:
        for v in views or ():
            self._print(plain_line(v))
