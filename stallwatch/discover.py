"""Finding the job when the user names nothing: the processes that hold GPU memory.

Zero-config diagnosis starts from what an expert starts from, `nvidia-smi`: whoever holds GPU
memory is the pipeline. Their trees and the logs they write follow from the probes.
"""

from __future__ import annotations

from stallwatch.errors import UsageError
from stallwatch.probes.gpu import GpuProbe, gpu_pids
from stallwatch.targets import Target


def discover(target: Target, gpu_probe: GpuProbe | None = None) -> Target:
    probe = gpu_probe or GpuProbe()
    obs = probe.collect()
    pids = sorted(gpu_pids(obs))
    if not pids:
        why = "no GPU process found" if obs.status == "ok" else f"NVML: {obs.status}"
        raise UsageError(f"no target given and {why}: name the job with --pid PID or --match REGEX")
    return target.model_copy(update={"pids": tuple(pids), "name": "gpu-processes"})
