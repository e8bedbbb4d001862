"""One frozen record per tick of everything the probes saw, with each probe's status and cost.

The observation fields of `Snapshot` are the one table of probes: each names the probe that
fills it (`ProbeName`); the collector runs its probes and fills the snapshot from `PROBE_FIELDS`,
derived from them. A probe's name (its report, the rules' `probes` map, the
metrics' `probe` label) and its field (the snapshot's JSON key) are both public
(docs/contract.md); they are one word except `kmsg`, whose field is `kernel`.
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

from stallwatch.model import Frozen
from stallwatch.probes.base import ProbeReport, ProbeStatus
from stallwatch.probes.disks import DisksObs
from stallwatch.probes.gpu import GpuObs
from stallwatch.probes.kmsg import KmsgObs
from stallwatch.probes.log import LogObs
from stallwatch.probes.outputs import OutputsObs
from stallwatch.probes.processes import ProcessesObs
from stallwatch.probes.server import ServerObs
from stallwatch.probes.server_log import ServerLogObs
from stallwatch.probes.targets import Target


class ProbeName(NamedTuple):
    """Field metadata: the name of the probe whose observation the field holds."""

    name: str


class Snapshot(Frozen):
    t_mono: float  # the injected clock's monotonic seconds: what rule timelines use
    t_wall: float  # Unix seconds, for people
    host: str
    target: Target
    probes: tuple[ProbeReport, ...] = ()
    tick_duration_s: float = 0.0
    processes: Annotated[ProcessesObs | None, ProbeName("processes")] = None
    gpu: Annotated[GpuObs | None, ProbeName("gpu")] = None
    log: Annotated[LogObs | None, ProbeName("log")] = None
    outputs: Annotated[OutputsObs | None, ProbeName("outputs")] = None
    disks: Annotated[DisksObs | None, ProbeName("disks")] = None
    server: Annotated[ServerObs | None, ProbeName("server")] = None
    kernel: Annotated[KmsgObs | None, ProbeName("kmsg")] = None
    # the tree listening on the server's port
    server_processes: Annotated[ProcessesObs | None, ProbeName("server_processes")] = None
    server_log: Annotated[ServerLogObs | None, ProbeName("server_log")] = None  # the server's own log

    def probe(self, name: str) -> ProbeReport | None:
        return next((p for p in self.probes if p.name == name), None)

    def probe_ok(self, name: str) -> bool:
        p = self.probe(name)
        return p is not None and p.status == ProbeStatus.ok


# probe name -> Snapshot field
PROBE_FIELDS: dict[str, str] = {
    meta.name: field for field, info in Snapshot.model_fields.items()
    for meta in info.metadata if isinstance(meta, ProbeName)}
