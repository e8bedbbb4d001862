"""What one log line means: a progress event, the start or end of a Python traceback, a fatal line.

Pure functions over text, no I/O and no clock, so they are tested on literal lines and replayed
anywhere. The log probe feeds them one line at a time (tqdm's `\\r` updates already split).

Three progress sources, tried in this order when no user regex is given:
- tqdm bars (`desc:  49%|████▉     | 18380/37312 [4:58:10<5:07:01,  1.03it/s, k=v]`, and the
  total-less form `1234it [00:05, 246.80it/s]`), with unit_scale numbers (`18.4k/37.3k`);
- a plain `N/M` counter pair (`sample 18380/37312`, `[50/100]`), guarded against dates and paths.
With a user regex (named group `done`, optional `total`) only that regex is used: the user said
what progress looks like, so guessing would only add false positives.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import Field

from stallwatch.model import Frozen
from stallwatch.probes.base import field_defaults, made

PostfixValue = int | float | str


class ProgressEvent(Frozen):
    done: int | float
    total: int | float | None = None
    rate_per_s: float | None = None  # tqdm's own smoothed rate, items per second
    elapsed_s: float | None = None
    remaining_s: float | None = None
    source: Literal["tqdm", "fraction", "regex"]
    postfix: dict[str, PostfixValue] = Field(default_factory=dict)
    desc: str | None = None  # tqdm's description (the text before `: NN%|`)
    unit: str | None = None  # tqdm's unit ("it", "B", "samples")


# The parsers below build events unvalidated (base.made): each field is of its declared type by
# construction, and a bar line a tick was a validation of nine fields (issue 17; test_progress
# holds every parse to its validation).
_EVENT_DEFAULTS = field_defaults(ProgressEvent, factory_given=("postfix",))


# --- cleaning --------------------------------------------------------------------------------

# tqdm with position= moves the cursor with ESC[A; colour loggers add SGR codes. Other C0
# controls (NUL from a sparse copytruncate hole, BEL, backspace) only make evidence unreadable.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_CTRL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean_line(line: str) -> str:
    """Strip terminal escapes and control characters and trailing whitespace."""
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    if line.isprintable():  # every _CTRL character is unprintable: nothing to remove (most lines)
        return line.rstrip()
    return _CTRL.sub("", line).rstrip()


# --- numbers ---------------------------------------------------------------------------------

_SI = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "Z": 1e21, "Y": 1e24}
_NUM = r"\d+(?:\.\d+)?"
_SCALED = rf"{_NUM}[kMGTPEZY]?"


def _num(text: str) -> int | float:
    """`18380` → 18380, `18.4k` → 18400, `1,234` → 1234; ints stay ints so JSON shows 18380."""
    if len(text) <= 15 and text.isdigit() and text.isascii():
        return int(text)  # a plain count (ten a bar line a tick): exactly what float() gives it
    t = text.strip().replace(",", "").replace("_", "")
    mult = 1.0
    if t and t[-1] in "kMGTPEZY":
        mult, t = _SI[t[-1]], t[:-1]
    v = float(t) * mult
    if not math.isfinite(v):  # "10e308", "nan": no counter reads that (found by fuzzing)
        raise ValueError(f"not a finite number: {text!r}")
    return int(v) if v.is_integer() and abs(v) < 2**63 else v


def _scalar(text: str) -> PostfixValue:
    t = text.strip()
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        return t


# Compiled once: re's own cache lookup costs ~0.5 us a call, three calls a bar line (issue 17).
_INTERVAL = re.compile(r"\s*(?:(\d+)d,?\s*)?(?:(\d+):)?(\d+):(\d\d)\s*")
_INVERSE_RATE = re.compile(r"([kMGTPEZY]?)s/(.+)")


def _interval(text: str | None) -> float | None:
    """tqdm's [H:]MM:SS (hours unbounded; an optional `Nd ` prefix is accepted too)."""
    if not text:
        return None
    # tqdm's own MM:SS and H:MM:SS (two a bar line) without the regex: what it matches exactly
    # (isdecimal is \d; the seconds two digits; no part empty), anything else goes the regex's
    # way. Without a generator over the parts: ~12 k instructions a call was half of it.
    parts = text.split(":")
    n = len(parts)
    if (n == 2 or n == 3) and len(parts[-1]) == 2 and "" not in parts and text.replace(":", "").isdecimal():
        secs = int(parts[-2]) * 60 + int(parts[-1])
        return float(secs + int(parts[0]) * 3600 if n == 3 else secs)
    if text.strip() == "?":
        return None
    m = _INTERVAL.fullmatch(text)
    if not m:
        return None
    d, h, mi, s = (int(g) if g else 0 for g in m.groups())
    return float(((d * 24 + h) * 60 + mi) * 60 + s)


