"""Parts of the variables kept from the last tick (features.py, features_job, features_io: the
job, the server and client without a server, the disks' static parts, the probes' statuses,
the states and process list) are exactly what a fresh build makes — same values, same types
(1 is not 1.0 is not True here), same key order — whatever came before: on the recorded golden
traces (every tick a new object, equal or not), on ticks that hand on the same observations
(as the collector does), and in an order no live daemon sees."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest

from stallwatch.engine import features as feat
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.trace import read_trace

TRACES = sorted((Path(__file__).parent / "data" / "traces").glob("*.jsonl"))


@functools.cache
def _snaps(path: Path) -> list[Snapshot]:
    _header, rows, _events = read_trace(path)
    return [Snapshot.model_validate({k: v for k, v in r.items() if k != "type"}) for r in rows]


def _fresh(snap: Snapshot) -> str:
    feat.forget()
    return repr(feat.features(snap))


def _check(snaps: list[Snapshot]) -> list[str]:
    """features() of each in turn, with what it kept, against a build that kept nothing."""
    feat.forget()
    kept = [repr(feat.features(s)) for s in snaps]
    return [f"tick {i}" for i, (s, k) in enumerate(zip(snaps, kept, strict=True)) if k != _fresh(s)]


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.stem)
def test_a_trace_replayed_with_what_was_kept_reads_as_built_afresh(trace: Path) -> None:
    snaps = _snaps(trace)
    assert len(snaps) > 5
    assert _check(snaps) == []
    # and shuffled: a part kept from any tick, not only the one before, must not leak
    mixed = snaps[:]
    random.Random(7).shuffle(mixed)
    assert _check(mixed) == []


def test_ticks_that_hand_on_the_same_observations_read_as_built_afresh() -> None:
    """The collector hands on an observation that did not change as the same object: a new
    snapshot around the same parts (new times only) takes the kept paths, and a part swapped in
    from another tick must be seen."""
    for trace in TRACES:
        snaps = _snaps(trace)
        seq: list[Snapshot] = []
        for i, s in enumerate(snaps):
            seq.append(s)
            seq.append(s.model_copy(update={"t_wall": s.t_wall + 0.5, "t_mono": s.t_mono + 0.5}))
            other = snaps[(i * 7 + 3) % len(snaps)]
            seq.append(s.model_copy(update={"processes": other.processes, "disks": other.disks}))
        assert _check(seq) == [], trace.stem


def test_kept_parts_are_handed_on_as_the_same_objects() -> None:
    """What the rules may compare by identity first: a part that did not change is the same
    object as last tick's (the server's and client's without a server, the disks' paths, the
    job, the probes' statuses)."""
    snaps = _snaps(next(p for p in TRACES if p.stem == "healthy"))
    feat.forget()
    a = feat.features(snaps[5])
    b = feat.features(snaps[5].model_copy(update={"t_wall": snaps[5].t_wall + 1.0}))
    for part in ("server", "client", "job", "probes", "probe_errors"):
        assert b[part] is a[part], part
    assert b["disk"]["paths"] is a["disk"]["paths"] and b["proc"]["list"] is a["proc"]["list"]
    assert b["disk"] is not a["disk"] and b["log"] is not a["log"]  # rebuilt every tick


def _healthy() -> Snapshot:
    return _snaps(next(p for p in TRACES if p.stem == "healthy"))[5]


def _with_process(snap: Snapshot, **update: object) -> Snapshot:
    po = snap.processes
    assert po is not None and po.processes
    first = po.processes[0].model_copy(update=update)
    return snap.model_copy(update={"processes": po.model_copy(
        update={"processes": (first, *po.processes[1:])})})


def test_a_change_the_kept_parts_read_is_seen_on_the_next_tick() -> None:
    s = _healthy()
    # the job stopped (SIGSTOP), its exit code readable as a zombie, its name changed
    seq = [s, _with_process(s, state="T"), s, _with_process(s, state="Z", exit_code=-9),
           _with_process(s, comm="renamed"), s]
    assert _check(seq) == []
    feat.forget()
    assert [feat.features(x)["job"]["stopped"] for x in seq[:3]] == [False, True, False]
    # the threads' states counted in another first-seen order: another dict, another text
    po = s.processes
    assert po is not None
    p = po.processes[0]
    t = p.threads[0]
    ab = (t.model_copy(update={"tid": 1, "state": "S"}), t.model_copy(update={"tid": 2, "state": "R"}))
    seq = [_with_process(s, threads=ab), _with_process(s, threads=ab[::-1])]
    assert _check(seq) == []
    feat.forget()
    assert [feat.features(x)["proc"]["states_text"] for x in seq] == ["1 S, 1 R", "1 R, 1 S"]


def test_a_disk_path_going_stuck_with_the_same_words_is_seen() -> None:
    from stallwatch.probes.base import ProbeStatus

    s = _healthy()
    d = s.disks
    assert d is not None and d.paths
    stuck = d.paths[0].model_copy(update={"status": ProbeStatus.busy, "stuck_for_s": 4.0})
    seq = [s, s.model_copy(update={"disks": d.model_copy(update={"paths": (stuck, *d.paths[1:])})}), s]
    assert _check(seq) == []
    feat.forget()
    assert [feat.features(x)["disk"]["stuck"] for x in seq] == [False, True, False]


def test_features_in_several_threads_at_once_read_as_built_afresh() -> None:
    """features() runs in several threads at once where traces are replayed side by side
    (tests/test_specforge_live.py evaluates each scenario's trace in its own thread): what one
    thread kept must never be handed to another. The switch interval is made tiny so that the
    threads interleave between a memo's check and its read (a list changed in place there
    handed one thread another's job, disks or threshold)."""
    import sys
    import threading

    traces = [_snaps(t) for t in TRACES]
    want = [[_fresh(s) for s in snaps] for snaps in traces]
    feat.forget()
    got: list[list[str]] = [[] for _ in traces]
    start = threading.Barrier(len(traces))

    def replay(i: int) -> None:
        start.wait()
        try:
            for _ in range(3):
                got[i] = [repr(feat.features(s)) for s in traces[i]]
        except Exception as e:  # noqa: BLE001 - a memo torn between threads may raise: reported
            got[i] = [f"raised {e!r}"]

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=replay, args=(i,)) for i in range(len(traces))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    bad = [(TRACES[i].stem, next((j, g[:200]) for j, g in enumerate(got[i]) if j >= len(want[i]) or g != want[i][j]))
           for i in range(len(traces)) if got[i] != want[i]]
    assert bad == []
