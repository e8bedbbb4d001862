"""The gpu probe's fast path calls the pynvml functions its readers resolved directly, in its own
`try` (Nvml.direct / Nvml.failed: one Python frame less a read): what it observes is what the
readers' path observes — every value, error reason, unsupported signal, lost GPU and spelling
fallback — when any device function starts failing in any way after the spellings were
resolved, and the direct functions are really the ones called."""

from __future__ import annotations

import ctypes

import pynvml
import pytest

from stallwatch.clock import FakeClock
from stallwatch.kernel.nvml import Nvml
from stallwatch.probes.gpu import GpuProbe

from test_gpu import four_gpus

_FNS = ["nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetPersistenceMode", "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetTemperatureV", "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetPerformanceState", "*"]
_FAILURES = [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_GPU_IS_LOST,
             pynvml.NVML_ERROR_NO_PERMISSION, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
             pynvml.NVML_ERROR_UNKNOWN, RuntimeError("boom"), ctypes.ArgumentError("wrong type"),
             pynvml.NVMLLibraryMismatchError("unversioned function")]


def _run(fn: str, failure: object, direct: bool) -> list[dict]:
    lib = four_gpus()
    clock = FakeClock()
    nv = Nvml(lib=lib, clock=clock)
    if not direct:
        nv.direct = lambda rd: None  # type: ignore[method-assign]  # the readers' path only
    probe = GpuProbe(nvml=nv, clock=clock, slow_every_s=0.0)
    out = []
    for n in range(4):
        if n == 2:  # after the spellings were resolved and the direct functions bound
            for g in lib.gpus[1:3]:
                g.fail[fn] = failure
        if n == 3:
            lib.gpus[1].fail.pop(fn, None)  # one recovers (unless it was told so for good)
        out.append(probe.collect().model_dump(exclude={"collected_at"}))
        clock.advance(1)
    return out


@pytest.mark.parametrize("fn", _FNS)
def test_failures_after_binding_read_as_on_the_readers_path(fn: str) -> None:
    for failure in _FAILURES:
        assert _run(fn, failure, direct=True) == _run(fn, failure, direct=False), (fn, failure)


def test_the_direct_functions_are_the_ones_called() -> None:
    lib = four_gpus()
    clock = FakeClock()
    probe = GpuProbe(nvml=Nvml(lib=lib, clock=clock), clock=clock)
    probe.collect()
    probe.collect()  # the readers resolved on the first collect
    k = probe._k
    assert k is not None
    d = probe._direct_reads(k)
    assert d is not k and d.util == lib.nvmlDeviceGetUtilizationRates  # bound methods: ==
    assert d.procs[0][2] == lib.nvmlDeviceGetComputeRunningProcesses_v3
    # a shutdown unbinds them: the readers again, until resolved anew
    probe.nvml.shutdown()
    assert probe._direct_reads(k) is k
