"""The log probe: follow one log file and say how the job's progress moves.

`LogFollower` (probes/logfollow.py) turns the growing file into lines at a cost that depends on
the new bytes only. `LogProbe` feeds the lines to the pure parsers in stallwatch.probes.text.progress and
keeps the learned state (last progress, when `done` last changed, the job's cadence, rates, the
tail, the last traceback), all timed with the injected clock.

Not thread-safe: the collector's DeadlineRunner never overlaps two calls of one probe.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable
from itertools import pairwise
from typing import Literal

from stallwatch.probes.text.bars import BarSet, MultiBars, sample_count
from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.model import Frozen
from stallwatch.probes.base import ProbeStatus
from stallwatch.probes.logfollow import FollowResult, LogFollower
from stallwatch.probes.processes_obs import built
from stallwatch.probes.torchrun import RootCause, RootCauseTracker
from stallwatch.probes.text.progress import (
    ProgressEvent, ProgressParser, Traceback, TracebackTracker, fatal_kind, parse_tqdm,
    tqdm_done,
)
from stallwatch.probes.text.timestamps import LineTime, gap_s, line_time


CadenceSource = Literal["observed", "log_timestamps", "tqdm_elapsed", "tqdm_rate", "mixed"]
IdleSource = Literal["observed", "mtime", "mtime_lower_bound", "mtime_timestamps"]


class Cadence(Frozen):
    """How often `done` changes: the job's own rhythm, so rules adapt to slow jobs."""

    median_s: float
    p90_s: float
    max_s: float
    samples: int
    source: CadenceSource
    # Gaps far beyond the rhythm that were left out of it (see LogProbe._add_interval).
    outliers: int = 0
    last_outlier_s: float | None = None


class FatalLine(Frozen):
    kind: str
    line: str


class LogObs(Frozen):
    path: str
    status: ProbeStatus
    error: str | None = None
    size_bytes: int | None = None
    mtime_epoch_s: float | None = None
    inode: int | None = None
    device: int | None = None
    offset_bytes: int = 0
    backlog_bytes: int = 0  # not read yet: over the per-tick budget
    skipped_backlog_bytes: int = 0  # jumped over, never read: the log grew faster than we read
    read_bytes: int = 0  # this tick
    read_bytes_total: int = 0
    lines_total: int = 0
    rotations: int = 0
    truncations: int = 0
    overlong_lines: int = 0
    last_growth_age_s: float | None = None
    progress: ProgressEvent | None = None
    progress_events: int = 0
    progress_changes: int = 0
    idle_s: float | None = None  # since `done` last changed
    # mtime_timestamps: the log kept growing after the last progress line; the gap between that
    # line's timestamp and the last line's is added to the file's age.
    idle_source: IdleSource | None = None
    cadence_s: Cadence | None = None
    rate_per_s: float | None = None  # measured here: done delta over a window of our clock
    tqdm_rate_per_s: float | None = None
    # The pace before we looked, from the history read at first sight: done over the span of
    # the progress lines' own timestamps (history_style: which form, timestamps.STYLE_NAMES).
    history_rate_per_s: float | None = None
    history_span_s: float | None = None
    history_lines: int = 0
    history_style: str | None = None
    eta_s: float | None = None
    tail: tuple[str, ...] = ()
    traceback: Traceback | None = None  # the last one not followed by progress
    tracebacks_seen: int = 0
    fatal: tuple[FatalLine, ...] = ()  # fatal-looking lines since the last progress
    bars: BarSet | None = None  # several bars of one description, one per rank (bars.py)
    root_cause: RootCause | None = None  # torchrun's first failed rank, from its summary


def _history_pace(marks: list[tuple[LineTime | None, float]]
                  ) -> tuple[list[float], float | None, float, str] | None:
    """From the timestamped progress changes at the end of the history (one run of one style,
    `done` rising): (intervals, done per second, span, style); None without two such lines."""
    run: list[tuple[LineTime, float]] = []
    for t, done in reversed(marks):  # newest first: the run that ends at the last progress
        if t is None:
            break
        if run and (gap_s(t, run[-1][0]) is None or done > run[-1][1]):
            break  # another style, time going backwards, or a new bar: the run starts after
        run.append((t, done))
    if len(run) < 2:
        return None
    run.reverse()
    deltas = [gap_s(a, b) or 0.0 for (a, _), (b, _) in pairwise(run)]
    span = sum(deltas)
    rate = (run[-1][1] - run[0][1]) / span if span > 0 else None
    return deltas, rate, span, run[0][0].style


