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
