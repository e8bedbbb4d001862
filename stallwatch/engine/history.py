"""The last minutes of a job as numbers, and as sparklines: "it slowed, then stopped, while the
GPU went idle", seen at a glance.

One `Sample` per tick, taken from the rule variables (stallwatch.engine.features), which are a pure
function of the snapshot: so the same samples come from the daemon's tick and from a trace of
`stallwatch record` replayed (`samples_from_trace`), and a sparkline in an alert can be checked
against the recorded trace. Counters (progress done, I/O bytes) are kept as counters; rates are
derived when drawing, so a gap in the samples never invents a rate.

Pure: no clock, no I/O. `History` is a bounded ring (the daemon keeps one per job);
`sparklines` draws the five series of the last `window_s` seconds:

    rate  ▁▃▅▇██▇▇▆▆▅▃▁▁▁▁▁▁▁▁   0/s (max 4.1/s)
    gpu   ▆▇▇▇▇▇▇▇▇▇▆▂▁▁▁▁▁▁▁▁   0% (max 97%)
"""

from __future__ import annotations

import itertools
import json
import math
from collections import deque
from itertools import pairwise
from dataclasses import dataclass, fields
from typing import Any
from collections.abc import Iterable, Sequence

BARS = "▁▂▃▄▅▆▇█"
NO_DATA = " "  # a bucket with no sample: not zero, which would read as "stopped"
SERIES = ("rate", "gpu", "gpu_mem", "cpu", "io")
LABELS = {"rate": "progress", "gpu": "GPU util", "gpu_mem": "GPU mem", "cpu": "CPU",
          "io": "I/O"}


@dataclass(frozen=True)
class Sample:
    t: float  # wall time, Unix seconds (a trace's snapshots carry it too)
    done: float | None = None  # progress counter (the log's `done`)
    gpu_util_pct: float | None = None  # mean over the job's GPUs
    gpu_mem_bytes: float | None = None  # the job's processes' GPU memory
    cpu_cores: float | None = None  # CPU cores busy, the whole job tree
    io_bytes: float | None = None  # read + write bytes of the job's live processes, a counter

    def doc(self) -> dict[str, Any]:
        # Flat floats: no dataclasses.asdict (it deep-copies every value; 5 µs a sample, 300
        # samples whenever the history is saved).
        return {k: v for k in _FIELDS if (v := getattr(self, k)) is not None}


_FIELDS = tuple(f.name for f in fields(Sample))


def sample(t_wall: float, v: dict[str, Any], snap: Any = None) -> Sample:
    """A Sample from the rule variables `v` (and the snapshot's per-process I/O counters)."""
    lg, gpu, proc = v.get("log") or {}, v.get("gpu") or {}, v.get("proc") or {}
    done = lg.get("done") if lg.get("has_progress") else None
    util = gpu.get("util_mean_pct")
    mem = gpu.get("job_mem_bytes") if gpu.get("present") else None
    cpu = proc.get("cpu_util") if proc.get("cpu_known") else None
    io = None
    procs = getattr(getattr(snap, "processes", None), "processes", None)
    if procs:
        total, known = 0, False  # one pass, no list or generator made a tick
        for p in procs:
            i = p.io
            if i is not None and p.state not in ("Z", "X"):
                total += i.read_bytes + i.write_bytes
                known = True
        if known:
            io = float(total)
    # Sample(...) as its __init__ would set it, without six object.__setattr__ calls a tick
    # (a frozen dataclass's; a third of this function's cost, issue 17).
    s = _new(Sample)
    _set(s, "__dict__", {"t": float(t_wall), "done": _num(done),
                         "gpu_util_pct": _num(util) if util is not None and util >= 0 else None,
                         "gpu_mem_bytes": _num(mem), "cpu_cores": _num(cpu), "io_bytes": io})
    return s


_new, _set = object.__new__, object.__setattr__