# --- tqdm ------------------------------------------------------------------------------------

_ELAPSED = r"(?:\d+d,?\s*)?(?:\d+:)?\d+:\d\d"
# `| n/total [elapsed<remaining, rate, postfix]` - the r_bar. The closing `]` is required so a
# bar cut mid-write is never parsed; the postfix runs to the last `]` because values may hold
# brackets (`lst=[1, 2]`).
_TQDM_TOTAL = re.compile(
    rf"(?P<n>{_SCALED})/(?P<total>{_SCALED})\s*\[(?P<elapsed>{_ELAPSED})<(?P<remaining>{_ELAPSED}|\?)"
    # rate: greedy, which matches as the lazy form did (it cannot hold the `,` or `]` that end
    # it) without trying the rest of the pattern after each of its characters
    rf",\s*(?P<rate>[^,\]]*)(?:,\s*(?P<postfix>.*))?\]"
)
# No total: `desc: 1234it [00:05, 246.80it/s]`.
_TQDM_NOTOTAL = re.compile(
    rf"(?<![\w.])(?P<n>{_SCALED})(?P<unit>[A-Za-z]\w*)\s\[(?P<elapsed>{_ELAPSED}),\s*(?P<rate>[^,\]]*?)"
    rf"(?:,\s*(?P<postfix>.*))?\]"
)
# Every r_bar has `[elapsed<` or `[elapsed,`; this literal-led search rejects other lines in ~0.2 µs,
# where the full patterns take several µs a line.
_TQDM_HINT = re.compile(rf"\[{_ELAPSED}[,<]")
_N_CHARS = ".kMGTPEZY"  # with the decimal digits: all that _SCALED's `n` may hold
_N_ASCII = "0123456789" + _N_CHARS


def _total_from(line: str) -> int:
    """Where a _TQDM_TOTAL match can begin at the earliest (-1: nowhere): its `n` ends at a `/`,
    the first one's at the earliest, and holds digits, dots and SI letters only. The pattern has
    no anchor or lookbehind, so searching from here finds what a search from 0 finds, without
    trying every position of the bar's description and percentage (issue 17: ~5 a tick)."""
    i = line.find("/")
    if i < 0:
        return -1
    # the ASCII ones stripped in C (a bar's own); a Unicode decimal (\d holds them) walked over
    i = len(line[:i].rstrip(_N_ASCII))
    while i > 0 and (line[i - 1].isdecimal() or line[i - 1] in _N_CHARS):
        i -= 1
    return i


_LBAR = re.compile(r"(?:^|\s)(?:(?P<desc>\S.*?):\s*)?(?P<pct>\d{1,3})%\|")
_RATE = re.compile(r"(?P<num>\?|\d+(?:\.\d+)?)(?P<rest>\S*)")
_POSTFIX_ITEM = re.compile(r"(?:^|,\s*)(?P<k>[^=,\s][^=,]*?)=(?P<v>.*?)(?=,\s*[^=,\s][^=,]*?=|$)")


def _rate(text: str, scaled: bool) -> tuple[float | None, str | None]:
    """`1.03it/s` → (1.03, "it"); `2.50s/it` → (0.4, "it"); `?it/s` → (None, "it")."""
    m = _RATE.fullmatch(text.strip())
    if not m:
        return None, None
    num, rest = m.group("num", "rest")
    # `it/s` (the usual) is never inverse: the match is tried only for what may be `s/it`
    inverse = _INVERSE_RATE.match(rest) if not rest.endswith("/s") else None
    if inverse:
        mult, unit = _SI[inverse[1]], inverse[2]
        value = None if num == "?" else float(num) * mult
        return (1.0 / value if value else None), unit
    if not rest.endswith("/s"):
        return None, None
    unit = rest[:-2]
    mult = 1.0
    # tqdm's unit_scale prefixes the unit (`1.03kit/s`); a unit that merely starts with k/M
    # (`kg`) is only read as scaled when the counters themselves are scaled.
    if unit[:1] in "kMGTPEZY" and len(unit) > 1 and (scaled or unit[1:] in ("it", "B")):
        mult, unit = _SI[unit[0]], unit[1:]
    return (None if num == "?" else float(num) * mult), unit or None


