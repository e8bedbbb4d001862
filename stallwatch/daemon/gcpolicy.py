"""The daemon's garbage-collector settings, set once its start-up is done (issue 17).

Each tick makes and drops thousands of small objects (a record per thread of the job, the rules'
contexts); almost all are freed by their reference counts, yet CPython's default gen-0 threshold
(700 allocations) runs a young collection several times a tick, and every tenth of those promotes
into older generations whose collections walk every object the daemon keeps: the imported
modules, pydantic's schemas, the compiled rules. Measured with `gc.callbacks` on a daemon
watching the wide job (8 x 128 threads): 2.5-4.6 ms of a 16-21 ms tick in the collector, a full
collection of 40-80 ms about every 30 s (a tick p99 on its own); 0.5 ms of a 6 ms tick, and a
23 ms full collection in a minute, on the standard job.

So, once the start-up objects exist: they are collected once and frozen (`gc.freeze()`: moved to
a permanent generation no collection walks; they live as long as the daemon), and the gen-0
threshold is raised so a young collection runs every few ticks, not several times in one.
Cyclic garbage is still collected, later; reference-counted objects are freed as before.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("stallwatch.daemon")

# Container allocations (minus frees) between young collections. Measured net per tick: ~400 on
# the standard job, ~2,600 on the wide one; so one young collection every 25 ticks, or 4, instead
# of every 2 ticks, or 4 a tick.
GEN0_THRESHOLD_ALLOCS = 10_000
# Young collections per gen-1 collection, and gen-1 per full: CPython's own 10 and 10. What the
# start-up made is frozen, so a full walk covers only what the daemon made since (the thread
# memos of a wide job, caches): one every 100 young collections, ~7 minutes apart on the wide
# job. Rarer ones would let garbage caught in a reference cycle live that much longer.
GEN1_EVERY = 10
GEN2_EVERY = 10


def settle_after_start() -> int:
    """Collect and freeze what the start-up made, and raise the thresholds; the count frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD_ALLOCS, GEN1_EVERY, GEN2_EVERY)
    frozen = gc.get_freeze_count()
    log.info("garbage collector: %d start-up objects frozen, young collections every %d "
             "allocations", frozen, GEN0_THRESHOLD_ALLOCS)
    return frozen