def _num(x: Any) -> float | None:
    if type(x) is float:  # what the variables hold: no conversion to try
        return x if math.isfinite(x) else None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class History:
    """A ring of the last `keep` samples (at 1 s a tick, 600 is ten minutes).

    Each sample's JSON is made once, by the first `docs_json` after it was added: the daemon
    saves the last five minutes as one JSON row every few seconds, which re-encoded 300 samples
    each time; and made then, not as each sample is added, the json module runs once a save,
    not once a tick (at 1 s each run is cold memory: docs/performance.md)."""

    def __init__(self, keep: int = 600) -> None:
        self.samples: deque[Sample] = deque(maxlen=keep)
        self._json: deque[str] = deque(maxlen=keep)  # samples[i] as JSON, after _dump_new
        self.added = 0  # samples added so far: a saver that saw this count has nothing new
        self._dumped = 0  # `added` when _json last caught up

    def add(self, s: Sample) -> None:
        if self.samples and s.t <= self.samples[-1].t:
            return  # a clock step back: keep the series monotonic rather than draw it twice
        self.samples.append(s)
        self.added += 1

    def _dump_new(self) -> None:
        """Append the JSON of the samples added since; then _json[i] is samples[i] (both rings
        have the same length bound, so the oldest fall off both alike)."""
        new = min(self.added - self._dumped, len(self.samples))
        if new:
            start = len(self.samples) - new
            self._json.extend(json.dumps(s.doc())
                              for s in itertools.islice(self.samples, start, None))
        self._dumped = self.added

    def _window(self, window_s: float | None) -> int:
        """The index of the first sample inside the last `window_s` seconds."""
        if window_s is None or not self.samples:
            return 0
        first = self.samples[-1].t - window_s
        i = len(self.samples)
        while i > 0 and self.samples[i - 1].t >= first:
            i -= 1
        return i

    def docs(self, window_s: float | None = None) -> list[dict[str, Any]]:
        start = self._window(window_s)
        return [s.doc() for s in itertools.islice(self.samples, start, None)]

    def docs_json(self, window_s: float | None = None) -> str:
        """`json.dumps(self.docs(window_s))`, from each sample's JSON made once."""
        self._dump_new()
        start = self._window(window_s)
        return "[" + ", ".join(itertools.islice(self._json, start, None)) + "]"


def from_docs(docs: Iterable[dict[str, Any]]) -> list[Sample]:
    out = []
    for d in docs:
        try:
            out.append(Sample(t=float(d["t"]), **{k: _num(d.get(k)) for k in
                                                  ("done", "gpu_util_pct", "gpu_mem_bytes",
                                                   "cpu_cores", "io_bytes")}))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def samples_from_trace(path: Any) -> list[Sample]:
    """The samples of a `stallwatch record` trace: the same function of the same snapshots."""
    from stallwatch.engine.features import features
    from stallwatch.probes.snapshot import Snapshot
    from stallwatch.probes.trace import read_trace

    _header, rows, _events = read_trace(path)
    out = []
    for row in rows:
        snap = Snapshot.model_validate({k: v for k, v in row.items() if k != "type"})
        out.append(sample(snap.t_wall, features(snap), snap))
    return out


# ----------------------------------------------------------------------------------- series

def series(samples: Sequence[Sample]) -> dict[str, list[tuple[float, float | None]]]:
    """Per series, (t, value) points: levels as they are, counters as rates between samples
    (none across a counter reset: a restarted run's counter starts over)."""
    out: dict[str, list[tuple[float, float | None]]] = {k: [] for k in SERIES}
    prev: Sample | None = None
    for s in samples:
        out["gpu"].append((s.t, s.gpu_util_pct))
        out["gpu_mem"].append((s.t, s.gpu_mem_bytes))
        out["cpu"].append((s.t, s.cpu_cores))
        out["rate"].append((s.t, _rate(prev, s, "done")))
        out["io"].append((s.t, _rate(prev, s, "io_bytes")))
        prev = s
    return out


def _rate(a: Sample | None, b: Sample, key: str) -> float | None:
    if a is None:
        return None
    x, y, dt = getattr(a, key), getattr(b, key), b.t - a.t
    if x is None or y is None or dt <= 0 or y < x:
        return None
    return (y - x) / dt