def _postfix(text: str | None) -> dict[str, PostfixValue]:
    if not text:
        return {}
    t = text.strip()
    items = t.split(", ")
    # tqdm's own `k=v, k=v` (set_postfix): split, not the regex's lookahead at every character
    # (~22 k instructions a bar line). Taken only where it reads what _POSTFIX_ITEM reads: every
    # comma followed by one space, each item one `=` after a key that starts with no space.
    if t.count(",") == len(items) - 1:
        out: dict[str, PostfixValue] = {}
        for item in items:
            k, eq, v = item.partition("=")
            if not k or k[0].isspace() or "=" in v or not eq:
                break
            out[k.strip()] = _scalar(v)
        else:
            return out
    return _postfix_regex(t)


def _postfix_regex(t: str) -> dict[str, PostfixValue]:
    return {m["k"].strip(): _scalar(m["v"]) for m in _POSTFIX_ITEM.finditer(t)}


_last_desc: tuple[str, str | None] = ("", None)


def _desc(before: str) -> str | None:
    """The description in the l_bar (`desc:  49%|████▉     | `). A bar's l_bar changes with its
    percentage only, so the last one's answer is kept: _LBAR's lazy scan is ~10 k instructions."""
    global _last_desc
    last = _last_desc  # one read: the log probes of several jobs may parse at once (lanes)
    if before == last[0]:
        return last[1]
    lbar = _LBAR.search(before)
    desc = lbar["desc"] if lbar and lbar["desc"] else None
    _last_desc = (before, desc)
    return desc


def parse_tqdm(line: str) -> ProgressEvent | None:
    if not _TQDM_HINT.search(line):
        return None
    try:
        return _parse_tqdm(line)
    except ValueError:  # a counter of 400 digits reads as inf: not a bar
        return None


def tqdm_done(line: str) -> tuple[int | float, int | float, bool] | None:
    """(done, total, has a postfix) of a bar with a total, exactly as parse_tqdm reads them,
    without the rest (rate, times, postfix, the event): for redraws whose other fields a later
    redraw replaces (probes/log.py). None where parse_tqdm would not read such a bar."""
    start = _total_from(line)
    if start < 0:
        return None
    # No _TQDM_HINT search first: a match holds `[elapsed<` after its `/`, so the hint would pass
    # for every line this matches, and the lines given here are a bar's redraws (log.py), where
    # it was a second scan for nothing.
    m = _TQDM_TOTAL.search(line, start)
    if m is None:
        return None
    n, total, postfix = m.group("n", "total", "postfix")
    try:
        return _num(n), _num(total), bool(postfix)
    except ValueError:
        return None


def _parse_tqdm(line: str) -> ProgressEvent | None:
    start = _total_from(line)
    m = _TQDM_TOTAL.search(line, start) if start >= 0 else None
    if m:
        n_txt, total_txt, elapsed, remaining, rate_txt, postfix = m.group(
            "n", "total", "elapsed", "remaining", "rate", "postfix")
        # `n` holds \d, dots and SI letters only: scaled where it is not all decimal digits
        scaled = not (n_txt + total_txt).isdecimal()
        done, total = _num(n_txt), _num(total_txt)
        rate, unit = _rate(rate_txt, scaled)
        return made(ProgressEvent, _EVENT_DEFAULTS, dict(
            done=done, total=total, rate_per_s=rate, elapsed_s=_interval(elapsed),
            remaining_s=_interval(remaining), source="tqdm", postfix=_postfix(postfix),
            desc=_desc(line[: m.start()]), unit=unit,
        ))
    m = _TQDM_NOTOTAL.search(line)
    if m:
        scaled = any(c in "kMGTPEZY." for c in m["n"])
        rate, unit = _rate(m["rate"], scaled)
        prefix = line[: m.start()].strip()
        return made(ProgressEvent, _EVENT_DEFAULTS, dict(
            done=_num(m["n"]), total=None, rate_per_s=rate, elapsed_s=_interval(m["elapsed"]),
            source="tqdm", postfix=_postfix(m["postfix"]),
            desc=prefix.rstrip(":").strip() or None, unit=unit or m["unit"],
        ))
    return None


# --- plain N/M -------------------------------------------------------------------------------

_COUNT = r"\d{1,3}(?:,\d{3})+|\d{1,18}"
# Not after a word character, slash, dot or dash (paths `run-1/2`, dates `2024/11/29`, versions,
# CIDR `10.0.0.0/24`); not followed by a word character, slash or a decimal part.
_FRACTION = re.compile(
    rf"(?<![\w/.\-])(?<!\d,)(?P<done>{_COUNT})\s?/\s?(?P<total>{_COUNT})(?![\w/]|[.,]\d)"
)


