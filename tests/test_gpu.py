"""GPU probe and NVML choke point.

Two sources of truth: the real pynvml on this GPU-less machine (no library / no driver must be a
state), and FakeNvml (tests/fakes.py), a small double of the pynvml module kept honest: pynvml's
real constants, exception classes, ctypes structures and return shapes, and only the events that
were registered. tests/gpu_live_check.py checks the same probe against a real GPU.
"""

from __future__ import annotations

import ctypes
import threading
import time

import pynvml
import pytest

from stallwatch.clock import FakeClock
from stallwatch.kernel.nvml import NA, Nvml, Outcome, default_nvml
from stallwatch.probes.gpu import GpuObs, GpuProbe, decode_clock_reasons, gpu_pids

from fakes import GiB, FakeGpu, FakeNvml

def four_gpus() -> FakeNvml:
    ecc = {(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): 2,
           (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC): 5,
           (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC): 3,
           (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC): 70}
    busy = FakeGpu(
        uuid="GPU-aaaa", name=b"NVIDIA H200", util=(97, 41),
        mem=(141 * GiB, 40 * GiB, 100 * GiB, 1 * GiB),
        compute=[(100, 30 * GiB, 0xFFFFFFFF, 0xFFFFFFFF), (101, None, 0xFFFFFFFF, 0xFFFFFFFF)],
        graphics=[(100, 30 * GiB, 0xFFFFFFFF, 0xFFFFFFFF)],  # a compute+graphics process
        clocks=pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonHwSlowdown,
        ecc=ecc, temp=61, power_mw=650_123, pstate=0,
        samples=[(100, 1_000, 50, 10), (100, 2_000, 88, 20), (999, 1_500, 5, 1)],
        pcie_kb=(1000, 2000),
    )
    no_ecc_no_perm = FakeGpu(
        uuid="GPU-bbbb", bus_id=b"00000000:2A:00.0", util=(0, 0),
        persistence=pynvml.NVML_FEATURE_DISABLED, pstate=pynvml.NVML_PSTATE_UNKNOWN,
        clocks=pynvml.nvmlClocksThrottleReasonBoardLimit | 0x100000,
        events=0,  # no Xid events on this one
        fail={"nvmlDeviceGetComputeRunningProcesses_v3": pynvml.NVML_ERROR_NO_PERMISSION,
              "nvmlDeviceGetGraphicsRunningProcesses_v3": pynvml.NVML_ERROR_NO_PERMISSION,
              # an older driver: only the deprecated spellings exist
              "nvmlDeviceGetCurrentClocksEventReasons": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
              "nvmlDeviceGetTemperatureV": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND},
    )
    soon_lost = FakeGpu(uuid="GPU-cccc", bus_id=b"00000000:3B:00.0",
                        compute=[(300, 2 * GiB, 1, 0), (300, 3 * GiB, 2, 0)])  # MIG: two instances
    no_handle = FakeGpu(uuid="GPU-dddd")
    lib = FakeNvml([busy, no_ecc_no_perm, soon_lost, no_handle])
    lib.handle_fail[3] = pynvml.NVML_ERROR_GPU_IS_LOST
    return lib


def probe_for(lib, clock=None, **kw) -> GpuProbe:
    clock = clock or FakeClock()
    return GpuProbe(nvml=Nvml(lib=lib, clock=clock), clock=clock, **kw)


# ---------------------------------------------------------------------------------------------
# (1) the real pynvml on this machine


def _libnvml_loads() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return False


def test_real_pynvml_without_gpu_is_a_state_not_an_exception():
    expected = "no_driver" if _libnvml_loads() else "no_library"
    nv = Nvml(lib=pynvml)
    probe = GpuProbe(nvml=nv)
    obs = probe.collect()
    assert obs.status == expected, obs.error
    assert obs.devices == [] and obs.error and "nvmlInit" in obs.error
    assert probe.collect().status == expected  # the retry window: no exception the second time
    assert nv.query("nvmlDeviceGetCount", default=-1) == -1
    assert nv.call("nvmlDeviceGetCount").reason == expected
    assert GpuObs.model_validate_json(obs.model_dump_json()) == obs


