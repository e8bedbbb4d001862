"""What a torchrun rank is said to do (features_job._rank_trouble) when it holds an output open,
half-written, and sleeps: the words must not hang on one sample catching tqdm's monitor thread
(it wakes every 10 s for microseconds) runnable. The torchrun demo's "half-written" summary
depended on that (tests/test_demo.py::test_demo_torchrun_hang)."""

from __future__ import annotations

from stallwatch.engine.features_job import SPIN_MIN_S, WOKE_MAX_CPU_S, _rank_trouble
from stallwatch.probes.processes_obs import OpenFileObs, ProcessObs, ThreadObs
from stallwatch.probes.runqueue import RunQueueObs

PID = 479
CKPT = "/data/hs/rows_0-2000/data_304.ckpt"


def _thread(tid: int, state: str, cpu_delta_s: float | None, runnable_for_s: float = 0.0) -> ThreadObs:
    asleep = state == "S"
    return ThreadObs(
        tid=tid, comm="python", state=state, state_since_s=0.0 if not asleep else 30.0,
        d_state_for_s=0.0, ctx_unchanged_for_s=30.0 if asleep else 0.0,
        voluntary_ctxt_switches=10, nonvoluntary_ctxt_switches=1, utime_s=1.0, stime_s=0.1,
        cpu_delta_s=cpu_delta_s, wchan="futex_wait_queue" if asleep else None,
        syscall="futex" if asleep else None, last_ran_age_s=30.0 if asleep else 0.0,
        runqueue=RunQueueObs(runnable_for_s=runnable_for_s, samples=2 if runnable_for_s else 0,
                             cpu_share=None, wait_share=None, user_share=None))


def _rank(*threads: ThreadObs, cpu_util: float = 0.0) -> ProcessObs:
    return ProcessObs(
        pid=PID, ppid=472, pgid=472, sid=472, uid=1000, role="descendant", start_ticks=1,
        start_time=1.7e9, comm="python", argv=("python",), cmdline="python", cwd="/data",
        state="S", state_since_s=30.0, d_state_for_s=0.0, ctx_unchanged_for_s=0.0,
        tracked_for_s=60.0, wchan="futex_wait_queue", voluntary_ctxt_switches=10,
        nonvoluntary_ctxt_switches=1, utime_s=1.0, stime_s=0.1, cpu_delta_s=0.0,
        cpu_util=cpu_util, blkio_delay_s=None, rss_bytes=1 << 30, num_threads=len(threads),
        io=None, io_unchanged_for_s=30.0, num_fds=20,
        open_files=(OpenFileObs(fd=14, path=CKPT, write=True, pos_bytes=9998),), threads=threads)


def test_every_thread_asleep_says_so_as_before() -> None:
    score, what = _rank_trouble(_rank(_thread(PID, "S", 0.0), _thread(PID + 1, "S", 0.0)), "/x.log", 0.0)
    assert (score, what) == (3, f"holds {CKPT} open for writing, half-written (9998 bytes), and "
                                "every thread sleeps (2 in futex waits: a lock or a condition)")


def test_a_timer_thread_caught_runnable_for_a_moment_does_not_change_the_diagnosis() -> None:
    monitor = _thread(PID + 2, "R", 0.0002)  # tqdm's TMonitor, woken at this sample
    score, what = _rank_trouble(_rank(_thread(PID, "S", 0.0), _thread(PID + 1, "S", 0.0), monitor),
                                "/x.log", 0.0)
    assert score == 3
    assert what == (f"holds {CKPT} open for writing, half-written (9998 bytes), and every thread "
                    "sleeps (2 in futex waits: a lock or a condition), but for 1 woken for a "
                    "moment (a timer thread, like tqdm's monitor)")


def test_a_thread_that_works_or_spins_is_no_timer() -> None:
    asleep = _thread(PID, "S", 0.0)
    working = _thread(PID + 2, "R", 10 * WOKE_MAX_CPU_S)  # CPU since the last tick: work
    spinning = _thread(PID + 3, "R", 0.0, runnable_for_s=SPIN_MIN_S)  # never left the run queue
    first_sight = _thread(PID + 4, "R", None)  # nothing known yet: not called a timer
    for t in (working, spinning, first_sight):
        assert _rank_trouble(_rank(asleep, t), "/x.log", 0.0)[0] != 3, t
    # and a process whose only thread is runnable is not "every thread sleeps", however briefly
    assert _rank_trouble(_rank(_thread(PID, "R", 0.0)), "/x.log", 0.0) == (0, "")
