"""daemon/gcpolicy.py: the start-up's objects frozen, young collections rarer, cycles still freed.

Run in a child interpreter: the settings are process-wide and must not leak into the test run.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import gc, json
from stallwatch.daemon.gcpolicy import (GEN0_THRESHOLD_ALLOCS, GEN1_EVERY, GEN2_EVERY,
                                        settle_after_start)
kept = [[i] for i in range(20_000)]  # what a start-up leaves (modules, schemas, rules): tracked
frozen = settle_after_start()
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made after the start-up: reference counts alone never free it
del a, b
freed = gc.collect()
young = []
gc.callbacks.append(lambda phase, info: phase == "stop" and young.append(info["generation"]))
held = []
for tick in range(50):  # ticks that each keep 400 containers for a while, as the daemon's do
    held.append([[tick, j] for j in range(400)])
print(json.dumps({"frozen": frozen, "threshold": gc.get_threshold(), "freed": freed,
                  "collections": young,
                  "expected": [GEN0_THRESHOLD_ALLOCS, GEN1_EVERY, GEN2_EVERY]}))
"""


def test_settling_freezes_the_start_up_raises_the_threshold_and_still_frees_cycles() -> None:
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["frozen"] >= 20_000  # the start-up's objects moved out of every collection's walk
    assert list(got["threshold"]) == got["expected"]
    assert got["freed"] >= 2  # the cycle made afterwards was collected
    # 50 ticks of 400 net containers each: 20,000 allocations, two young collections at most
    # (CPython's default 700 would have run ~28), and never a full one.
    assert len(got["collections"]) <= 3 and 2 not in got["collections"], got["collections"]


def test_a_finished_batch_frees_its_observations_without_the_garbage_collector() -> None:
    """With collections rarer, what a tick leaves in a reference cycle lives until a gen-1 or
    full collection: the lane's batch and its calls once referred to each other, and so kept each
    tick's observations (1,025 thread records on the wide job) alive: +47 MiB RSS in 5 minutes."""
    import gc
    import weakref

    from stallwatch.probes.base import DeadlineRunner

    class Obs:
        pass

    runner = DeadlineRunner()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        obs = Obs()
        gone = weakref.ref(obs)
        [(value, report)] = runner.call_many([("processes", lambda o=obs: o, 5.0)])
        assert value is obs and report.status == "ok"
        del obs, value
        runner.call_many([("processes", lambda: None, 5.0)])  # the next tick's call replaces it
        assert gone() is None, gc.get_referrers(gone())
    finally:
        if was_enabled:
            gc.enable()