def test_module_level_query_and_default_probe():
    assert default_nvml().query("nvmlDeviceGetCount") is NA
    assert default_nvml().query("nvmlDeviceGetCount", default=0) == 0
    assert not NA and repr(NA) == "N/A"
    assert GpuProbe().collect().status in ("no_library", "no_driver")


def test_pynvml_not_installed(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import raises ImportError
    obs = GpuProbe(nvml=Nvml()).collect()
    assert obs.status == "no_library" and "not installed" in obs.error


# ---------------------------------------------------------------------------------------------
# (2) every decoding path, through the double


def test_four_gpus_decode():
    lib = four_gpus()
    obs = probe_for(lib).collect()
    assert obs.status == "ok" and obs.error is None
    assert (obs.driver_version, obs.nvml_version, obs.cuda_driver_version) == (
        "580.159.04", "13.580.159.04", "13.0")
    assert obs.device_count == 4 and [d.index for d in obs.devices] == [0, 1, 2, 3]
    busy, nope, mig, gone = obs.devices

    assert (busy.uuid, busy.name, busy.pci_bus_id) == ("GPU-aaaa", "NVIDIA H200", "00000000:19:00.0")
    assert (busy.util_gpu_pct, busy.util_mem_pct) == (97, 41)
    assert (busy.mem_total_bytes, busy.mem_used_bytes, busy.mem_free_bytes, busy.mem_reserved_bytes) == (
        141 * GiB, 40 * GiB, 100 * GiB, 1 * GiB)
    assert [(p.pid, p.kind, p.used_bytes) for p in busy.processes] == [
        (100, "compute+graphics", 30 * GiB), (101, "compute", None)]
    assert busy.persistence_mode is True
    assert busy.clock_event_reasons == ["hw_slowdown", "sw_thermal"]
    assert (busy.ecc_volatile_uncorrected, busy.ecc_volatile_corrected,
            busy.ecc_aggregate_uncorrected, busy.ecc_aggregate_corrected) == (2, 5, 3, 70)
    assert (busy.temperature_c, busy.power_w, busy.pstate) == (61, 650.123, 0)
    # slow path on the first tick: latest sample per pid, joined to the processes listed
    assert (busy.processes[0].sm_util_pct, busy.processes[0].mem_util_pct) == (88, 20)
    assert busy.processes[1].sm_util_pct is None
    assert (busy.pcie_tx_bytes_per_s, busy.pcie_rx_bytes_per_s) == (1000 * 1024, 2000 * 1024)
    assert busy.slow_sampled_at == obs.collected_at
    assert busy.event_types == ["xid", "ecc_double_bit", "ecc_single_bit"]
    assert busy.errors == {} and busy.lost is False

    assert nope.processes is None  # NoPermission: unknown, not "no processes"
    assert nope.errors["processes_compute"] == "no_permission"
    assert nope.errors["processes_graphics"] == "no_permission"
    assert nope.ecc_volatile_uncorrected is None and nope.ecc_aggregate_corrected is None
    assert nope.errors["ecc_volatile"] == nope.errors["ecc_aggregate"] == "not_supported"
    assert nope.clock_event_reasons == ["board_limit", "unknown_0x100000"]  # via ThrottleReasons
    assert nope.temperature_c == 40  # via the deprecated nvmlDeviceGetTemperature
    assert nope.persistence_mode is False and nope.pstate is None
    assert nope.mem_reserved_bytes == 0 and nope.lost is False
    assert nope.event_types == []

    assert [(p.pid, p.used_bytes) for p in mig.processes] == [(300, 5 * GiB)]  # MIG instances add
    assert gone.lost is True and gone.errors == {"handle": "gpu_lost"} and gone.uuid is None

    assert obs.xid_watch == "on" and obs.xid_events == []
    assert gpu_pids(obs) == {100: [(0, 30 * GiB)], 101: [(0, None)], 300: [(2, 5 * GiB)]}
    assert GpuObs.model_validate_json(obs.model_dump_json()) == obs


def test_gpu_falls_off_the_bus_and_xid_events_are_drained():
    lib = four_gpus()
    clock = FakeClock()
    probe = probe_for(lib, clock)
    probe.collect()
    # GPU 2 falls off the bus: the driver reports Xid 79, then every call answers GpuIsLost.
    lib.gpus[2].fail["*"] = pynvml.NVML_ERROR_GPU_IS_LOST
    lib.queue_event(2, pynvml.nvmlEventTypeXidCriticalError, 79)
    lib.queue_event(0, pynvml.nvmlEventTypeDoubleBitEccError)
    lib.queue_event(0, pynvml.nvmlEventTypePState)  # not registered: NVML would not deliver it
    clock.advance(1)
    obs = probe.collect()
    lost = obs.devices[2]
    assert lost.lost is True and lost.uuid == "GPU-cccc"  # identity read before it was lost
    assert lost.errors == {"utilization": "gpu_lost"}  # and nothing asked after that
    assert lost.processes is None and lost.util_gpu_pct is None
    assert [(e.seq, e.gpu_index, e.gpu_uuid, e.kind, e.xid) for e in obs.xid_events] == [
        (1, 2, "GPU-cccc", "xid", 79), (2, 0, "GPU-aaaa", "ecc_double_bit", None)]
    assert obs.xid_events[0].wall_time == clock.time()
    assert obs.xid_events_total == 2
    # Seen once, kept in the ring; nothing new next tick.
    clock.advance(1)
    again = probe.collect()
    assert again.xid_events == obs.xid_events and again.xid_events_total == 2


def test_event_from_an_unregistered_handle_is_mapped_by_index():
    lib = four_gpus()
    probe = probe_for(lib)
    probe.collect()
    probe._by_handle.clear()  # as if the pointer values did not match
    lib.queue_event(0, pynvml.nvmlEventTypeXidCriticalError, 48)
    obs = probe.collect()
    assert [(e.gpu_index, e.xid) for e in obs.xid_events] == [(0, 48)]


def test_event_ring_keeps_the_last_n():
    lib = four_gpus()
    probe = probe_for(lib, keep_events=2)
    probe.collect()
    for xid in (13, 31, 43):
        lib.queue_event(0, pynvml.nvmlEventTypeXidCriticalError, xid)
    obs = probe.collect()
    assert [(e.seq, e.xid) for e in obs.xid_events] == [(2, 31), (3, 43)]
    assert obs.xid_events_total == 3


def test_xid_watch_off_reasons():
    lib = FakeNvml([FakeGpu(uuid="GPU-1", events=0)])
    assert probe_for(lib).collect().xid_watch == "off: not_supported"
    denied = {"nvmlDeviceRegisterEvents": pynvml.NVML_ERROR_NO_PERMISSION}
    lib = FakeNvml([FakeGpu(uuid="GPU-1", fail=denied)])
    obs = probe_for(lib).collect()
    assert obs.xid_watch == "off: no_permission" and obs.devices[0].event_types == []


@pytest.mark.parametrize("reason_code,lost", [
    (pynvml.NVML_ERROR_GPU_IS_LOST, True),
    (pynvml.NVML_ERROR_UNKNOWN, True),
    (pynvml.NVML_ERROR_RESET_REQUIRED, True),
    (pynvml.NVML_ERROR_NO_PERMISSION, False),
])
def test_lost_from_a_core_call(reason_code, lost):
    lib = FakeNvml([FakeGpu(uuid="GPU-1", fail={"nvmlDeviceGetUtilizationRates": reason_code})])
    dev = probe_for(lib).collect().devices[0]
    assert dev.lost is lost
    assert (dev.mem_total_bytes is None) is lost  # a lost GPU is not asked anything more


def test_unknown_on_a_side_counter_does_not_mean_lost():
    lib = FakeNvml([FakeGpu(uuid="GPU-1", fail={"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_UNKNOWN})])
    dev = probe_for(lib).collect().devices[0]
    assert dev.lost is False and dev.errors["power"] == "unknown" and dev.temperature_c == 40


def _function_not_found(*args):
    raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # what pynvml raises then


def test_old_driver_falls_back_to_older_spellings():
    gpu = FakeGpu(uuid="GPU-1", compute=[(7, GiB, 0, 0)], mem=(10 * GiB, 2 * GiB, 8 * GiB, 0), fail={
        "nvmlDeviceGetComputeRunningProcesses_v3": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        "nvmlDeviceGetGraphicsRunningProcesses_v3": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    })
    lib = FakeNvml([gpu])
    del lib.nvmlMemory_v2  # a pynvml from before memory info v2
    lib.nvmlSystemGetCudaDriverVersion_v2 = _function_not_found  # a driver without the _v2 symbol
    lib.nvmlSystemGetCudaDriverVersion = lambda: 12080
    obs = probe_for(lib).collect()
    assert obs.cuda_driver_version == "12.8"
    dev = obs.devices[0]
    assert [(p.pid, p.used_bytes) for p in dev.processes] == [(7, GiB)]
    assert (dev.mem_used_bytes, dev.mem_reserved_bytes) == (2 * GiB, None)


def test_call_first_resolves_the_spelling_once_and_logs_the_fallback_once(caplog):
    lib = FakeNvml([FakeGpu(uuid="GPU-1", compute=[(7, GiB, 0, 0)], fail={
        "nvmlDeviceGetComputeRunningProcesses_v3": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})])
    nv = Nvml(lib=lib)
    assert nv.init() == "ok"
    handle = lib.nvmlDeviceGetHandleByIndex(0)
    names = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
    with caplog.at_level("INFO", logger="stallwatch.kernel.nvml"):
        for _ in range(3):
            out = nv.call_first(names, handle)
            assert out.ok and [p.pid for p in out.value] == [7]
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1  # asked once, then not
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 3
    fallbacks = [r.getMessage() for r in caplog.records if "_v3" in r.getMessage()]
    assert fallbacks == ["NVML: nvmlDeviceGetComputeRunningProcesses_v3 is not in this pynvml or "
                         "driver; using nvmlDeviceGetComputeRunningProcesses_v2"]
    nv.shutdown()  # a new session may meet another driver: resolved again
    lib.gpus[0].fail.clear()
    assert nv.call_first(names, handle).ok
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 2


def test_processes_stay_unknown_when_no_spelling_exists():
    fail = {f"nvmlDevice{verb}RunningProcesses{v}": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
            for verb in ("GetCompute", "GetGraphics") for v in ("_v3", "_v2")}
    lib = FakeNvml([FakeGpu(uuid="GPU-1", compute=[(7, GiB, 0, 0)], fail=fail)])
    clock = FakeClock()
    probe = probe_for(lib, clock)
    for _ in range(2):  # the second tick answers from the cache of permanent failures
        dev = probe.collect().devices[0]
        clock.advance(1)
        assert dev.processes is None
        assert dev.errors["processes_compute"] in ("function_not_found", "missing_in_pynvml")


def test_permanent_not_supported_is_not_asked_again():
    lib = four_gpus()
    clock = FakeClock()
    probe = probe_for(lib, clock)
    probe.collect()
    n = lib.calls["nvmlDeviceGetTotalEccErrors"]
    clock.advance(1)
    obs = probe.collect()
    # GPU 0 answers 4 counters every tick; GPU 1 (not supported) was asked once per counter type.
    assert lib.calls["nvmlDeviceGetTotalEccErrors"] - n == 4
    assert obs.devices[1].errors["ecc_volatile"] == "not_supported"


def test_slow_path_cadence():
    lib = four_gpus()
    clock = FakeClock()
    probe = probe_for(lib, clock, slow_every_s=10.0)
    first = probe.collect()
    assert lib.calls["nvmlDeviceGetPcieThroughput"] == 2 * 3  # tx+rx on the 3 reachable GPUs
    lib.gpus[0].pcie_kb = (5, 6)
    clock.advance(5)
    mid = probe.collect()
    assert lib.calls["nvmlDeviceGetPcieThroughput"] == 6
    assert mid.devices[0].pcie_tx_bytes_per_s == 1000 * 1024  # carried, with its own timestamp
    assert mid.devices[0].slow_sampled_at == first.collected_at
    assert mid.devices[0].processes[0].sm_util_pct == 88
    # No new per-process samples since the last one: util is unknown, not stale.
    clock.advance(5)
    late = probe.collect()
    assert late.devices[0].pcie_tx_bytes_per_s == 5 * 1024
    assert late.devices[0].slow_sampled_at == late.collected_at
    assert late.devices[0].processes[0].sm_util_pct is None
    assert "process_utilization" not in late.devices[0].errors  # NotFound = no samples, not an error
    # Only samples newer than the last seen are asked for.
    lib.gpus[0].samples.append((100, 3_000, 0, 0))
    clock.advance(10)
    assert probe.collect().devices[0].processes[0].sm_util_pct == 0


def test_slow_path_in_background_never_holds_up_a_tick():
    """PCIe throughput takes ~20 ms per call on an H200 (NVML samples over a window): with
    slow_in_background the tick returns while the slow call is still in the driver, and the
    sample shows up on a later tick, with its own timestamp."""
    lib = four_gpus()
    entered, release = threading.Event(), threading.Event()
    orig = lib.nvmlDeviceGetPcieThroughput
    calls = []

    def slow_pcie(handle, counter):
        calls.append(counter)
        entered.set()
        assert release.wait(30)
        return orig(handle, counter)

    lib.nvmlDeviceGetPcieThroughput = slow_pcie
    clock = FakeClock()
    probe = probe_for(lib, clock, slow_every_s=10.0, slow_in_background=True)
    try:
        first = probe.collect()  # returns although the slow thread is blocked in the driver
        assert entered.wait(30)
        assert first.devices[0].util_gpu_pct is not None
        assert first.devices[0].pcie_tx_bytes_per_s is None and first.devices[0].slow_sampled_at is None
        clock.advance(10)
        probe.collect()  # due again, but the last sample has not returned: no second thread
        assert [t.name for t in threading.enumerate()].count("gpu-slow") == 1
        release.set()
        probe._slow_thread.join(30)
        assert not probe._slow_thread.is_alive()
        later = probe.collect()
        assert later.devices[0].pcie_tx_bytes_per_s == 1000 * 1024
        assert later.devices[0].slow_sampled_at == first.collected_at
        assert later.devices[0].processes[0].sm_util_pct == 88
    finally:
        release.set()


def test_slow_path_can_be_disabled():
    lib = four_gpus()
    obs = probe_for(lib, slow_every_s=float("inf")).collect()
    assert "nvmlDeviceGetPcieThroughput" not in lib.calls
    assert obs.devices[0].pcie_tx_bytes_per_s is None and obs.devices[0].slow_sampled_at is None


def test_device_count_failure_is_a_status():
    lib = four_gpus()
    lib.fail_count = pynvml.NVML_ERROR_UNKNOWN
    obs = probe_for(lib).collect()
    assert obs.status == "error" and obs.error == "nvmlDeviceGetCount: unknown"
    assert obs.driver_version == "580.159.04"


_DEVICE_FNS = [n for n, v in vars(FakeNvml).items() if n.startswith("nvmlDevice") and callable(v)
               and n not in ("nvmlDeviceGetHandleByIndex", "nvmlDeviceRegisterEvents")]
_FAILURES = [getattr(pynvml, n) for n in dir(pynvml) if n.startswith("NVML_ERROR_")] + [
    RuntimeError("boom"), TypeError("bad argument"), ctypes.ArgumentError("wrong type"),
    pynvml.NVMLLibraryMismatchError("unversioned function"),
]


def test_choke_point_never_lets_an_exception_out():
    for fn in _DEVICE_FNS + ["nvmlDeviceRegisterEvents", "*"]:
        for failure in _FAILURES:
            lib = four_gpus()
            for g in lib.gpus:
                g.fail[fn] = failure
            lib.queue_event(0, pynvml.nvmlEventTypeXidCriticalError, 79)
            clock = FakeClock()
            probe = probe_for(lib, clock, slow_every_s=0.0)
            for _ in range(2):
                obs = probe.collect()
                clock.advance(1)
                assert obs.status == "ok", (fn, failure, obs.error)
                assert len(obs.devices) == 4
                GpuObs.model_validate_json(obs.model_dump_json())


def test_choke_point_maps_errors_to_reasons():
    nv = Nvml(lib=four_gpus())
    assert nv.init() == "ok"

    def raising(e):
        def f():
            raise e
        return f

    for code, reason in [(pynvml.NVML_ERROR_NOT_SUPPORTED, "not_supported"),
                         (pynvml.NVML_ERROR_NO_PERMISSION, "no_permission"),
                         (pynvml.NVML_ERROR_NOT_FOUND, "not_found"),
                         (pynvml.NVML_ERROR_GPU_IS_LOST, "gpu_lost"),
                         (pynvml.NVML_ERROR_UNKNOWN, "unknown"),
                         (pynvml.NVML_ERROR_TIMEOUT, "timeout"),
                         (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, "function_not_found"),
                         (pynvml.NVML_ERROR_IN_USE, f"nvml_error_{pynvml.NVML_ERROR_IN_USE}")]:
        out = nv.call(raising(pynvml.NVMLError(code)))
        assert (out.value, out.reason) == (NA, reason)
        assert nv.query(raising(pynvml.NVMLError(code)), default=None) is None
    assert nv.call(raising(ValueError("x"))).reason == "error"
    assert nv.call("nvmlNoSuchFunction").reason == "missing_in_pynvml"
    assert nv.call(lambda: b"bytes").value == "bytes"


@pytest.mark.parametrize("code,status", [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "no_library"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "no_driver"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "no_permission"),
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "error"),
    (pynvml.NVML_ERROR_UNKNOWN, "error"),
])
def test_init_failures_are_states(code, status):
    lib = four_gpus()
    lib.init_error = code
    obs = probe_for(lib).collect()
    assert obs.status == status and obs.devices == [] and obs.error.startswith("nvmlInit: NVMLError_")


def test_failed_init_is_retried_after_a_while():
    lib = four_gpus()
    lib.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    clock = FakeClock()
    probe = GpuProbe(nvml=Nvml(lib=lib, clock=clock, retry_after_s=60), clock=clock)
    assert probe.collect().status == "no_driver"
    lib.init_error = None  # the driver gets loaded
    clock.advance(30)
    assert probe.collect().status == "no_driver" and lib.init_calls == 1
    clock.advance(31)
    assert probe.collect().status == "ok" and lib.init_calls == 2


def test_init_once_from_many_threads():
    lib = four_gpus()
    nv = Nvml(lib=lib)
    results = []
    threads = [threading.Thread(target=lambda: results.append(nv.init())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["ok"] * 8 and lib.init_calls == 1


def test_wedged_init_does_not_block_other_threads():
    lib = four_gpus()
    lib.init_gate = threading.Event()  # nvmlInit hangs until set
    nv = Nvml(lib=lib, init_wait_s=0.1)
    stuck = threading.Thread(target=nv.init, daemon=True)
    stuck.start()
    while lib.init_calls == 0:
        time.sleep(0.001)
    t0 = time.monotonic()
    obs = GpuProbe(nvml=nv).collect()
    assert time.monotonic() - t0 < 2
    assert obs.status == "error" and "still running" in obs.error
    lib.init_gate.set()
    stuck.join(5)
    assert nv.init() == "ok" and GpuProbe(nvml=nv).collect().status == "ok"


def test_collect_while_a_previous_collect_is_stuck():
    probe = probe_for(four_gpus())
    with probe._lock:
        obs = probe.collect()
    assert obs.status == "error" and "has not returned" in obs.error


def test_pynvml_module_can_be_passed_directly():
    lib = four_gpus()
    assert GpuProbe(nvml=lib).collect().status == "ok"


def test_close_frees_the_event_set():
    lib = four_gpus()
    probe = probe_for(lib)
    probe.collect()
    probe.close()
    assert probe.collect().status == "ok"


def test_decode_clock_reasons_with_real_constants():
    assert decode_clock_reasons(pynvml, 0) == []
    assert decode_clock_reasons(pynvml, pynvml.nvmlClocksEventReasonGpuIdle) == ["gpu_idle"]
    assert decode_clock_reasons(pynvml, 0x8 | 0x40 | 0x80 | 0x4) == [
        "sw_power_cap", "hw_slowdown", "hw_thermal", "hw_power_brake"]
    assert decode_clock_reasons(pynvml, 0x400 | 0x1000) == ["reliability", "unknown_0x1000"]


def test_without_nvml_the_same_observation_is_handed_on_until_a_retry_is_due():
    """No driver and no retry due: collect() returns the very object it returned last (so what
    is built from it downstream can be reused by identity), and says so in unchanged()."""
    lib = four_gpus()
    lib.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    clock = FakeClock()
    probe = GpuProbe(nvml=Nvml(lib=lib, clock=clock, retry_after_s=60), clock=clock)
    assert not probe.unchanged()  # nothing returned yet
    t0_wall = clock.time()
    first = probe.collect()
    clock.advance(30)
    assert probe.unchanged() and probe.collect() is first and lib.init_calls == 1
    assert first.collected_at == t0_wall  # when that answer was given, not this tick's time
    clock.advance(31)  # a retry is due: the probe must run again, and it may answer otherwise
    assert not probe.unchanged()
    lib.init_error = pynvml.NVML_ERROR_NO_PERMISSION
    again = probe.collect()
    assert again is not first and again.status == "no_permission" and again.collected_at == t0_wall + 61
    clock.advance(61)
    lib.init_error = None  # the driver gets loaded: every tick a new observation
    ok = probe.collect()
    assert ok.status == "ok" and not probe.unchanged() and probe.collect() is not ok


# ---------------------------------------------------------------------------------------------
# (3) the fast path's reuse (issue 17): fewer frames and objects, the same answers


def test_reader_returns_values_and_failures_as_call_first_does(caplog):
    lib = FakeNvml([FakeGpu(uuid="GPU-1", name=b"old bytes", compute=[(7, GiB, 0, 0)], fail={
        "nvmlDeviceGetComputeRunningProcesses_v3": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        "nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_NO_PERMISSION})])
    nv = Nvml(lib=lib)
    procs = nv.reader(("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"))
    name, power = nv.reader("nvmlDeviceGetName"), nv.reader("nvmlDeviceGetPowerUsage")
    h = lib.handles[0]
    with caplog.at_level("INFO", logger="stallwatch.kernel.nvml"):
        for _ in range(3):  # the first call initialises the session and resolves the spelling
            assert [p.pid for p in procs(h)] == [7]
            assert name(h) == "old bytes"  # bytes from an older pynvml: str, as call() gives
            out = power(h)
            assert out.__class__ is Outcome and (out.value, out.reason) == (NA, "no_permission")
    assert lib.init_calls == 1
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1  # then the bound _v2 only
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 3
    assert sum("_v3 is not in this pynvml" in r.getMessage() for r in caplog.records) == 1
    # A bound spelling that goes missing falls through to the next one, as call_first does.
    lib.gpus[0].fail = {"nvmlDeviceGetComputeRunningProcesses_v2": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
    assert [p.pid for p in procs(h)] == [7]
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 2
    nv.shutdown()  # a new session may meet another driver: resolved (and initialised) again
    assert [p.pid for p in procs(h)] == [7] and lib.init_calls == 2
    assert nv.reader("nvmlNoSuchFunction")(h).reason == "missing_in_pynvml"
    lib.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    nv.shutdown()
    assert name(h).reason == "no_driver"  # not initialised: a status, never a call
    assert lib.calls["nvmlDeviceGetName"] == 3


def test_reader_lets_no_exception_out():
    nv = Nvml(lib=four_gpus())
    for failure in _FAILURES:
        def f(*args, e=failure):
            raise pynvml.NVMLError(e) if isinstance(e, int) else e
        nv._lib.nvmlDeviceGetPowerUsage = f
        nv._bound.clear()
        read = nv.reader("nvmlDeviceGetPowerUsage")
        for _ in range(2):  # resolving the spelling, then the bound function
            out = read(nv.lib.handles[0])
            assert out.__class__ is Outcome and out.value is NA and out.reason, failure


def test_unchanged_devices_are_handed_on_and_changed_ones_built_anew():
    lib = four_gpus()
    clock = FakeClock()
    probe = probe_for(lib, clock, slow_every_s=10.0)
    first = probe.collect()
    clock.advance(1)
    second = probe.collect()  # not a slow tick: it carries the first tick's slow sample
    clock.advance(1)
    third = probe.collect()
    assert third is not second and third.collected_at == second.collected_at + 1
    # GPU 3 has no handle: asked again every tick, answered anew
    assert [a is b for a, b in zip(second.devices, third.devices, strict=True)] == [True, True, True, False]
    lib.gpus[0].util = (3, 4)
    lib.gpus[2].compute.append((301, GiB, 1, 0))
    clock.advance(1)
    fourth = probe.collect()
    assert [d is e for d, e in zip(third.devices, fourth.devices, strict=True)] == [False, True, False, False]
    assert fourth.devices[0].util_gpu_pct == 3 and fourth.devices[0].processes is third.devices[0].processes
    assert [p.pid for p in fourth.devices[2].processes] == [300, 301]
    clock.advance(10)  # a slow tick: a new sample, new observations
    fifth = probe.collect()
    assert fifth.devices[0] is not fourth.devices[0] and fifth.devices[0].slow_sampled_at == fifth.collected_at
    assert first.devices[0] is second.devices[0]  # the slow sample carried: nothing changed


def test_observations_built_without_validation_are_what_validation_gives():
    """GpuObs and GpuDeviceObs are built from the probe's own typed values (issue 17): each
    field must already have the type validation would give it, in the declared order."""
    lib = four_gpus()
    lib.queue_event(0, pynvml.nvmlEventTypeXidCriticalError, 79)
    probe = probe_for(lib)
    for obs in (probe.collect(), probe.collect()):
        for m in (obs, *obs.devices, *(p for d in obs.devices for p in d.processes or ())):
            again = type(m).model_validate(m.model_dump())
            assert list(m.__dict__) == list(type(m).model_fields)
            assert m.model_dump_json() == again.model_dump_json()
            for k, v in m.__dict__.items():
                assert type(v) is type(getattr(again, k)), (type(m).__name__, k, v)
