"""gpu_fault is about the pipeline's GPUs: on a shared node, another tenant's Xid, lost GPU or
ECC error is counted in `gpu.faults_elsewhere`, not in what the gpu_fault rule reads. The job
is a real process (a sleeping child, in the snapshot through the real processes probe; the probe
never watches its own process)."""

from __future__ import annotations

import subprocess
import time

import pytest

from stallwatch.engine.diagnose import load
from stallwatch.engine import Evaluator
from stallwatch.engine.features import features
from stallwatch.kernel.kmsgparse import EventKind, KernelEvent
from stallwatch.probes.base import ProbeStatus
from stallwatch.probes.gpu import GpuDeviceObs, GpuObs, GpuProcessObs, XidEventObs
from stallwatch.probes.kmsg import KmsgObs
from stallwatch.probes.processes import ProcessesProbe
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.targets import Target

PID = 0


@pytest.fixture(autouse=True)
def job():
    global PID
    p = subprocess.Popen(["sleep", "600"])
    PID = p.pid
    yield p
    p.kill()
    p.wait()


def node(job_on: tuple[int, ...], xid_on: int | None = None, lost: tuple[int, ...] = (),
         kernel_pci: str | None = None) -> Snapshot:
    now = time.time()
    devs = [GpuDeviceObs(index=i, pci_bus_id=f"00000000:{0x18 + i:02X}:00.0", lost=i in lost,
                         util_gpu_pct=0,
                         processes=[GpuProcessObs(pid=PID if i in job_on else 99_000 + i, gpu_index=i,
                                                  kind="compute", used_bytes=1 << 30)])
            for i in range(8)]
    xids = [XidEventObs(seq=1, gpu_index=xid_on, kind="xid", xid=79, wall_time=now)] if xid_on is not None else []
    kernel = KmsgObs(status=ProbeStatus.ok, source="fixture", events=tuple(
        [KernelEvent(kind=EventKind.gpu_xid, seq=3, kernel_usec=1, xid=79, pci=kernel_pci,
                     message=f"NVRM: Xid (PCI:{kernel_pci}): 79, GPU has fallen off the bus.")]
        if kernel_pci else []))
    target = Target(name="extract", pids=(PID,))
    return Snapshot(t_mono=1000.0, t_wall=now, host="test", target=target,
                    processes=ProcessesProbe(target).collect(),
                    gpu=GpuObs(status="ok", device_count=8, devices=devs, xid_events=xids,
                               xid_events_total=len(xids)),
                    kernel=kernel)


def verdict(snap: Snapshot) -> str:
    return Evaluator(load()).evaluate(features(snap), snap.t_mono).verdict.kind


def test_an_xid_on_another_tenants_gpu_is_not_the_jobs_gpu_fault():
    v = features(node(job_on=(0, 1), xid_on=5, lost=(6,), kernel_pci="0000:1f:00"))
    assert v["gpu"]["pipeline_gpus"] == [0, 1]
    assert v["gpu"]["xid_recent"] == [] and v["gpu"]["lost"] == [] and v["kernel"]["xid"] == []
    assert v["gpu"]["faults_elsewhere"] == 2.0  # the NVML Xid on 5 and lost GPU 6
    assert verdict(node(job_on=(0, 1), xid_on=5)) != "gpu_fault"


def test_an_xid_on_the_jobs_gpu_is_a_gpu_fault():
    snap = node(job_on=(0, 1), xid_on=1)
    assert features(snap)["gpu"]["xid_recent"][0]["gpu"] == 1
    assert verdict(snap) == "gpu_fault"
    # the kernel's line names GPU 0 by its PCI bus id (NVML: 00000000:18:00.0)
    snap = node(job_on=(0, 1), kernel_pci="0000:18:00")
    assert len(features(snap)["kernel"]["xid"]) == 1 and verdict(snap) == "gpu_fault"


def test_when_the_pipelines_gpus_are_unknown_every_gpu_counts():
    snap = node(job_on=(), xid_on=5)
    v = features(snap)
    assert v["gpu"]["pipeline_gpus"] == list(range(8)) and v["gpu"]["faults_elsewhere"] == 0.0
    assert verdict(snap) == "gpu_fault"


def test_gpu_variables_of_a_handed_on_observation_are_reused_and_equal_a_fresh_build():
    """Without NVML the probe hands on one GpuObs: its variables are built once (by identity),
    and equal what a fresh build of the same snapshot gives; a new observation is built anew."""
    import os

    from stallwatch.engine import features_gpu
    from stallwatch.engine.features import features
    from stallwatch.probes.gpu import GpuObs
    from stallwatch.probes.snapshot import Snapshot
    from stallwatch.probes.targets import Target

    absent = GpuObs(status="no_library", error="pynvml: not here", collected_at=1.0)
    snaps = [Snapshot(t_mono=t, t_wall=1e9 + t, host="h", target=Target(pids=(os.getpid(),)),
                      gpu=absent) for t in (1.0, 2.0)]
    first, second = (features(s)["gpu"] for s in snaps)
    assert second is first and first["status"] == "no_library" and not first["present"]
    assert first == features_gpu._gpu_vars(snaps[1], {os.getpid()}, None)
    other = features(snaps[1].model_copy(update={"gpu": absent.model_copy()}))["gpu"]
    assert other is not first and other == first


def test_gpu_variables_stand_while_the_devices_are_the_same_objects():
    """With NVML each tick's GpuObs is new, but the probe hands on unchanged devices (issue 17):
    the variables are reused while the devices, the job's pids and the pipeline's GPUs are the
    same, and equal a fresh build; a changed device, another job or an Xid builds them anew."""
    from stallwatch.engine import features_gpu

    base = node(job_on=(0, 1))
    devs = list(base.gpu.devices)

    def tick(devices, xids=(), t=1.0, **kw):
        gpu = base.gpu.model_copy(update={"devices": list(devices), "xid_events": list(xids),
                                          "collected_at": t})
        return base.model_copy(update={"gpu": gpu, "t_wall": base.t_wall + t, **kw})

    a, b = tick(devs, t=1.0), tick(devs, t=2.0)
    first, second = features(a)["gpu"], features(b)["gpu"]
    assert second is first and first["job_gpus"] == [0, 1]
    assert first == features_gpu._gpu_vars(b, {PID}, {0, 1})
    busier = devs[0].model_copy(update={"util_gpu_pct": 99})
    changed = features(tick([busier, *devs[1:]], t=3.0))["gpu"]
    assert changed is not first and changed["util_max_pct"] == 99
    again = features(tick([busier, *devs[1:]], t=4.0))["gpu"]
    assert again is changed
    other_job = features_gpu._gpu(tick([busier, *devs[1:]], t=5.0), {12345}, None)
    assert other_job is not changed and other_job["job_gpus"] == []
    xid = XidEventObs(seq=1, gpu_index=0, kind="xid", xid=79, wall_time=base.t_wall)
    with_xid = features(tick([busier, *devs[1:]], xids=[xid], t=6.0))["gpu"]
    assert with_xid["xid_recent"] == [{"gpu": 0, "xid": 79, "kind": "xid"}]
