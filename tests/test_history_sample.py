"""history.sample builds its Sample without the frozen dataclass's __init__ (issue 17): it must
be the Sample that __init__ would make, field for field, and stay frozen."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from stallwatch.engine.history import Sample, sample


def _procs(*io: tuple[int, int] | None, states: str = "") -> SimpleNamespace:
    ps = [SimpleNamespace(io=None if x is None else SimpleNamespace(read_bytes=x[0], write_bytes=x[1]),
                          state=(states[k] if k < len(states) else "S")) for k, x in enumerate(io)]
    return SimpleNamespace(processes=SimpleNamespace(processes=ps))


CASES = [
    ({"log": {"has_progress": True, "done": 12.0}, "proc": {"cpu_known": True, "cpu_util": 0.25},
      "gpu": {"present": True, "util_mean_pct": 40.0, "job_mem_bytes": 1e9}}, _procs((1, 2), (3, 4))),
    ({"log": {"has_progress": False, "done": 3.0}, "gpu": {"util_mean_pct": -1.0}}, _procs(None)),
    ({"log": {"has_progress": True, "done": float("nan")}}, _procs((5, 6), (7, 8), states="SZ")),
    ({"proc": {"cpu_known": True, "cpu_util": 1}}, _procs((0, 0))),
    ({}, _procs((1, 1), states="X")),
    ({}, None),
]


@pytest.mark.parametrize(("v", "snap"), CASES)
def test_sample_is_what_its_init_makes(v: dict, snap: SimpleNamespace | None) -> None:
    s = sample(1764635000.25, v, snap)
    made = Sample(**{f.name: getattr(s, f.name) for f in dataclasses.fields(Sample)})
    assert s == made and hash(s) == hash(made) and repr(s) == repr(made)
    assert list(vars(s).items()) == list(vars(made).items())  # the same order: doc(), the JSON
    assert json.dumps(s.doc()) == json.dumps(made.doc())
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.done = 1.0  # type: ignore[misc]


def test_sample_io_counts_live_processes_only() -> None:
    assert sample(1.0, {}, _procs((1, 2), (3, 4))).io_bytes == 10.0
    assert sample(1.0, {}, _procs((1, 2), (3, 4), states="SZ")).io_bytes == 3.0
    assert sample(1.0, {}, _procs((0, 0))).io_bytes == 0.0  # known, and zero
    assert sample(1.0, {}, _procs(None, (5, 5), states="SX")).io_bytes is None
    assert sample(1.0, {}, None).io_bytes is None
