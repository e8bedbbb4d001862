"""One frozen record per tick of everything the probes saw, with each probe's status and cost."""

from __future__ import annotations

from stallwatch.model import Frozen
from stallwatch.probes.base import ProbeReport, ProbeStatus
from stallwatch.probes.disks import DisksObs
from stallwatch.probes.gpu import GpuObs
from stallwatch.probes.kmsg import KernelLogObs
from stallwatch.probes.logs import LogObs
from stallwatch.probes.outputs import OutputsObs
from stallwatch.probes.processes import ProcessesObs
from stallwatch.probes.server import ServerObs
from stallwatch.probes.server_log import ServerLogObs
from stallwatch.probes.targets import Target


class Snapshot(Frozen):
    t_mono: float  # the injected clock's monotonic seconds: what rule timelines use
    t_wall: float  # Unix seconds, for people
    host: str
    target: Target
    probes: tuple[ProbeReport, ...] = ()
    tick_duration_s: float = 0.0
    processes: ProcessesObs | None = None
    gpu: GpuObs | None = None
    log: LogObs | None = None
    outputs: OutputsObs | None = None
    disks: DisksObs | None = None
    server: ServerObs | None = None
    kernel: KernelLogObs | None = None
    server_processes: ProcessesObs | None = None  # the tree listening on the server's port
    server_log: ServerLogObs | None = None  # the server's own log

    def probe(self, name: str) -> ProbeReport | None:
        return next((p for p in self.probes if p.name == name), None)

    def probe_ok(self, name: str) -> bool:
        p = self.probe(name)
        return p is not None and p.status == ProbeStatus.ok
