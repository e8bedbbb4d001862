"""Several tqdm bars in one log, one per data-parallel rank, told apart.

SpecForge's `prepare_hidden_states.py` (HEAD, 2026-08; docs/upstream.md §2) runs one tqdm bar per DP
rank, all with the description `Generating Hidden States`, `position=dp_rank`, every rank writing
to the same stderr. A single "done" number read from that log jumps backwards, reaches 100 % with
the fastest rank, and hides a rank that stopped. Here each bar is followed by its position.

What tqdm writes (tqdm 4.x, `std.tqdm.display`/`moveto`/`close`, read in 4.70): a bar at position
p > 0 is redrawn as three writes, `"\\n" * p`, `"\\r" + bar`, `"\\x1b[A" * p`; at position 0 as
`"\\r" + bar` alone; `close()` (leave=True) redraws the bar at position 0 and writes `"\\n"`.
So a bar text followed by k cursor-up escapes is the bar at position k. A bar followed by none is
position 0's, except a close: a bar at its total ended by `"\\n"` may be any rank's close (another
rank's `"\\n" * p` can follow a position-0 redraw too, which is why only bars at their total are
taken as closes). Ranks write concurrently, so a redraw can be cut from its escapes by another
rank's write: a bar's count never goes backwards here (such a record is dropped), and a bar is
complete only when as many closes were seen as there are bars (and, for SpecForge, as many
`Generation loop finished.` lines).

Pure: records come with the caller's clock; no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pydantic import Field

from stallwatch.model import Frozen
from stallwatch.probes.text.progress import ProgressEvent

__all__ = ["BarObs", "BarSet", "MultiBars", "cursor_ups", "sample_count", "CLOSING_LINE"]

_UP = re.compile(r"(?:\x1b\[A)+$")
# SpecForge prints this once per DP rank (TP rank 0) when its loop ends (HEAD, 2026-08).
CLOSING_LINE = re.compile(r"Generation loop finished\. Processed: (?P<p>\d+), Skipped: (?P<s>\d+)")
SPECFORGE_DESC = "Generating Hidden States"
# Postfix keys that count samples (SpecForge's bar counts batches; samples are in the postfix).
SAMPLE_KEYS = ("processed", "skipped")
MAX_BARS = 64  # positions tracked per description: a log cannot make us keep more


def cursor_ups(raw: str) -> int:
    """How many cursor-up escapes end this raw (uncleaned) piece of a line: the bar's position."""
    stripped = raw.rstrip(" ")
    if not stripped.endswith("\x1b[A"):  # most lines: no regex search along the whole line
        return 0
    m = _UP.search(stripped)
    return 0 if m is None else m.group(0).count("\x1b[A")


def sample_count(postfix: dict) -> int | None:
    """The sum of the SAMPLE_KEYS counts, when each is an int; None otherwise. The two keys by
    name: a generator over them was ~3 k instructions a bar line."""
    processed, skipped = postfix.get("processed"), postfix.get("skipped")
    if isinstance(processed, int) and isinstance(skipped, int):
        return int(processed) + int(skipped)
    return None


assert SAMPLE_KEYS == ("processed", "skipped")  # sample_count reads them by name


@dataclass
class _Bar:
    position: int
    done: float = 0.0
    total: float | None = None
    samples: int | None = None  # processed + skipped from the postfix
    postfix: dict = field(default_factory=dict)
    changed_mono: float = 0.0
    max_gap_s: float = 0.0  # the longest wait between two changes of this bar
    changes: int = 0
    closed: bool = False
    rate_per_s: float | None = None  # tqdm's own rate of this bar
    sightings: int = 0  # redraws read at this position, moving or not


class BarObs(Frozen):
    position: int
    done: float
    total: float | None = None
    samples: int | None = None
    postfix: dict[str, int | float | str] = Field(default_factory=dict)
    idle_s: float
    max_gap_s: float
    complete: bool


class BarSet(Frozen):
    desc: str | None
    bars: tuple[BarObs, ...]
    closes: int  # bars seen closing at their total (position unknown)
    closing_lines: int  # SpecForge's `Generation loop finished.` lines
    closing_needed: bool  # SpecForge's bar: its closing lines are part of "complete"
    complete: bool  # every bar reached its total and closed (and the closing lines are in)


