"""The job's threads as variables (features_job._proc), read straight from each process's threads
(no (process, thread) pair made for each of a wide job's thousand): every thread of every process
counted, in first-seen order; the D threads longest-quiet first; the main thread the target's."""

from __future__ import annotations

from stallwatch.engine.features_job import _proc
from stallwatch.probes.processes_obs import ProcessObs, ThreadObs


def _thread(tid: int, state: str, quiet_s: float = 0.0, *, d_s: float = 0.0) -> ThreadObs:
    return ThreadObs.model_construct(
        tid=tid, comm=f"t{tid}", state=state, state_since_s=1.0, d_state_for_s=d_s,
        ctx_unchanged_for_s=quiet_s, last_ran_age_s=None, wchan="wait" if state != "R" else None,
        syscall=None, syscall_file=None, stack=None, runqueue=None)


def _process(pid: int, role: str, threads: list[ThreadObs]) -> ProcessObs:
    return ProcessObs.model_construct(
        pid=pid, ppid=1, role=role, comm=f"p{pid}", state=threads[0].state, threads=tuple(threads),
        launcher=False, io_unchanged_for_s=None, cpu_util=None, tracked_for_s=5.0,
        ctx_unchanged_for_s=0.0, last_ran_age_s=None, rss_bytes=None, wchan=None,
        num_threads=len(threads))


def test_every_thread_of_every_process_counted_in_first_seen_order() -> None:
    procs = [_process(10, "target", [_thread(10, "S"), _thread(11, "D", 3.0, d_s=3.0),
                                     _thread(12, "S")]),
             _process(20, "descendant", [_thread(20, "R"), _thread(21, "D", 7.0, d_s=7.0),
                                         _thread(22, "S")])]
    v = _proc(procs)
    assert v["states"] == {"S": 3, "D": 2, "R": 1} and list(v["states"]) == ["S", "D", "R"]
    assert (v["threads"], v["count"], v["running"], v["d_threads"]) == (6, 2, 1, 2)
    assert v["states_text"] == "3 S, 2 D, 1 R"
    # the D thread quiet longest is the one named, then the list longest-quiet first
    assert (v["d"]["pid"], v["d"]["tid"], v["d_max_s"], v["d_quiet_s"]) == (20, 21, 7.0, 7.0)
    assert [(d["pid"], d["tid"]) for d in v["d_list"]] == [(20, 21), (10, 11)]
    assert (v["main"]["pid"], v["main"]["tid"]) == (10, 10)
    assert v["spinning"] == 0 and v["spin_list"] == []


def test_no_target_thread_and_no_thread_at_all() -> None:
    v = _proc([_process(30, "descendant", [_thread(31, "S")])])
    assert v["main"]["tid"] == -1 and v["d"]["tid"] == -1 and v["threads"] == 1
    v = _proc([])
    assert (v["threads"], v["states"], v["states_text"], v["d_list"]) == (0, {}, "", [])