def buckets(points: Sequence[tuple[float, float | None]], end_t: float, window_s: float,
            width: int) -> list[float | None]:
    """Mean value per time bucket over [end_t - window_s, end_t]. A bucket no sample fell in
    holds the value before it when that sample is recent (within two sampling intervals: tick
    jitter, not a gap); otherwise None, drawn as a gap: the value was not known then."""
    sums = [0.0] * width
    counts = [0] * width
    start = end_t - window_s
    known = [(t, v) for t, v in points if v is not None and start <= t <= end_t]
    for t, v in known:
        i = min(width - 1, int((t - start) / window_s * width))
        sums[i] += v
        counts[i] += 1
    gaps = sorted(b[0] - a[0] for a, b in pairwise(known))
    hold_s = 2 * gaps[(len(gaps) - 1) // 2] if gaps else 0.0  # the lower median
    out: list[float | None] = []
    j = -1  # the last known sample before the current bucket
    for i in range(width):
        b_start = start + i * window_s / width
        while j + 1 < len(known) and known[j + 1][0] < b_start:
            j += 1
        if counts[i]:
            out.append(sums[i] / counts[i])
        elif j >= 0 and b_start - known[j][0] <= hold_s:
            out.append(known[j][1])
        else:
            out.append(None)
    return out


def spark(values: Sequence[float | None], top: float | None = None) -> str:
    """One character per value, ▁ (zero) to █ (`top`, default the largest); NO_DATA for None."""
    known = [v for v in values if v is not None]
    top = top if top is not None else max(known, default=0.0)
    out = []
    for v in values:
        if v is None:
            out.append(NO_DATA)
        elif top <= 0:
            out.append(BARS[0])
        else:
            out.append(BARS[min(len(BARS) - 1, max(0, int(v / top * (len(BARS) - 1) + 0.5)))])
    return "".join(out)


def _fmt(key: str, v: float | None) -> str:
    if v is None:
        return "?"
    if key == "rate":
        return f"{v:.3g}/s"
    if key == "gpu":
        return f"{v:.0f}%"
    if key == "cpu":
        return f"{v:.2g} cores" if v < 10 else f"{v:.0f} cores"
    from stallwatch.engine.features import human_bytes

    return human_bytes(v) + ("/s" if key == "io" else "")


def sparklines(samples: Sequence[Sample], window_s: float = 300.0, width: int = 30,
               keys: Sequence[str] = SERIES) -> list[dict[str, Any]]:
    """The drawable rows: {key, label, spark, now, max, now_text, max_text, window_s} for each
    series that has any value in the window (a job without a GPU gets no GPU rows). A history
    shorter than `window_s` is stretched over the width: a 20-second job is drawn whole."""
    if not samples:
        return []
    end = samples[-1].t
    window_s = max(1.0, min(window_s, end - samples[0].t))
    width = max(1, min(width, len(samples)))  # never more columns than samples
    allp = series(samples)
    rows = []
    for k in keys:
        vals = buckets(allp[k], end, window_s, width)
        known = [v for v in vals if v is not None]
        if not known:
            continue
        top = max(known)
        last = next((v for v in reversed(vals) if v is not None), None)
        rows.append({"key": k, "label": LABELS[k], "spark": spark(vals, top), "now": last,
                     "max": top, "now_text": _fmt(k, last), "max_text": _fmt(k, top),
                     "window_s": window_s})
    return rows


def sparkline_text(rows: Sequence[dict[str, Any]]) -> str:
    """Plain lines for alerts, the evidence bundle and `status`: label, sparkline, now, max."""
    if not rows:
        return ""
    w = max(len(r["label"]) for r in rows)
    lines = [f"{r['label']:<{w}} {r['spark']} {r['now_text']} (max {r['max_text']})" for r in rows]
    return "\n".join(lines) + f"\n(the last {_span(rows[0]['window_s'])}, oldest on the left)"


def _span(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"
