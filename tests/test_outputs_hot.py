"""The outputs probe's per-tick shortcuts (issue 17): hot files looked at only where due, and
the root's real path reused only while it still names the root's directory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from stallwatch.clock import FakeClock
from stallwatch.probes import outputs as outputs_mod


@pytest.mark.parametrize("few_open", [0, 8])  # fresh ones found walking _hot, or looked up
def test_hot_files_go_slow_then_cold_and_a_stale_one_is_still_seen_growing(
        tmp_path: Path, monkeypatch, few_open: int) -> None:
    out = tmp_path / "out"
    out.mkdir()
    clock = FakeClock(monotonic=1000.0, wall=time.time())
    # No inotify: what changes is seen through the hot re-stats alone (no reconcile runs).
    probe = outputs_mod.OutputsProbe(out, clock=clock, use_inotify=False, reconcile_every_s=1e9,
                                     poll_every_s=1e9, hot_window_s=30.0)
    probe.FEW_OPEN = few_open
    stats: list[str] = []
    real = outputs_mod.os.lstat
    monkeypatch.setattr(outputs_mod.os, "lstat",
                        lambda p, *a, **kw: stats.append(os.path.basename(p)) or real(p, *a, **kw))
    try:
        probe.collect()
        for i in range(3):
            (out / f"f{i}.bin").write_bytes(b"x")
        probe._walk([""], clock.monotonic(), True, set())  # found, as a reconcile would: hot
        assert probe.collect().hot_files == 3
        stats.clear()
        clock.advance(1.0)
        probe.collect()
        assert sorted(s for s in stats if s.startswith("f")) == ["f0.bin", "f1.bin", "f2.bin"]
        # Quiet past HOT_FRESH_S: re-stat'ed once every HOT_SLOW_EVERY_S, not every tick.
        clock.advance(outputs_mod.HOT_FRESH_S)
        probe.collect()
        stats.clear()
        for _ in range(int(outputs_mod.HOT_SLOW_EVERY_S) - 1):
            clock.advance(1.0)
            probe.collect()
        assert [s for s in stats if s.startswith("f")] == [], stats
        with open(out / "f1.bin", "ab") as f:  # grows in place: no directory change
            f.write(b"y" * 9)
        clock.advance(1.0)
        o = probe.collect()
        assert o.total_bytes == 12 and stats.count("f1.bin") == 1, stats
        # Past the hot window the still ones are cold: no re-stat at all.
        clock.advance(31.0)
        o = probe.collect()
        assert o.hot_files == 0
        stats.clear()
        clock.advance(outputs_mod.HOT_SLOW_EVERY_S)
        probe.collect()
        assert [s for s in stats if s.startswith("f")] == []
    finally:
        probe.close()


def test_a_symlinked_root_pointed_elsewhere_is_resolved_afresh(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "one.bin").write_bytes(b"1")
    for n in range(2):
        (b / f"{n}.bin").write_bytes(b"22")
    link = tmp_path / "out"
    link.symlink_to(a)
    clock = FakeClock(monotonic=1000.0, wall=time.time())
    probe = outputs_mod.OutputsProbe(link, clock=clock, use_inotify=False)
    try:
        o = probe.collect()
        assert (o.file_count, probe._base) == (1, str(a))
        tmp = tmp_path / "out.new"
        tmp.symlink_to(b)
        os.replace(tmp, link)  # the user re-points the root
        clock.advance(1.0)
        o = probe.collect()
        assert (o.file_count, o.total_bytes, probe._base) == (2, 4, str(b))
        # The old real path turned into a link to the new target: not reused (a link).
        a.rename(tmp_path / "a.old")
        a.symlink_to(b)
        os.replace(tmp_path / "a.old", tmp_path / "gone")
        link.unlink()
        link.symlink_to(a)
        clock.advance(1.0)
        o = probe.collect()
        assert (o.file_count, probe._base) == (2, str(b))
    finally:
        probe.close()


def test_a_closed_file_is_left_alone_until_opened_again(tmp_path: Path, monkeypatch) -> None:
    """With inotify: a hot file closed after writing is re-stat'ed every HOT_CLOSED_EVERY_S only;
    opened again (IN_OPEN), it is looked at that tick (an O_TRUNC open changed it already) and
    at the hot cadence again while it is written, no close needed."""
    out = tmp_path / "out"
    out.mkdir()
    clock = FakeClock(monotonic=1000.0, wall=time.time())
    probe = outputs_mod.OutputsProbe(out, clock=clock, reconcile_every_s=1e9, hot_window_s=120.0)
    stats: list[str] = []
    real = outputs_mod.os.lstat
    monkeypatch.setattr(outputs_mod.os, "lstat",
                        lambda p, *a, **kw: stats.append(os.path.basename(p)) or real(p, *a, **kw))
    try:
        assert probe.collect().watch_mode == "inotify"
        (out / "a.bin").write_bytes(b"x" * 10)  # created, written, closed: as a job writes
        clock.advance(1.0)
        assert probe.collect().total_bytes == 10
        stats.clear()
        for _ in range(int(outputs_mod.HOT_CLOSED_EVERY_S) - 2):  # fresh and slow cadences pass
            clock.advance(1.0)
            probe.collect()
        assert "a.bin" not in stats, stats
        clock.advance(2.0)
        probe.collect()
        assert stats.count("a.bin") == 1, stats  # the closed cadence
        f = open(out / "a.bin", "r+b")  # noqa: SIM115 - held open across ticks; opened again, O_TRUNC-free: nothing changed yet
        try:
            clock.advance(1.0)
            stats.clear()
            assert probe.collect().total_bytes == 10 and stats.count("a.bin") == 1
            f.seek(0, os.SEEK_END)
            f.write(b"y" * 5)
            f.flush()  # still open: no IN_CLOSE_WRITE
            clock.advance(outputs_mod.HOT_SLOW_EVERY_S)
            assert probe.collect().total_bytes == 15
            clock.advance(1.0)  # changed: fresh, so every tick
            f.write(b"z")
            f.flush()
            assert probe.collect().total_bytes == 16
        finally:
            f.close()
        clock.advance(1.0)
        probe.collect()
        stats.clear()
        with open(out / "a.bin", "wb"):  # opened with O_TRUNC and held open: 0 bytes at once
            clock.advance(1.0)
            o = probe.collect()
            assert o.total_bytes == 0 and stats.count("a.bin") == 1, (o.total_bytes, stats)
    finally:
        probe.close()


def test_the_unvalidated_observation_equals_its_validation(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    clock = FakeClock(monotonic=1000, wall=time.time())  # ints: the fields are floats still
    probe = outputs_mod.OutputsProbe(out, clock=clock)
    try:
        probe.collect()
        for i in range(3):
            (out / "sub" / f"{i}.pt").write_bytes(b"x" * i)
        clock.advance(1)
        o = probe.collect()
        assert o.recent and o.newest is not None and o.last_change_age_s is not None
        v = outputs_mod.OutputsObs.model_validate(o.model_dump())
        assert o == v and o.model_dump_json() == v.model_dump_json() and repr(o) == repr(v)
        gone = outputs_mod.OutputsProbe(tmp_path / "nope", clock=clock).collect()
        assert gone == outputs_mod.OutputsObs.model_validate(gone.model_dump())
    finally:
        probe.close()
