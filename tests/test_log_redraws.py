"""The log probe's fast paths (issue 17): a tick's bar redraws that its last progress line
supersedes are counted from `done` alone, not parsed (LogProbe._redraws_to_skip); the LogObs is
built unvalidated.

Each test replays one byte stream, tick after tick, into two probes, the fast path on and off,
and requires the same LogObs after every tick: whatever the fast path skips must never show."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from stallwatch.clock import FakeClock
from stallwatch.probes.log import LogObs, LogProbe
from stallwatch.probes.text.progress import parse_tqdm, tqdm_done

FIX = Path(__file__).parent / "fixtures" / "specforge"


def replay(tmp_path: Path, chunks: list[bytes]) -> tuple[int, int]:
    """Both probes over the same growing file; (lines skipped, progress changes at the end)."""
    log = tmp_path / "job.log"
    log.write_bytes(b"")
    clock = FakeClock(monotonic=1000)  # ints: LogObs is built unvalidated, its fields floats still
    fast, full = LogProbe(log, clock=clock), LogProbe(log, clock=clock)
    full.SKIP_REDRAWS = False
    skipped = 0
    real = fast._on_redraw

    def counting(done):
        nonlocal skipped
        skipped += 1
        return real(done)

    fast._on_redraw = counting
    for n, chunk in enumerate(chunks):
        with open(log, "ab") as f:
            f.write(chunk)
        a, b = fast.collect(), full.collect()
        assert a == b, f"tick {n}: {chunk!r}"
        v = LogObs.model_validate(a.model_dump())  # the unvalidated build equals its validation
        assert a == v and a.model_dump_json() == v.model_dump_json() and repr(a) == repr(v), f"tick {n}"
        assert list(a.__dict__) == list(LogObs.model_fields), f"tick {n}"  # the declared order
        # nor inside: the bar in view alone is not in the LogObs until a second one appears
        now = clock.monotonic()
        assert fast._bars.observe(now) == full._bars.observe(now), f"tick {n}: {chunk!r}"
        assert fast._bars.aggregate() == full._bars.aggregate(), f"tick {n}: {chunk!r}"
        clock.advance(1)
    return skipped, a.progress_changes


def bar(i: int, total: int = 1000, rate: str = "4.93it/s", postfix: str = ", processed={i}, skipped=0",
        desc: str = "Generating Hidden States") -> str:
    return f"{desc}:   0%|          | {i}/{total} [01:17<56:20,  {rate}{postfix.format(i=i)}]"


def test_the_standard_job_skips_all_but_the_last_redraw_and_counts_every_change(tmp_path) -> None:
    # ~5 redraws a tick, the newest unterminated (tqdm's), as the standard healthy job writes
    chunks = [b"loading\n" + b"".join(b"\r" + bar(i).encode() for i in range(0, 3))]
    chunks += [b"".join(b"\r" + bar(i).encode() for i in range(t, t + 5)) for t in range(3, 60, 5)]
    skipped, changes = replay(tmp_path, chunks)
    assert skipped >= 3 * (len(chunks) - 1)  # the fast path ran: not vacuous
    assert changes == 63  # each of the counts 0..62 once, skipped lines included


@pytest.mark.parametrize("seed", range(6))
def test_mixed_streams_read_the_same_with_and_without_the_fast_path(tmp_path, seed: int) -> None:
    rng = random.Random(seed)
    i, total, out = 0, 500, []
    for _ in range(60):
        parts = []
        for _ in range(rng.randint(0, 7)):
            k = rng.random()
            if k < 0.55:
                i += rng.choice([0, 1, 1, 2])
            elif k < 0.6:
                i = max(0, i - 3)  # a count cut from its own bar: backwards
            if k < 0.6:
                rate = rng.choice([f"{rng.uniform(1, 9):.2f}it/s", "?it/s", "2.10s/it"])
                post = rng.choice([", processed={i}, skipped=0", "", ", loss=0.3"])
                parts.append("\r" + bar(i, total, rate, post))
            elif k < 0.65:
                total = rng.choice([500, 800])
                parts.append("\r" + bar(i, total))
            elif k < 0.7:
                parts.append("\r" + bar(total, total) + "\n")  # a close
            elif k < 0.75:
                parts.append("\r" + bar(rng.randint(0, 9), 10, desc="Finalizing Writes"))
            elif k < 0.8 and seed % 3 == 2:  # another rank's position: the bars aggregate
                parts.append("\n" * 1 + "\r" + bar(i, total) + "\x1b[A")
            elif k < 0.85:
                parts.append(f"\nstep {i}/{total}\n")
            elif k < 0.9:
                parts.append("\nTraceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom\n")
            elif k < 0.95:
                parts.append("\nRuntimeError: CUDA error: an illegal memory access\n")
            else:
                parts.append("\r" + bar(i, total)[:30])  # cut mid-write
        out.append("".join(parts).encode())
    skipped, _ = replay(tmp_path, out)
    assert skipped > 0 or seed % 3 == 2  # the fast path ran: not vacuous


@pytest.mark.parametrize("name", sorted(p.name for p in FIX.glob("*.log")))
def test_real_multi_rank_captures_read_the_same(tmp_path, name: str) -> None:
    data = (FIX / name).read_bytes()
    cuts = sorted(random.Random(name).sample(range(1, len(data)), min(len(data) - 1, 40)))
    replay(tmp_path, [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=False)])


def test_tqdm_done_agrees_with_parse_tqdm() -> None:
    lines = [bar(7), bar(7, rate="?it/s", postfix=""), "x 18.4k/37.3k [4:58:10<5:07:01,  1.03it/s]",
             "1234it [00:05, 246.80it/s]", "not a bar 3/4", "a " + "9" * 400 + "/5 [00:01<00:02, 1it/s]"]
    for line in lines:
        got, ev = tqdm_done(line), parse_tqdm(line)
        if got is not None:  # where it answers, it is exactly parse_tqdm's
            assert ev is not None and (got[0], got[1], got[2]) == (ev.done, ev.total, bool(ev.postfix))
    assert tqdm_done(bar(7)) == (7, 1000, True)
    assert tqdm_done("1234it [00:05, 246.80it/s]") is None  # no total: left to the full parse


def test_a_steady_poll_reads_the_new_bytes_only_and_a_hole_past_the_end_is_still_jumped(
        tmp_path, monkeypatch) -> None:
    """LogFollower: the fingerprint is the bytes just read (no pread for it), the hole check is
    the first byte read (no lseek a tick); a writer seeking past the end still has its hole
    jumped, not read, and a copytruncate still restarts the file."""
    from stallwatch.probes import logfollow

    log = tmp_path / "job.log"
    log.write_bytes(b"start\n")
    f = logfollow.LogFollower(log)
    calls: list[str] = []
    for name in ("pread", "lseek"):
        real = getattr(os, name)
        monkeypatch.setattr(logfollow.os, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    assert f.poll().lines == ["start"]
    for i in range(3):
        with open(log, "ab") as w:
            w.write(f"line {i}\n".encode())
        calls.clear()
        assert f.poll().lines == [f"line {i}"]
        assert calls == ["pread", "pread"], calls  # the prefix check and the new bytes
    with open(log, "ab") as w:  # up to a block's end: the hole below is a whole one
        w.write(b"z" * (4095 - f.offset % 4096) + b"\n")
    assert len(f.poll().lines) == 1 and f.offset % 4096 == 0
    with open(log, "r+b") as w:  # a writer seeking 1 MiB past the end
        w.seek(1 << 20, os.SEEK_END)
        w.write(b"after the hole\n")
    calls.clear()
    r = f.poll()
    assert r.lines == ["after the hole"] and "lseek" in calls
    assert r.read_bytes < 4096 and f.skipped_hole_bytes >= 1 << 20  # jumped, not read
    with open(log, "r+b") as w:  # copytruncate, then the job writes as much again at once
        w.truncate(0)
        w.write(b"x" * 100 + b"\nnew run\n" + b"y" * (f.offset - 100))
    r = f.poll()
    assert f.truncations == 1 and "new run" in r.lines


def test_a_poll_asks_pread_for_the_bytes_fstat_saw_not_a_whole_read_size(tmp_path, monkeypatch) -> None:
    """A 1 MiB pread for a tick's few hundred bytes made glibc mmap, mremap and munmap a buffer
    every tick: each read asks for what the file holds past the offset (capped by read_size),
    and a backlog bigger than read_size is still read in read_size pieces within the budget."""
    from stallwatch.probes import logfollow

    log = tmp_path / "job.log"
    log.write_bytes(b"start\n")
    f = logfollow.LogFollower(log, read_size=4096, chunk_budget_bytes=8192, initial_tail_bytes=8192)
    asked: list[int] = []
    real = os.pread
    monkeypatch.setattr(logfollow.os, "pread", lambda fd, n, at: asked.append(n) or real(fd, n, at))
    assert f.poll().lines == ["start"] and asked == [6]
    with open(log, "ab") as w:
        w.write(b"step 1/10\n")
    asked.clear()
    assert f.poll().lines == ["step 1/10"]
    assert asked == [6, 10], asked  # the prefix check, then the ten new bytes
    with open(log, "ab") as w:  # a backlog of 10,000 bytes: two read_size pieces, the budget
        w.write(b"".join(b"%04d\n" % i for i in range(2000)))
    asked.clear()
    r = f.poll()
    assert asked[1:] == [4096, 4096] and r.read_bytes == 8192 and f.offset < log.stat().st_size
    asked.clear()
    r = f.poll()
    assert asked[1:] == [10016 - 16 - 8192] and f.offset == log.stat().st_size


def test_the_rate_is_over_the_window_only(tmp_path) -> None:
    """_rate: the base is the latest sample at or before the window's start once one is that
    old, and the oldest sample while none is (the walk for it is skipped then)."""
    log = tmp_path / "job.log"
    log.write_bytes(b"")
    clock = FakeClock(monotonic=1000.0)
    probe = LogProbe(log, clock=clock, rate_window_s=10.0)
    done = 0
    for t in range(30):
        done += 1 if t < 15 else 5  # a slow start, then five times the pace
        with open(log, "ab") as f:
            f.write(f"step {done}/100000\n".encode())
        o = probe.collect()
        if t == 8:  # the first sample (t=0) is still inside the window: from it
            assert o.rate_per_s == pytest.approx((9 - 1) / 8)
        clock.advance(1.0)
    assert o.rate_per_s == pytest.approx(5.0)  # the last 10 s only, not the slow start