def _digit_slash_digit(line: str) -> bool:
    i = line.find("/")
    while i != -1:
        if line[max(0, i - 2) : i].strip()[-1:].isdigit() and line[i + 1 : i + 3].strip()[:1].isdigit():
            return True
        i = line.find("/", i + 1)
    return False


def parse_fraction(line: str) -> ProgressEvent | None:
    """The counter pair with the largest total (the inner loop of `epoch 3/10 step 500/1000`,
    the sample count of `sample 18380/37312 rank 1/8`), among pairs with 0 < total, done ≤ total."""
    if not _digit_slash_digit(line):  # the full pattern's lookbehinds cost µs on every line
        return None
    best: tuple[int, int] | None = None
    for m in _FRACTION.finditer(line):
        done, total = int(_num(m["done"])), int(_num(m["total"]))
        if total > 0 and done <= total and (best is None or total >= best[1]):
            best = (done, total)
    if best is None:
        return None
    # postfix: its default_factory's {} (given, so made has it), yet not `set`, as validated
    ev = made(ProgressEvent, _EVENT_DEFAULTS, dict(done=best[0], total=best[1], source="fraction",
                                                   postfix={}))
    ev.model_fields_set.discard("postfix")
    return ev


# --- user regex ------------------------------------------------------------------------------


def compile_progress_regex(pattern: str) -> re.Pattern[str]:
    """Compile a user's progress regex; a ValueError names the problem (shown to the user)."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"progress regex {pattern!r} does not compile: {e}") from e
    if "done" not in rx.groupindex:
        have = ", ".join(rx.groupindex) or "none"
        raise ValueError(
            f"progress regex {pattern!r} has no named group 'done' (named groups: {have}); "
            r"write e.g. '(?P<done>\d+)/(?P<total>\d+)'"
        )
    return rx


def parse_regex(line: str, rx: re.Pattern[str]) -> ProgressEvent | None:
    m = rx.search(line)
    if not m or m["done"] is None:
        return None
    try:
        done = _num(m["done"])
        total = _num(m["total"]) if "total" in rx.groupindex and m["total"] else None
    except ValueError:  # the group matched something that is not a number: not progress
        return None
    extra = {k: _scalar(v) for k, v in m.groupdict().items() if k not in ("done", "total") and v is not None}
    return ProgressEvent(done=done, total=total, source="regex", postfix=extra)


class ProgressParser:
    """One parser per log: the user's regex if given, else tqdm then N/M."""

    def __init__(self, regex: str | None = None) -> None:
        self.regex = compile_progress_regex(regex) if regex else None

    def parse(self, line: str) -> ProgressEvent | None:
        if self.regex is not None:
            return parse_regex(line, self.regex)
        if "/" not in line:  # every built-in form has one: cheap reject for most log lines
            return None
        return parse_tqdm(line) or parse_fraction(line)


def parse_progress(line: str, regex: str | None = None) -> ProgressEvent | None:
    return ProgressParser(regex).parse(line)


# --- crash text ------------------------------------------------------------------------------

# torchrun's `[rank0]: `, `--tee`'s `[default0]:`, mpirun's `[1,0]<stderr>:`.
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)?\d+(?:,\d+)?\](?:<std(?:out|err)>)?:\s?")
_TB_START = re.compile(r"Traceback \(most recent call last\):\s*$")
_EXC_NAMED = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Iteration|Warning|Failure|Timeout|Fault))"
    r"(?::\s?(?P<msg>.*))?$"
)
_EXC_ANY = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")
_CHAIN = re.compile(r"^(During handling of the above exception|The above exception was the direct cause)")


def strip_rank_prefix(line: str) -> str:
    return _RANK_PREFIX.sub("", line, count=1)


def is_traceback_start(line: str) -> bool:
    return _TB_START.search(line) is not None


def exception_line(line: str) -> tuple[str, str | None] | None:
    """(type, message) if the line looks like a traceback's final line on its own."""
    m = _EXC_NAMED.match(strip_rank_prefix(line).strip())
    return (m["type"], m["msg"]) if m else None