def _p90(xs: Iterable[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


class LogProbe:
    """Follows one log; `collect()` returns a LogObs and never raises for a missing or odd file."""

    name = "log"
    CADENCE_RING = 32
    # A gap longer than both of these is an outlier, not rhythm, until it recurs (_add_interval).
    OUTLIER_P90_FACTOR = 5.0
    OUTLIER_MIN_S = 10.0
    OUTLIER_MIN_SAMPLES = 5  # a rhythm of fewer intervals is too young to call anything odd
    TAIL_LINE_CHARS = 400
    FATAL_KEEP = 5

    def __init__(
        self, path: str | os.PathLike[str], progress_regex: str | None = None, clock: Clock = SYSTEM_CLOCK,
        tail_lines: int = 20, max_line_bytes: int = 64 * 1024, initial_tail_bytes: int = 1 << 20,
        chunk_budget_bytes: int = 2 << 20, rate_window_s: float = 120.0, name: str = "log",
        reader: tuple[int, frozenset[int]] | None = None,
    ) -> None:
        self.name = name  # DeadlineRunner keys in-flight calls by name: one per job's log
        self.parser = ProgressParser(progress_regex)  # raises ValueError for a bad regex, up front
        self.clock = clock
        self.follower = LogFollower(
            path, max_line_bytes=max_line_bytes, initial_tail_bytes=initial_tail_bytes,
            chunk_budget_bytes=chunk_budget_bytes, reader=reader,
        )
        self.rate_window_s = rate_window_s
        self._tail: deque[str] = deque(maxlen=max(1, tail_lines))
        self._tail_lines = tail_lines
        self._tail_last_progress = False
        self._tb = TracebackTracker()
        self._fatal: deque[FatalLine] = deque(maxlen=self.FATAL_KEEP)
        self._last: ProgressEvent | None = None
        self._last_done: int | float = 0  # self._last.done, or a skipped redraw's since (_on_redraw)
        self._events = self._changes = 0
        self._last_change: float | None = None  # clock.monotonic() when done last changed
        self._idle_source: IdleSource | None = None
        self._intervals: deque[float] = deque(maxlen=self.CADENCE_RING)
        self._estimated = self._observed = 0  # ring entries learned from history / measured
        self._seq = 0  # intervals timed since the run began, outliers included
        self._outliers: deque[tuple[int, float]] = deque(maxlen=8)  # (seq, gap_s)
        self._outliers_total = 0
        self._history_source: CadenceSource = "tqdm_rate"
        self._samples: deque[tuple[float, float]] = deque(maxlen=64)  # (monotonic, done)
        self._last_growth: float | None = None
        self._peeked: str | None = None  # partial line already counted as progress
        self._tqdm_history: list[ProgressEvent] = []
        # (line time, done) of each progress change read at first sight: the log's own clock.
        self._marks: list[tuple[LineTime | None, float]] = []
        self._history_rate: float | None = None
        self._history_span: float | None = None
        self._history_lines = 0
        self._history_style: str | None = None
        self._bars = MultiBars()  # one tqdm bar per rank (SpecForge's DP ranks)
        self._root = RootCauseTracker()  # torchrun's "Root Cause (first observed failure)"
        self._side: dict[str | None, float | int] = {}
        self._side_moved = False  # another bar of the log moved: a change, though the sum did not
        self._cadence_key: tuple[object, ...] | None = None
        self._tail_out: tuple[str, ...] = ()
        self._fatal_out: tuple[FatalLine, ...] = ()
        self._cadence_obs: Cadence | None = None

    def new_run(self) -> None:
        """The job was restarted: what was learned about the old run's rhythm is void (the
        downtime is not a cadence interval, and the old rate is not the new run's average), and
        its silence starts now, not at the old run's last line. The log is still followed from
        where it is: the new run appends to it."""
        self._intervals.clear()
        self._estimated = self._observed = 0
        self._outliers.clear()
        self._outliers_total = 0
        self._samples.clear()
        self._history_rate = self._history_span = self._history_style = None
        self._history_lines = 0
        self._tb.reset()
        self._fatal.clear()
        self._bars.reset()
        self._root = RootCauseTracker()
        if self._last_change is not None:
            self._last_change, self._idle_source = self.clock.monotonic(), "observed"

    # -- per tick

    def collect(self) -> LogObs:
        now = self.clock.monotonic()
        f = self.follower
        prev_size, prev_rotations = f.size, f.rotations
        r = f.poll()
        if r.status is ProbeStatus.ok:
            if r.first:
                self._last_growth = self._mono_of(r.mtime_s, now)
            elif f.rotations != prev_rotations or (r.size or 0) > prev_size:
                self._last_growth = now
        changes = self._consume(r)
        if changes:
            self._on_changes(changes, r, now)
        return self._obs(r, now)

    # Off only in tests: the fast path (_redraws_to_skip) must give what the full parse gives.
    SKIP_REDRAWS = True

    def _consume(self, r: FollowResult) -> int:
        changes = 0
        self._tqdm_history.clear()
        self._marks.clear()
        at = self._mono_of(r.mtime_s, self.clock.monotonic()) if r.first else self.clock.monotonic()
        peeked_at_start = self._peeked
        # The newest bar is often the unterminated partial line: parsed once, here.
        partial_ev = (parse_tqdm(r.partial) if r.partial is not None and r.partial != self._peeked
                      and self.parser.regex is None else None)
        parsed, light = self._redraws_to_skip(r, partial_ev, peeked_at_start)
        for i, (line, (ups, newline)) in enumerate(zip(r.lines, r.meta, strict=True)):  # appended together
            peeked, self._peeked = line == self._peeked, None
            done = None if peeked else light.get(i)
            if done is not None:  # a redraw the tick's last bar supersedes: counted, not parsed
                changes += self._on_redraw(done)
                self._push_tail(line, progress=True)
                continue
            ev = None if peeked else (parsed[i] if i in parsed else self.parser.parse(line))
            if ev is not None:
                changes += self._on_event(self._per_rank(ev, ups, newline, at), r.first, line)
            elif not peeked:
                self._bars.closing(line)
                self._root.feed(line)
                self._tb.feed(line)
                kind = fatal_kind(line)
                if kind:
                    self._fatal.append(FatalLine(kind=kind, line=line[: self.TAIL_LINE_CHARS]))
            self._push_tail(line, progress=peeked or ev is not None)
        # tqdm's newest bar has no terminator until the next redraw: read it now, not one
        # update late (a slow job's bar would otherwise lag one whole cadence). Only tqdm:
        # its closing `]` proves the bar is whole, a cut `N/M` could read as a wrong pair.
        if r.partial is not None and r.partial != self._peeked:
            self._peeked = None
            if partial_ev is not None:
                changes += self._on_event(self._per_rank(partial_ev, r.partial_ups, False, at), r.first,
                                          r.partial)
                self._peeked = r.partial
        return changes

    def _redraws_to_skip(self, r: FollowResult, partial_ev: ProgressEvent | None, peeked: str | None
                         ) -> tuple[dict[int, ProgressEvent | None], dict[int, int | float]]:
        """Which of this tick's lines are redraws of the bar that the tick's last progress line
        (Z) redraws again: for those only `done` is read (tqdm_done, no event built, issue 17:
        ~5 redraws a tick, each a full parse and a bar update, of which only Z's survive).

        Returns (lines already parsed in full, by index; `done` of the lines to skip, by index).
        A line is skipped only where feeding it would leave nothing that Z does not overwrite:
        after the first read (history needs every line), without a user regex, one bar in view
        and every line of the tick at position 0 (a second position makes the bars aggregate,
        bars.py), that bar open, each skipped line ended by `\r` and after any bar ended by
        `\n` (maybe a close, which Z would then not overwrite), not past Z's count and of Z's
        total, and Z a redraw (not a close) with a rate and, unless the skipped line has no
        postfix, the sample counts (bars.py keeps the last of each only when present).
        tests/test_log_redraws.py holds every condition to the full parse, bar state included."""
        parsed: dict[int, ProgressEvent | None] = {}
        lines, meta = r.lines, r.meta
        if (not self.SKIP_REDRAWS or r.first or self.parser.regex is not None or self._bars.active
                or r.ups or r.partial_ups):
            return parsed, {}
        z, zi = partial_ev, len(lines)
        if z is None:
            for i in range(len(lines) - 1, -1, -1):
                if i == 0 and lines[0] == peeked:
                    break
                z = parsed[i] = self.parser.parse(lines[i])
                if z is not None:
                    zi = i
                    break
            if z is None or meta[zi][1]:
                return parsed, {}
        if (z.source != "tqdm" or z.desc is None or z.desc != self._bars.desc or not z.rate_per_s
                or not self._bars.is_open(0)):
            return parsed, {}
        samples = sample_count(z.postfix) is not None
        z_done = float(z.done)
        light: dict[int, int | float] = {}
        for i in range(zi):
            if i == 0 and lines[0] == peeked:
                continue
            got = tqdm_done(lines[i])
            if got is None:
                continue
            if meta[i][1]:  # a bar ended by "\n" may be a close: what came before stays
                light.clear()
            elif float(got[0]) <= z_done and got[1] == z.total and (samples or not got[2]):
                light[i] = got[0]
        return parsed, light

    def _on_redraw(self, done: int | float) -> int:
        """_on_event for a skipped redraw (_redraws_to_skip): the same counts, no event."""
        self._events += 1
        changed = self._last is None or done != self._last_done or self._side_moved
        self._side_moved = False
        self._last_done = done  # self._last is Z's event by the tick's end
        if not changed:
            return 0
        self._tb.reset()
        if self._fatal:
            self._fatal.clear()
        return 1

    def _per_rank(self, ev: ProgressEvent, ups: int, newline: bool, at: float) -> ProgressEvent:
        """With bars at several positions (one per rank, bars.py), the job's progress is their
        sum: one bar's count alone jumps backwards and calls the job done with the fastest rank.
        Another bar of the same log (SpecForge's `Finalizing Writes`) still counts as a change."""
        moved = self._bars.feed(ev, ups, newline, at)
        if not self._bars.active:
            return ev
        done, total, rate = self._bars.aggregate()
        last = self._last
        if ev.desc != self._bars.desc and ev.source == "tqdm" and self._side.get(ev.desc) != ev.done:
            self._side[ev.desc] = ev.done
            self._side_moved = True
        samples = [b.samples for b in self._bars.observe(at).bars]
        counted = [s for s in samples if s is not None]
        postfix: dict[str, int | float | str] = (
            {"samples": sum(counted)} if samples and len(counted) == len(samples) else {})
        if last is not None and done == last.done and not moved:
            return last
        return ProgressEvent(done=int(done) if float(done).is_integer() else done,
                             total=(int(total) if total is not None and float(total).is_integer()
                                    else total),
                             source="tqdm", desc=self._bars.desc, unit=ev.unit, postfix=postfix,
                             rate_per_s=rate,
                             elapsed_s=ev.elapsed_s if ev.desc == self._bars.desc else None)

    def _on_event(self, ev: ProgressEvent, history: bool, line: str) -> int:
        self._events += 1
        changed = self._last is None or ev.done != self._last_done or self._side_moved
        self._side_moved = False
        self._last, self._last_done = ev, ev.done
        if history and ev.source == "tqdm":
            self._tqdm_history.append(ev)
        if not changed:
            return 0
        if history:  # timestamps are parsed at first sight only: later ticks time lines themselves
            self._marks.append((line_time(line), float(ev.done)))
        # Progress moved on after a traceback: it was caught and logged, not how the job ended.
        self._tb.reset()
        if self._fatal:
            self._fatal.clear()
        return 1

    def _on_changes(self, n: int, r: FollowResult, now: float) -> None:
        self._changes += n
        done = float(self._last.done) if self._last else 0.0
        if r.first:
            self._learn_history(r, now)
        else:
            if self._last_change is not None:
                # One sample a tick: the gap since the previous tick with progress, undivided.
                # The cadence decides how long a silence is normal, and a job that logs a batch
                # of six items every 5 minutes is silent for 5 minutes, not 50 s. (A fast job
                # then learns about one tick, which sits under the threshold's floor anyway.)
                self._add_interval(now - self._last_change)
            self._last_change, self._idle_source = now, "observed"
        if self._samples and done < self._samples[-1][1]:
            self._samples.clear()  # a new bar, or a restart from scratch: old rate is void
        self._samples.append((self._last_change if self._last_change is not None else now, done))

    def _add_interval(self, s: float) -> None:
        s = max(0.0, s)
        self._seq += 1
        if len(self._intervals) >= self.OUTLIER_MIN_SAMPLES:
            bound = max(self.OUTLIER_MIN_S, self.OUTLIER_P90_FACTOR * _p90(self._intervals))
            if s > bound:
                # A gap far beyond the rhythm is kept out of it unless one of at least half its
                # length came within the ring's span. A one-off is likely a stall that ended on
                # its own (a stopped server resumed): learning it (the threshold follows 2 × the
                # longest interval) would let the next stall run twice as long before it is
                # called. A recurring one is rhythm (an eval every tenth step) or a new, slower
                # pace, and is learned from its second occurrence, as before.
                recurring = any(self._seq - q <= self.CADENCE_RING and g >= 0.5 * s
                                for q, g in self._outliers)
                self._outliers.append((self._seq, s))
                self._outliers_total += 1
                if not recurring:
                    return
        # Estimates learned from history are the oldest entries: they leave the ring first.
        if self._estimated and len(self._intervals) == self._intervals.maxlen:
            self._estimated -= 1
        self._intervals.append(s)
        self._observed += 1

    def _learn_history(self, r: FollowResult, now: float) -> None:
        # When done last changed is unknown; the file's mtime bounds it. If the progress line was
        # the last thing written, mtime is that moment; otherwise it happened earlier.
        last_line = r.partial or (r.lines[-1] if r.lines else None)
        is_last = last_line is not None and self.parser.parse(last_line) is not None
        self._last_change = self._mono_of(r.mtime_s, now)
        self._idle_source = "mtime" if is_last else "mtime_lower_bound"
        stamped = _history_pace(self._marks)
        if not is_last and last_line is not None and stamped is not None:
            # Lines written after the last progress line: their timestamps say how much earlier
            # than the file's mtime the progress stopped.
            t_line, t_progress = line_time(last_line), self._marks[-1][0]
            extra = gap_s(t_progress, t_line) if t_line and t_progress else None
            if extra is not None:
                self._last_change -= extra
                self._idle_source = "mtime_timestamps"
        if stamped is not None:
            deltas_ts, self._history_rate, self._history_span, self._history_style = stamped
            self._history_lines = len(deltas_ts) + 1
        else:
            deltas_ts = []
        if len(deltas_ts) >= 3:
            # The log's own clock (ms resolution, usually) beats tqdm's whole seconds.
            self._intervals.extend(deltas_ts[-self.CADENCE_RING :])
            self._history_source = "log_timestamps"
            self._estimated = len(self._intervals)
            return
        # Cadence from tqdm's own elapsed field (1 s resolution) between changes of one bar.
        deltas: list[float] = []
        prev: ProgressEvent | None = None
        for ev in self._tqdm_history:
            if (prev is not None and ev.elapsed_s is not None and prev.elapsed_s is not None
                    and ev.total == prev.total and ev.elapsed_s >= prev.elapsed_s and ev.done != prev.done):
                deltas.append(ev.elapsed_s - prev.elapsed_s)
            prev = ev
        if len(deltas) >= 3:
            self._intervals.extend(deltas[-self.CADENCE_RING :])
            self._history_source = "tqdm_elapsed"
        elif self._last is not None and self._last.rate_per_s:
            # tqdm redraws at most every mininterval (0.1 s) and at least on every update.
            self._intervals.append(max(1.0 / self._last.rate_per_s, 0.1))
            self._history_source = "tqdm_rate"
        self._estimated = len(self._intervals)

    def _mono_of(self, mtime_s: float | None, now: float) -> float:
        """A file time on our monotonic axis (never in the future)."""
        if mtime_s is None:
            return now
        return now - max(0.0, self.clock.time() - mtime_s)

    def _push_tail(self, line: str, progress: bool) -> None:
        line = line[: self.TAIL_LINE_CHARS]
        # Successive redraws of a bar show as the one line a terminal would show.
        if progress and self._tail_last_progress and self._tail:
            self._tail[-1] = line
        else:
            self._tail.append(line)
        self._tail_last_progress = progress

    # -- derived values

    def _cadence(self) -> Cadence | None:
        if not self._intervals:
            return None
        source: CadenceSource
        if not self._estimated:
            source = "observed"
        else:
            source = self._history_source if not self._observed else "mixed"
        key = (tuple(self._intervals), source, self._outliers_total,
               self._outliers[-1][1] if self._outliers else None)
        if key != self._cadence_key:  # the model is rebuilt only when what it says changed
            xs = sorted(key[0])  # one sort for all three: statistics.median and _p90 each sort
            n = len(xs)
            median = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2  # as statistics.median
            # Unvalidated (built): a new interval each tick with progress rebuilt it every tick;
            # float(): a test's clock may count in ints. test_log_redraws holds it to validation.
            last_outlier = key[3]
            self._cadence_key, self._cadence_obs = key, built(Cadence, dict(
                median_s=float(median), p90_s=float(_p90(xs)), max_s=float(xs[-1]), samples=n,
                source=source, outliers=self._outliers_total,
                last_outlier_s=None if last_outlier is None else float(last_outlier),
            ))
        return self._cadence_obs

    def _rate(self, now: float, cadence: Cadence | None) -> float | None:
        if len(self._samples) < 2:
            return None
        window = max(self.rate_window_s, 3 * cadence.max_s if cadence else 0.0)
        base = self._samples[0]
        # Samples are in time order: when even the oldest is inside the window, none is before
        # it (the usual case at one sample a tick: the walk below would see all 64 for nothing).
        for s in reversed(self._samples) if base[0] <= now - window else ():
            if s[0] <= now - window:  # the latest sample at or before the window start
                base = s
                break
        span = now - base[0]
        if span <= 0:
            return None
        return max(0.0, (self._samples[-1][1] - base[1]) / span)

    def _obs(self, r: FollowResult, now: float) -> LogObs:
        f = self.follower
        cadence = self._cadence()
        rate = self._rate(now, cadence)
        last = self._last
        eta = None
        if last is not None and last.total is not None:
            speed = rate if rate is not None else last.rate_per_s
            if speed:
                eta = max(0.0, (float(last.total) - float(last.done)) / speed)
            elif last.remaining_s is not None:
                eta = last.remaining_s
        tail = list(self._tail) if self._tail_lines > 0 else []
        if r.partial and self._tail_lines > 0:
            p = r.partial[: self.TAIL_LINE_CHARS]
            if self._tail_last_progress and tail and p == self._peeked:
                tail[-1] = p
            else:
                tail = (tail + [p])[-self._tail_lines :]
        # Last tick's tuples handed on while they say the same: a reader may memo on identity.
        tail_t = tuple(tail)
        if tail_t == self._tail_out:
            tail_t = self._tail_out
        fatal_t = tuple(self._fatal)
        if fatal_t == self._fatal_out:
            fatal_t = self._fatal_out
        self._tail_out, self._fatal_out = tail_t, fatal_t
        ok = r.status is ProbeStatus.ok
        # Unvalidated (processes_obs.built): our own typed values, every tick; float(): a test's
        # clock may count in ints. tests/test_log_redraws.py holds it to its validation. Given in
        # the declared order, all of them set: built need not reorder forty fields a tick.
        values = dict(
            path=f.path, status=r.status, error=r.error,
            size_bytes=r.size if ok else None, mtime_epoch_s=r.mtime_s if ok else None,
            inode=r.ident[1] if ok and r.ident else None, device=r.ident[0] if ok and r.ident else None,
            offset_bytes=f.offset, backlog_bytes=max(0, (r.size or 0) - f.offset) if ok else 0,
            skipped_backlog_bytes=f.skipped_backlog_bytes,
            read_bytes=r.read_bytes, read_bytes_total=f.bytes_read_total, lines_total=f.lines_total,
            rotations=f.rotations, truncations=f.truncations, overlong_lines=f.overlong_lines,
            last_growth_age_s=None if self._last_growth is None else float(max(0.0, now - self._last_growth)),
            progress=last, progress_events=self._events, progress_changes=self._changes,
            idle_s=None if self._last_change is None else float(max(0.0, now - self._last_change)),
            idle_source=self._idle_source, cadence_s=cadence, rate_per_s=rate,
            tqdm_rate_per_s=last.rate_per_s if last else None,
            history_rate_per_s=self._history_rate, history_span_s=self._history_span,
            history_lines=self._history_lines, history_style=self._history_style,
            eta_s=eta, tail=tail_t,
            traceback=self._tb.current, tracebacks_seen=self._tb.seen, fatal=fatal_t,
            bars=self._bars.observe(now) if self._bars.active else None,
            root_cause=self._root.current,
        )
        return built(LogObs, values, set(values))