class MultiBars:
    """Follows the bars of one description; `active` once two positions have been seen."""

    def __init__(self) -> None:
        self._bars: dict[int, _Bar] = {}
        self.desc: str | None = None
        self.closes = 0
        self.closing_lines = 0

    @property
    def active(self) -> bool:
        return len(self._bars) > 1

    def is_open(self, position: int) -> bool:
        bar = self._bars.get(position)
        return bar is not None and not bar.closed

    def reset(self) -> None:
        """A new run of the job (restarted): its bars start again."""
        self._bars.clear()
        self.closes = self.closing_lines = 0

    def closing(self, line: str) -> bool:
        if CLOSING_LINE.search(line):
            self.closing_lines += 1
            return True
        return False

    def feed(self, ev: ProgressEvent, ups: int, ended_by_newline: bool, now: float) -> bool:
        """One redraw; True when a bar's count moved."""
        if ev.source != "tqdm":
            return False
        if self.desc is None:
            self.desc = ev.desc
        elif ev.desc != self.desc:
            return False  # another bar (SpecForge's `Finalizing Writes`): not a rank's
        total = float(ev.total) if ev.total else None
        if ups == 0 and ended_by_newline and total is not None and float(ev.done) >= total:
            return self._close(total, ev, now)
        bar = self._bars.get(ups)
        if bar is None:
            if len(self._bars) >= MAX_BARS:
                return False
            bar = self._bars[ups] = _Bar(position=ups, changed_mono=now)
        bar.sightings += 1
        done = float(ev.done)
        if bar.total is not None and total is not None and total != bar.total:
            # a different bar at this position: a restarted run; start it over
            bar.done, bar.changes, bar.max_gap_s, bar.changed_mono = 0.0, 0, 0.0, now
            bar.closed = False
        elif bar.closed or done < bar.done:
            return False  # cut from its escapes by another rank's write: not this bar's
        bar.total = total
        if ev.rate_per_s:
            bar.rate_per_s = ev.rate_per_s
        pf = {k: v for k, v in ev.postfix.items() if isinstance(v, (int, float, str))}
        bar.postfix = pf
        samples = sample_count(pf)
        if samples is not None:
            bar.samples = samples
        if done == bar.done and bar.changes:
            return False
        if bar.changes:
            bar.max_gap_s = max(bar.max_gap_s, now - bar.changed_mono)
        bar.done, bar.changed_mono = done, now
        bar.changes += 1
        return True

    def _close(self, total: float, ev: ProgressEvent, now: float) -> bool:
        """A close of a bar whose position the log does not say: it goes to the open bar of that
        total nearest its end, the most recently moved first (a rank that stopped went quiet
        before the others finished)."""
        self.closes += 1
        open_bars = [b for b in self._bars.values() if not b.closed and b.total == total]
        if not open_bars:
            return False
        bar = max(open_bars, key=lambda b: (b.done, b.changed_mono))
        bar.closed = True
        pf = {k: v for k, v in ev.postfix.items() if isinstance(v, (int, float, str))}
        if pf:
            bar.postfix = pf
        moved = bar.done != total
        if moved:
            bar.max_gap_s = max(bar.max_gap_s, now - bar.changed_mono)
            bar.done, bar.changed_mono = total, now
            bar.changes += 1
        return moved

    def _real(self) -> list[_Bar]:
        """The bars, less the ghosts of interleaved writes once the real ones are all closed.

        Every rank writes its `"\\n" * p`, bar and `"\\x1b[A" * p` as separate writes to the one
        log, so a bar can pick up another rank's cursor-ups and read as a position no rank has
        (a full CI run: a bar at position 3 of a 3-rank job, drawn once at 2/10, left the run
        never `complete`). A real bar is drawn at its position many times (tqdm draws it at 0/N
        when made, then at every update and at its close); a ghost once. So a position read only
        once is dropped when every bar read more often is closed. It is kept while any is open,
        so a rank that stopped after its first draw stays in view while it matters; and a rank
        that died after one draw cannot end a run whose other ranks closed, since torchrun ends
        every worker when one fails (the others never reach their close; docs/upstream.md §1)."""
        bars = list(self._bars.values())
        seen = [b for b in bars if b.sightings > 1]
        if seen and all(b.closed for b in seen):
            return [b for b in bars if b.sightings > 1 or b.closed]
        return bars

    def aggregate(self) -> tuple[float, float | None, float | None]:
        """Done, total and tqdm's rate over every bar (sums): never backwards while bars only
        advance; the rate of the bars still open (a finished bar adds nothing any more)."""
        real = self._real()
        done = sum(b.done for b in real)
        totals = [b.total for b in real]
        known = [t for t in totals if t is not None]
        rates = [b.rate_per_s for b in real if b.rate_per_s and not b.closed]
        return (done, (sum(known) if totals and len(known) == len(totals) else None),
                sum(rates) if rates else None)

    def observe(self, now: float) -> BarSet:
        bars = sorted(self._real(), key=lambda b: b.position)
        n = len(bars)
        needed = self.desc == SPECFORGE_DESC
        complete = n > 0 and all(b.closed for b in bars) and (not needed or self.closing_lines >= n)
        out = [BarObs(position=b.position, done=b.done, total=b.total, samples=b.samples,
                      postfix=b.postfix, idle_s=max(0.0, now - b.changed_mono),
                      max_gap_s=b.max_gap_s, complete=b.closed) for b in bars]
        return BarSet(desc=self.desc, bars=tuple(out), closes=self.closes,
                      closing_lines=self.closing_lines, closing_needed=needed, complete=complete)