# First match wins, so the specific kinds (CUDA OOM) come before the general (CUDA error).
_FATAL: list[tuple[str, str]] = [
    ("cuda_oom", r"CUDA out of memory|OutOfMemoryError"),
    ("cuda_error", r"CUDA error|CUDA_ERROR_\w+|cudaError\w+|illegal memory access|device-side assert"
                   r"|CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+"),
    ("nccl", r"NCCL (?:error|WARN|timeout)|nccl\w*Error|Watchdog caught collective operation timeout"
             r"|ProcessGroupNCCL.*(?:[Tt]imeout|abort)|NCCL communicator was aborted"),
    ("disk_full", r"No space left on device|Disk quota exceeded"),
    ("io_error", r"Input/output error|Stale file handle"),
    ("segfault", r"Segmentation fault|SIGSEGV"),
    ("bus_error", r"Bus error|SIGBUS"),
    ("abort", r"Aborted \(core dumped\)|terminate called after throwing|SIGABRT"),
    ("python_fatal", r"Fatal Python error"),
    ("oom", r"Out of memory: Killed process|\bMemoryError\b|Cannot allocate memory"),
    ("killed", r"^\s*Killed\s*$|\bKilled\s+\S*python|^\S*: line \d+:\s+\d+ Killed|killed by signal"
               r"|exitcode\s*:\s*-9\b|SIGKILL"),
    ("child_failed", r"ChildFailedError"),
]
_FATAL_RE = re.compile("|".join(f"(?P<{k}>{rx})" for k, rx in _FATAL))
# Python tries every alternative at every position (~20 µs a line); substring tests are ~1 µs.
# Each pattern above contains at least one of these, lowercased (tests check every kind).
_FATAL_HINTS = (
    "cuda", "memory", "illegal", "device-side", "cublas", "cudnn", "nccl", "collective", "space left",
    "quota", "input/output", "stale file", "segmentation", "sigsegv", "bus error", "sigbus", "abort",
    "sigabrt", "terminate called", "fatal python", "killed", "exitcode", "sigkill", "childfailed",
)


def fatal_kind(line: str) -> str | None:
    """A coarse name for a line that usually ends a job (`cuda_oom`, `nccl`, `killed`, ...)."""
    low = line.lower()
    for hint in _FATAL_HINTS:
        if hint in low:
            break
    else:
        return None
    m = _FATAL_RE.search(strip_rank_prefix(line))
    return m.lastgroup if m else None


class Traceback(Frozen):
    lines: tuple[str, ...]  # head and tail of the block; `omitted_lines` were cut from the middle
    exception: str | None = None  # the final `Type: message` line, the one that ended the chain
    exception_type: str | None = None
    omitted_lines: int = 0


class TracebackTracker:
    """Follows lines and keeps the last traceback block, chained ones included, bounded.

    Pure state over text. The caller resets it when progress resumes: a traceback followed by
    progress was caught and logged, it is not how the job ended.
    """

    HEAD, TAIL, AFTER_LINES, LINE_CHARS = 8, 40, 10, 400

    def __init__(self) -> None:
        self._state = ""  # not yet "none": reset() fills every field
        self.reset()
        self.seen = 0  # blocks started, over the whole log

    def reset(self) -> None:
        """Forget the block under way. Called on every progress change (~5 a tick): with no
        block begun (state "none", which only reset() enters) there is nothing to forget."""
        if self._state == "none":
            return
        self._head: list[str] = []
        self._tail: list[str] = []
        self._omitted = 0
        self._exc: tuple[str, str | None] | None = None
        self._exc_line: str | None = None
        self._state = "none"  # none | frames | after | chained | done
        self._after = 0

    def _add(self, line: str) -> None:
        line = line[: self.LINE_CHARS]
        if len(self._head) < self.HEAD:
            self._head.append(line)
            return
        self._tail.append(line)
        if len(self._tail) > self.TAIL:
            self._tail.pop(0)
            self._omitted += 1

    def feed(self, line: str) -> None:
        body = strip_rank_prefix(line)
        if is_traceback_start(body):
            if self._state != "chained":
                self.reset()
                self.seen += 1
            self._add(line)
            self._state = "frames"
            return
        st = self._state
        if st == "frames":
            if not body.strip() or body[:1].isspace():
                self._add(line)  # frames, source lines, carets, "[Previous line repeated]"
                return
            m = _EXC_ANY.match(body.strip())
            if m:  # the first unindented line after the frames is the exception
                self._exc, self._exc_line = (m["type"], m["msg"]), body.strip()
                self._add(line)
                self._state, self._after = "after", 0
            # anything else is another writer interleaved: not part of the block
            return
        if st == "after":
            if _CHAIN.match(body.strip()):
                self._add(line)
                self._state = "chained"
            elif body.strip() and self._after < self.AFTER_LINES:
                self._add(line)  # multi-line messages (CUDA errors add three lines of hints)
                self._after += 1
            elif body.strip():
                self._state = "done"

    @property
    def current(self) -> Traceback | None:
        if self._state == "none" or not self._head:
            return None
        return Traceback(
            lines=tuple(self._head + self._tail), exception=self._exc_line,
            exception_type=self._exc[0] if self._exc else None, omitted_lines=self._omitted,
        )
