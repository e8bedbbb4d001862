"""The probe lane's batches (probes/base.py): each call runs exactly once, whoever takes it (the
lane or a worker of a hand-out racing it), and the batch is done when, and only when, the last
call ended. Calls are taken without a lock (deque.popleft, an itertools.count for the ends):
these tests race the two takers for real."""

from __future__ import annotations

import threading
from collections import Counter

from stallwatch.clock import SYSTEM_CLOCK
from stallwatch.probes.base import Call, DeadlineRunner, Lane, ProbeStatus

WAIT_S = 30.0  # generous: a loaded machine; the healthy path ends in milliseconds


def test_a_hand_out_racing_the_lane_runs_each_call_once() -> None:
    lane = Lane("lane7-race-", SYSTEM_CLOCK, idle_s=5.0)
    runs: Counter[str] = Counter()
    lock = threading.Lock()

    def work(name: str):
        def fn() -> str:
            with lock:
                runs[name] += 1
            return name
        return fn

    for i in range(200):
        calls = [Call(f"c{i}-{k}", work(f"c{i}-{k}")) for k in range(5)]
        batch = lane.start(calls)
        lane.hand_out(batch)  # at once: the workers and the lane take calls side by side
        assert batch.wait(WAIT_S), f"batch {i} never ended"
        assert batch.done()
        assert all(c.done and c.value == c.name and c.batch is None for c in calls)
        assert batch.lane_in is None
    assert len(runs) == 1000 and set(runs.values()) == {1}


def test_not_done_until_the_last_call_ends() -> None:
    lane = Lane("lane7-last-", SYSTEM_CLOCK, idle_s=5.0)
    release = threading.Event()
    calls = [Call("quick", lambda: 1), Call("held", lambda: release.wait(WAIT_S))]
    batch = lane.start(calls)
    assert not batch.wait(0.2)  # the held call keeps it open
    assert calls[0].done and not calls[1].done and not batch.done()
    assert not batch.wait_for([calls[1]], 0.1)
    release.set()
    assert batch.wait_for([calls[1]], WAIT_S)
    assert batch.wait(WAIT_S) and batch.done()


def test_a_stuck_call_is_a_timeout_then_busy_never_a_hung_caller() -> None:
    runner = DeadlineRunner(SYSTEM_CLOCK)
    release = threading.Event()
    try:
        got = runner.call_many([("stuck", lambda: release.wait(WAIT_S), 0.3),
                                ("after", lambda: "ok", 0.3)])
        assert got[0][1].status == ProbeStatus.timeout
        # handed out of the stuck lane: the call behind it still ends in time
        assert got[1] == ("ok", got[1][1]) and got[1][1].status == ProbeStatus.ok
        again = runner.call_many([("stuck", lambda: "never", 0.3), ("after", lambda: "ok", 0.3)])
        assert again[0][1].status == ProbeStatus.busy and again[1][0] == "ok"
    finally:
        release.set()
