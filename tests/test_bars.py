"""Per-rank tqdm bars in one log (stallwatch/probes/text/bars.py, LogProbe) on real captures.

tests/fixtures/specforge/*.log are the stdout+stderr of `torchrun --nproc_per_node 3
tests/jobs/specforge_job.py --num-samples 60 --batch-size 4 --batch-s 0.1` with real tqdm 4.x:
healthy (a NaN sample skipped), rank 1 deadlocked at batch 2 (killed by `timeout`), rank 2
crashed at batch 2. Each rank draws `Generating Hidden States` at position = its DP rank.
"""

from __future__ import annotations

from pathlib import Path

from stallwatch.probes.text.bars import MultiBars, cursor_ups
from stallwatch.clock import FakeClock
from stallwatch.probes.log import LogProbe
from stallwatch.probes.text.progress import parse_tqdm
from stallwatch.probes.torchrun import RootCauseTracker, parse_environ, rank_info, is_launcher

FIX = Path(__file__).parent / "fixtures" / "specforge"


def probe_of(name: str, tmp_path: Path) -> LogProbe:
    log = tmp_path / name
    log.write_bytes((FIX / name).read_bytes())
    return LogProbe(log, clock=FakeClock())


def test_healthy_three_bars_are_followed_apart_and_complete_only_with_the_closing_lines(tmp_path) -> None:
    obs = probe_of("healthy_3ranks.log", tmp_path).collect()
    bs = obs.bars
    assert bs is not None and [b.position for b in bs.bars] == [0, 1, 2]
    assert all(b.done == b.total == 5 and b.complete for b in bs.bars)
    assert [b.samples for b in bs.bars] == [20, 20, 20]
    assert bs.closing_lines == 3 and bs.complete
    # the job's progress is the sum, samples from the postfix
    assert (obs.progress.done, obs.progress.total) == (15, 15)
    assert obs.progress.postfix == {"samples": 60}


def test_the_stuck_rank_is_the_open_bar_the_others_closed(tmp_path) -> None:
    obs = probe_of("deadlock_rank1.log", tmp_path).collect()
    bars = {b.position: b for b in obs.bars.bars}
    assert bars[0].complete and bars[2].complete
    assert not bars[1].complete and bars[1].done == 2 and bars[1].samples == 8
    assert obs.bars.closing_lines == 2 and not obs.bars.complete
    assert obs.progress.done == 12 and obs.progress.total == 15


def test_crash_summary_names_the_first_failed_rank(tmp_path) -> None:
    obs = probe_of("crash_rank2.log", tmp_path).collect()
    rc = obs.root_cause
    assert rc is not None and (rc.rank, rc.local_rank, rc.exit_code) == (2, 2, 1) and rc.pid > 0
    assert not obs.bars.complete


def test_the_partial_log_never_completes_with_the_fastest_rank(tmp_path) -> None:
    """Fed a growing log, the job is complete only at the very end, and `done` never drops."""
    data = (FIX / "healthy_3ranks.log").read_bytes()
    log = tmp_path / "grow.log"
    log.write_bytes(b"")
    clock = FakeClock()
    probe = LogProbe(log, clock=clock)
    probe.collect()
    last, completes = -1.0, []
    third = data.index(b"Generation loop finished", data.index(b"Generation loop finished",
                       data.index(b"Generation loop finished") + 1) + 1)
    for i in range(0, len(data), 97):
        with open(log, "ab") as f:
            f.write(data[i:i + 97])
        clock.advance(0.5)
        obs = probe.collect()
        if obs.progress is not None:
            assert obs.progress.done >= last
            last = obs.progress.done
        completes.append((i + 97, bool(obs.bars and obs.bars.complete)))
    assert completes[-1][1]
    assert not any(c for end, c in completes if end <= third)  # not before the last rank's line


def test_cursor_ups_and_position_attribution() -> None:
    assert cursor_ups("Generating Hidden States:  40%|####| 2/5 [00:00<00:00]\x1b[A\x1b[A") == 2
    assert cursor_ups("plain line") == 0
    bars = MultiBars()
    line = ("Generating Hidden States:  40%|####      | {n}/5 "
            "[00:01<00:01,  2.00it/s, processed={p}, skipped=0, pending_io=0]")
    def ev(n: int):
        return parse_tqdm(line.format(n=n, p=4 * n))

    assert bars.feed(ev(1), 1, False, 0.0) and bars.feed(ev(2), 0, False, 1.0)
    assert not bars.feed(ev(1), 1, False, 2.0)  # same count at position 1: no move
    assert not bars.feed(ev(0), 0, False, 3.0)  # backwards: another rank's redraw cut off
    # a bar at its total ended by "\n" with no escapes: a close, given to the bar nearest its end
    bars.feed(ev(4), 1, False, 4.0)
    bars.feed(ev(5), 0, True, 5.0)
    obs = bars.observe(6.0)
    assert [(b.position, b.complete) for b in obs.bars] == [(0, False), (1, True)]


def test_torchrun_environment_and_launcher() -> None:
    env = parse_environ(b"PATH=/bin\0RANK=2\0LOCAL_RANK=2\0WORLD_SIZE=3\0SECRET=x\0")
    assert env == {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "3"}
    info = rank_info(env)
    assert (info.rank, info.local_rank, info.world_size) == (2, 2, 3)
    assert rank_info({"RANK": "two"}) is None and rank_info({}) is None
    assert rank_info({"RANK": "9" * 40}) is None  # forged: not a number we keep
    assert is_launcher("pt_elastic", ())
    assert is_launcher("python3", ("python3", "-m", "torch.distributed.run", "x.py"))
    assert is_launcher("python3", ("/venv/bin/python3", "/venv/bin/torchrun", "x.py"))
    assert not is_launcher("python3", ("python3", "train.py", "--torchrun"))


def test_root_cause_needs_its_header() -> None:
    t = RootCauseTracker()
    t.feed("  rank      : 1 (local_rank: 1)")
    t.feed("  exitcode  : 1 (pid: 42)")
    assert t.current is None
    for line in ("Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
                 "  exitcode  : -9 (pid: 42)"):
        t.feed(line)
    assert (t.current.rank, t.current.exit_code, t.current.pid) == (1, -9, 42)


def test_a_ghost_position_from_interleaved_writes_does_not_hold_the_run_open(tmp_path) -> None:
    """nan_ghost_3ranks.log: a full CI run's log of the NaN scenario (3 ranks, tqdm 4.x) in which
    one redraw of rank 2's bar at 2/10 picked up another rank's cursor-up and read as position 3.
    Drawn once, it is dropped once the three real bars closed: the run completes, and its done
    and total are the three ranks' (30 of 30), not 32 of 40."""
    probe = probe_of("nan_ghost_3ranks.log", tmp_path)
    obs = probe.collect()
    bs = obs.bars
    assert bs is not None
    assert [(b.position, b.done, b.complete) for b in bs.bars] == [(0, 10, True), (1, 10, True),
                                                                   (2, 10, True)]
    assert bs.complete and bs.closing_lines == 3
    assert obs.progress is not None
    assert (obs.progress.done, obs.progress.total) == (30, 30)


def test_a_bar_drawn_once_stays_in_view_while_another_is_open() -> None:
    bars = MultiBars()
    line = ("Generating Hidden States:  40%|####      | {n}/5 "
            "[00:01<00:01,  2.00it/s, processed={p}, skipped=0, pending_io=0]")

    def ev(n: int):
        return parse_tqdm(line.format(n=n, p=4 * n))

    bars.feed(ev(0), 0, False, 0.0)
    bars.feed(ev(0), 1, False, 0.0)  # drawn once: a rank stuck right after its first draw
    bars.feed(ev(3), 0, False, 1.0)
    assert [b.position for b in bars.observe(2.0).bars] == [0, 1]
