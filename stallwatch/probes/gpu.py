"""GPU probe: per-device health and who holds GPU memory, from NVML, plus Xid/ECC events.

What a stall diagnosis needs from a GPU: is it computing (utilisation), which pids hold memory
(to join with the process tree: a SIGSTOPped or deadlocked job keeps its memory at 0 % util),
and did the hardware fail (Xid events, ECC counters, a GPU that fell off the bus).

Everything goes through the `Nvml` choke point, so a missing library, missing driver, missing
permission or an unsupported counter shows up as a status or a None field plus a reason in
`errors` — never an exception. Slow calls (per-process utilisation ~2 ms, PCIe throughput
~20 ms each, per GPU) are sampled at most every `slow_every_s` and carried between samples with
their own timestamp. With `slow_in_background` (the collector's choice) they run in a thread of
their own, so no tick waits for them: on an H200 they made every tenth tick 45 ms long.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import Field

from stallwatch.clock import Clock, SYSTEM_CLOCK
from stallwatch.model import Frozen
from stallwatch.kernel.nvml import LOST_REASONS, OK, Nvml, Outcome, default_nvml, describe
from stallwatch.probes.base import ProbeStatus
from stallwatch.probes.processes_obs import built

# ---------------------------------------------------------------------------------------------
# Observations (written to JSONL traces and replayed: plain JSON types only)


class GpuProcessObs(Frozen):
    pid: int  # as NVML sees it: the host pid namespace, which a container may not share
    gpu_index: int
    kind: str  # "compute" | "graphics" | "compute+graphics"
    used_bytes: int | None = None  # None: the driver did not say (WDDM, some MIG/vGPU setups)
    # From the slow path; None when not sampled yet or the pid had no sample in the window
    # (NVML only keeps samples for processes that ran something).
    sm_util_pct: int | None = None
    mem_util_pct: int | None = None


class XidEventObs(Frozen):
    seq: int  # 1, 2, ... per probe: tells a new event from one already seen in the ring
    gpu_index: int | None
    gpu_uuid: str | None = None
    kind: str  # "xid" | "ecc_double_bit" | "ecc_single_bit" | "event_0x.."
    xid: int | None = None  # the Xid code (kind "xid" only)
    wall_time: float  # when we drained it (NVML gives no timestamp); at most a tick late


class GpuDeviceObs(Frozen):
    index: int  # NVML index (PCI order): not CUDA's index; join on uuid or pci_bus_id
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    lost: bool = False  # fell off the bus / needs a reset: every call on it fails
    util_gpu_pct: int | None = None
    util_mem_pct: int | None = None  # memory-controller busy %, not memory used
    mem_total_bytes: int | None = None
    mem_used_bytes: int | None = None
    mem_free_bytes: int | None = None
    mem_reserved_bytes: int | None = None  # driver-reserved (memory info v2 only)
    processes: list[GpuProcessObs] | None = None  # None: could not be listed (see errors)
    persistence_mode: bool | None = None
    clock_event_reasons: list[str] | None = None  # e.g. ["gpu_idle"], ["sw_thermal", ...]
    ecc_volatile_uncorrected: int | None = None  # since the last driver load
    ecc_volatile_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None  # lifetime of the board
    ecc_aggregate_corrected: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    pstate: int | None = None  # 0 (max performance) .. 15; None when unknown
    pcie_tx_bytes_per_s: int | None = None  # slow path
    pcie_rx_bytes_per_s: int | None = None  # slow path
    slow_sampled_at: float | None = None  # wall time of the slow-path values in this obs
    event_types: list[str] = Field(default_factory=list)  # events registered for this device
    errors: dict[str, str] = Field(default_factory=dict)  # signal -> why it has no value


class GpuObs(Frozen):
    status: ProbeStatus  # ok, no_library, no_driver, no_permission, error
    driver_version: str | None = None
    nvml_version: str | None = None
    cuda_driver_version: str | None = None  # e.g. "13.0"
    device_count: int | None = None
    devices: list[GpuDeviceObs] = Field(default_factory=list)
    xid_events: list[XidEventObs] = Field(default_factory=list)  # the last N, oldest first
    xid_events_total: int = 0  # drained since the probe started; rules diff this
    xid_watch: str = "off"  # "on", or "off: <reason>"
    error: str | None = None
    # Wall time of the collect that made this observation. Without NVML the probe hands on the
    # same observation while the answer stays the same (a retry that fails alike included), so
    # this is when that answer was first given, not this tick's time (the snapshot's t_wall is).
    collected_at: float = 0.0


def gpu_pids(obs: GpuObs) -> dict[int, list[tuple[int, int | None]]]:
    """pid -> [(gpu_index, bytes or None)], to join GPU memory with the process tree."""
    out: dict[int, list[tuple[int, int | None]]] = {}
    for dev in obs.devices:
        for p in dev.processes or ():
            out.setdefault(p.pid, []).append((dev.index, p.used_bytes))
    return out


# ---------------------------------------------------------------------------------------------
# Decoding tables, keyed by pynvml's constant names so the values come from the library itself.

# Newer pynvml spells them ClocksEventReason*, older ClocksThrottleReason*; BoardLimit and
# Reliability exist only under the old spelling.
_CLOCK_REASONS = (
    ("GpuIdle", "gpu_idle"),
    ("ApplicationsClocksSetting", "applications_clocks_setting"),
    ("SwPowerCap", "sw_power_cap"),
    ("HwSlowdown", "hw_slowdown"),
    ("SyncBoost", "sync_boost"),
    ("SwThermalSlowdown", "sw_thermal"),
    ("HwThermalSlowdown", "hw_thermal"),
    ("HwPowerBrakeSlowdown", "hw_power_brake"),
    ("DisplayClockSetting", "display_clock_setting"),
    ("BoardLimit", "board_limit"),
    ("Reliability", "reliability"),
)

_EVENTS = (
    ("nvmlEventTypeXidCriticalError", "xid"),
    ("nvmlEventTypeDoubleBitEccError", "ecc_double_bit"),
    ("nvmlEventTypeSingleBitEccError", "ecc_single_bit"),
)

_COMPUTE_PROCS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
                  "nvmlDeviceGetComputeRunningProcesses")
_GRAPHICS_PROCS = ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2",
                   "nvmlDeviceGetGraphicsRunningProcesses")
_CLOCK_FNS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
_TEMP_FNS = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
_WAIT_FNS = ("nvmlEventSetWait_v2", "nvmlEventSetWait")

# A permanent answer: stop asking this device every tick.
_PERMANENT = frozenset({"not_supported", "function_not_found", "missing_in_pynvml"})
# Failures that mean the GPU itself is gone, when they come from a call every GPU answers.
_CORE = frozenset({"handle", "utilization", "memory"})
_MAX_DRAIN = 256  # events per tick; an event storm must not stall the tick
_OK = ProbeStatus.ok


def decode_clock_reasons(lib: Any, mask: int) -> list[str]:
    names, known = [], 0
    for suffix, name in _CLOCK_REASONS:
        bit = getattr(lib, "nvmlClocksEventReason" + suffix, None) or getattr(
            lib, "nvmlClocksThrottleReason" + suffix, None)
        if bit and mask & bit:
            names.append(name)
        known |= bit or 0
    if mask & ~known:
        names.append(f"unknown_{mask & ~known:#x}")
    return names


def _handle_key(h: Any) -> Any:
    # NVML device handles are stable pointers; event data carries the same pointer value.
    try:
        return ctypes.cast(h, ctypes.c_void_p).value
    except Exception:  # noqa: BLE001 - not a ctypes pointer (a test double's handle)
        return id(h)


class _Lost(Exception):
    pass


# An attribute of a pynvml ctypes structure without pynvml's Python-level __getattribute__ (it
# only turns bytes into str): a C call instead of a frame, for the numbers read every tick.
_oga = object.__getattribute__


def _process_obs(rows: list[tuple[str, Any, Any, Any, Any]], i: int) -> list[GpuProcessObs]:
    """(kind, pid, bytes, gpu instance, compute instance) rows of NVML's process lists -> one
    observation per pid. A process with both a compute and a graphics context is listed twice
    with the same figure; under MIG a pid may hold memory in several instances, which add up."""
    seen: dict[tuple[int, Any, Any], list[Any]] = {}
    for kind, pid, used, gi, ci in rows:
        if used is not None and used >= 1 << 63:  # NVML_VALUE_NOT_AVAILABLE in old pynvml
            used = None
        entry = seen.setdefault((int(pid), gi, ci), [set(), None])
        entry[0].add(kind)
        if used is not None:
            entry[1] = used if entry[1] is None else max(entry[1], used)
    by_pid: dict[int, list[Any]] = {}
    for (pid, _gi, _ci), (kinds, used) in seen.items():
        agg = by_pid.setdefault(pid, [set(), None])
        agg[0] |= kinds
        if used is not None:
            agg[1] = used if agg[1] is None else agg[1] + used
    return [GpuProcessObs(pid=pid, gpu_index=i, kind="+".join(sorted(kinds)), used_bytes=used)
            for pid, (kinds, used) in sorted(by_pid.items())]


@dataclass(frozen=True)
class _Bound:
    """The fast path's readers (Nvml.reader) and the library's constants, bound once."""
    count: Any
    wait: Any
    util: Any
    mem: Any
    mem_v2: Any
    procs: tuple[tuple[str, str, Any], ...]  # (kind, errors key, reader)
    pm: Any
    enabled: Any
    clocks: Any
    ecc_read: Any
    ecc: tuple[tuple[str, str, Any, Any], ...]  # (errors key, field, error type, counter type)
    temp: Any
    temp_gpu: Any
    power: Any
    pstate: Any
    clock_names: dict[int, tuple[str, ...]] = field(default_factory=dict)  # mask -> decoded


@dataclass
class _Device:
    handle: Any
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    event_types: list[str] = field(default_factory=list)
    events_error: str | None = None  # why no event could be registered
    unsupported: dict[str, str] = field(default_factory=dict)  # signal -> permanent reason
    proc_util_since_us: int = 0
    slow: dict[str, Any] = field(default_factory=dict)  # last slow-path sample
    # Last tick's, to hand on the same objects while nothing read changed (issue 17):
    # (what was read, the processes, the slow sample, the observation)
    last: tuple[tuple[Any, ...], Any, Any, GpuDeviceObs] | None = None
    procs: tuple[list[Any], list[GpuProcessObs]] | None = None  # (NVML's rows, observations)
    procs_util: tuple[Any, Any, list[GpuProcessObs]] | None = None  # (procs, sample, joined)


# ---------------------------------------------------------------------------------------------


class GpuProbe:
    name = "gpu"

    def __init__(self, nvml: Nvml | Any = None, clock: Clock = SYSTEM_CLOCK,
                 slow_every_s: float = 10.0, keep_events: int = 64,
                 slow_in_background: bool = False) -> None:
        if nvml is None:
            nvml = default_nvml()
        elif not isinstance(nvml, Nvml):
            nvml = Nvml(lib=nvml, clock=clock)  # a pynvml module (or a double of it)
        self.nvml = nvml
        self._clock = clock
        self._slow_every_s = slow_every_s
        self._slow_background = slow_in_background
        self._slow_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._system: dict[str, Any] | None = None
        self._devices: dict[int, _Device] = {}
        self._by_handle: dict[Any, int] = {}
        self._slow_mono: float | None = None
        self._event_set: Any = None
        self._event_set_error: str | None = None
        self._events: deque[XidEventObs] = deque(maxlen=keep_events)
        self._seq = 0
        self._drain_error: str | None = None
        self._last: GpuObs | None = None  # what collect() returned last
        self._readers: dict[str | tuple[str, ...], Any] = {}  # Nvml.reader per function names
        self._k: _Bound | None = None
        self._direct: tuple[int, _Bound, _Bound] | None = None  # (Nvml.generation, k, direct k)
        # Some device has events registered (any; Xid): None until asked for this set of devices.
        self._events_on: bool | None = None
        self._xid_on: bool | None = None

    def cannot_block(self) -> bool:
        """No NVML (no library, no driver) and no retry due: collect() makes no driver call, so
        the collector runs it inline, without a worker-thread handoff (issue 17)."""
        return isinstance(self.nvml, Nvml) and self.nvml.idle() and not self._lock.locked()

    def unchanged(self) -> bool:
        """collect() would return the very observation it returned last (no NVML, no retry due,
        no new event): the collector hands that on without running it at all (issue 17)."""
        # One frame for what cannot_block() and _still() say: asked every tick (issue 17). An
        # Enum member read off its class is a Python-level lookup: _OK is read once.
        last = self._last
        if last is None or last.status is _OK:
            return False
        nv = self.nvml
        return (nv.idle() and not self._lock.locked() and last.status == nv.status
                and last.error == nv.error and last.xid_events_total == self._seq)

    def _still(self, last: GpuObs | None, status: str | None) -> bool:
        """`last` is the answer for NVML's `status` now: a failed init, same reason, no event."""
        return (last is not None and status != OK and last.status == status
                and last.error == self.nvml.error and last.xid_events_total == self._seq)

    def collect(self) -> GpuObs:
        now = self._clock.time()
        # A previous collect stuck in the driver holds the lock; answer rather than queue up.
        if not self._lock.acquire(blocking=False):
            return GpuObs(status=ProbeStatus.error, error="previous GPU collect has not returned",
                          collected_at=now)
        try:
            try:
                obs = self._collect(now)
            except Exception as e:  # noqa: BLE001 - a bug here must not cost the whole snapshot
                obs = GpuObs(status=ProbeStatus.error, error=f"gpu probe: {describe(e)}",
                             collected_at=now)
            self._last = obs
        finally:
            self._lock.release()
        return obs

    def close(self) -> None:
        with self._lock:
            if self._event_set is not None:
                self.nvml.call("nvmlEventSetFree", self._event_set)
            self._event_set, self._devices, self._by_handle = None, {}, {}
            self._events_on = self._xid_on = None

    # -- one tick -------------------------------------------------------------------------------

    def _collect(self, now: float) -> GpuObs:
        nv = self.nvml
        status = OK if nv.status == OK else nv.init()
        if status != OK:
            if (last := self._last) is not None and self._still(last, status):
                return last  # nothing new: the same object, so what is built from it can be reused
            return GpuObs(status=ProbeStatus(status), error=nv.error, collected_at=now,
                          xid_events=list(self._events), xid_events_total=self._seq)
        if self._system is None:
            self._system = self._system_info()
        k = self._k
        if k is None:
            k = self._k = self._bind()
        count = k.count()
        if count.__class__ is Outcome:
            return GpuObs(status=ProbeStatus.error, error=f"nvmlDeviceGetCount: {count.reason}",
                          collected_at=now, **self._system)
        if self._event_set is None and self._event_set_error is None:
            es = nv.call("nvmlEventSetCreate")
            self._event_set, self._event_set_error = es.value if es.ok else None, es.reason
        mono = self._clock.monotonic()
        slow = self._slow_every_s is not None and math.isfinite(self._slow_every_s) and (
            self._slow_mono is None or mono - self._slow_mono >= self._slow_every_s)
        inline = slow and not self._slow_background
        devices = [self._device(i, inline, now, k) for i in range(count)]
        if slow:
            self._slow_mono = mono
            if self._slow_background:
                self._start_slow()
        self._drain(now, k)
        # Unvalidated (probes/processes_obs.built): our own typed values, a 30-field model
        # validated every tick cost more than the NVML calls (issue 17).
        values = {  # every field, in the declared order: built() need not reorder them
            "status": ProbeStatus.ok, **self._system, "device_count": count, "devices": devices,
            "xid_events": list(self._events), "xid_events_total": self._seq,
            "xid_watch": self._xid_watch(), "error": None, "collected_at": now,
        }
        return built(GpuObs, values, set(values))

    def _start_slow(self) -> None:
        t = self._slow_thread
        if t is not None and t.is_alive():
            return  # the last sample is still in the driver: never a second thread behind it
        devs = [d for d in self._devices.values() if d.handle is not None]
        self._slow_thread = threading.Thread(target=self._slow_all, args=(devs,), name="gpu-slow",
                                             daemon=True)
        self._slow_thread.start()

    def _slow_all(self, devs: list[_Device]) -> None:
        for dev in devs:
            try:
                self._slow(dev, {}, self._clock.time())
            except _Lost:
                continue  # the fast path sees a lost GPU on its own, on the next tick
            except Exception as e:  # noqa: BLE001 - a bug here must not end silently either
                dev.slow = {**dev.slow, "errors": {"slow_path": describe(e)}}

    def _system_info(self) -> dict[str, Any]:
        nv = self.nvml
        cuda = nv.call_first(("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"))
        return {
            "driver_version": nv.query("nvmlSystemGetDriverVersion", default=None),
            "nvml_version": nv.query("nvmlSystemGetNVMLVersion", default=None),
            # NVML encodes 13.0 as 13000, 12.8 as 12080.
            "cuda_driver_version": f"{cuda.value // 1000}.{cuda.value % 1000 // 10}" if cuda.ok else None,
        }

    def _xid_watch(self) -> str:
        if self._xid_on is None:  # once per set of devices, not every tick
            self._xid_on = any("xid" in d.event_types for d in self._devices.values())
        if self._xid_on:
            return "on" if self._drain_error is None else f"on (last wait: {self._drain_error})"
        if self._event_set_error:
            return f"off: nvmlEventSetCreate {self._event_set_error}"
        reasons = sorted({d.events_error for d in self._devices.values() if d.events_error})
        return "off: " + (", ".join(reasons) or "no device supports Xid events")

    # -- one device -----------------------------------------------------------------------------

    def _device(self, i: int, slow: bool, now: float, k: _Bound) -> GpuDeviceObs:
        errors: dict[str, str] = {}
        dev = self._devices.get(i)
        if dev is None:
            h = self.nvml.call("nvmlDeviceGetHandleByIndex", i)
            if not h.ok:
                return GpuDeviceObs(index=i, lost=h.reason in LOST_REASONS, errors={"handle": h.failure})
            dev = self._devices[i] = _Device(handle=h.value)
            self._register_events(i, dev)
            self._events_on = self._xid_on = None  # the set of devices changed
        fields: dict[str, Any] = {}
        lost = False
        try:
            if dev.uuid is None or dev.name is None or dev.pci_bus_id is None:
                self._identity(dev, errors)
            self._fast(dev, i, errors, fields, k)
            if slow:
                self._slow(dev, errors, now)
        except _Lost:
            lost = True
        sample = dev.slow  # once: the background slow path may replace it meanwhile
        procs = fields.pop("processes", None)
        if not slow and sample:
            for key, why in sample.get("errors", {}).items():  # the carried sample's gaps
                errors.setdefault(key, why)
        if procs is not None:
            memo = dev.procs_util
            procs = memo[2] if memo is not None and memo[0] is procs and memo[1] is sample else (
                self._with_util(dev, procs, sample))
        # Every value read the same as last tick (an idle GPU, a steady one): the very same
        # observation, so nothing is built for it here or downstream (issue 17).
        key = (lost, dev.uuid, dev.name, dev.pci_bus_id, fields, errors)
        last = dev.last
        if last is not None and last[1] is procs and last[2] is sample and last[0] == key:
            return last[3]
        values = {  # every field, in the declared order (**fields only sets values)
            "index": i, "uuid": dev.uuid, "name": dev.name, "pci_bus_id": dev.pci_bus_id, "lost": lost,
            "util_gpu_pct": None, "util_mem_pct": None, "mem_total_bytes": None,
            "mem_used_bytes": None, "mem_free_bytes": None, "mem_reserved_bytes": None,
            "processes": procs, "persistence_mode": None, "clock_event_reasons": None,
            "ecc_volatile_uncorrected": None, "ecc_volatile_corrected": None,
            "ecc_aggregate_uncorrected": None, "ecc_aggregate_corrected": None,
            "temperature_c": None, "power_w": None, "pstate": None,
            "pcie_tx_bytes_per_s": sample.get("pcie_tx"), "pcie_rx_bytes_per_s": sample.get("pcie_rx"),
            "slow_sampled_at": sample.get("at"), "event_types": list(dev.event_types), "errors": errors,
            **fields,
        }
        obs = built(GpuDeviceObs, values, set(values))
        dev.last = (key, procs, sample, obs)
        return obs

    def _with_util(self, dev: _Device, procs: list[GpuProcessObs], sample: dict[str, Any]) -> list[GpuProcessObs]:
        """The processes with the slow path's per-process utilisation (kept in dev.procs_util:
        the same list while neither changed)."""
        util = sample.get("proc_util", {})
        out = [p.model_copy(update=dict(zip(("sm_util_pct", "mem_util_pct"), util[p.pid], strict=True)))
               if p.pid in util else p for p in procs]
        dev.procs_util = (procs, sample, out)
        return out

    def _failed(self, dev: _Device, errors: dict[str, str], key: str, out: Outcome) -> None:
        """A read of `key` gave no value: say why, remember a permanent answer, and stop at a
        GPU that is gone (each further call could block as long as this one did)."""
        errors[key] = out.failure
        if out.reason in _PERMANENT:
            dev.unsupported[key] = out.failure
        if out.reason == "gpu_lost" or (key in _CORE and out.reason in LOST_REASONS):
            raise _Lost

    def _read(self, dev: _Device, errors: dict[str, str], key: str, fns: str | tuple[str, ...],
              *args: Any) -> Any:
        """One NVML read for one signal; None plus errors[key] when it has no value."""
        if key in dev.unsupported:
            errors[key] = dev.unsupported[key]
            return None
        v = self._reader(fns)(dev.handle, *args)
        if v.__class__ is Outcome:
            self._failed(dev, errors, key, v)
            return None
        return v

    def _reader(self, fns: str | tuple[str, ...]) -> Any:
        rd = self._readers.get(fns)
        if rd is None:
            rd = self._readers[fns] = self.nvml.reader(fns)
        return rd

    def _identity(self, dev: _Device, errors: dict[str, str]) -> None:
        # Identity never changes for a handle: read until it succeeds, then never again.
        if dev.uuid is None:
            dev.uuid = self._read(dev, errors, "uuid", "nvmlDeviceGetUUID")
        if dev.name is None:
            dev.name = self._read(dev, errors, "name", "nvmlDeviceGetName")
        if dev.pci_bus_id is None:
            pci = self._read(dev, errors, "pci", "nvmlDeviceGetPciInfo")
            if pci is not None:
                bus = getattr(pci, "busId", None)
                dev.pci_bus_id = bus.decode() if isinstance(bus, bytes) else bus

    def _fast(self, dev: _Device, i: int, errors: dict[str, str], f: dict[str, Any], k: _Bound) -> None:
        """The reads of every tick, in a fixed order (the order of `errors`, which traces and
        `diagnose` JSON keep). Straight-line on purpose, one bound reader per NVML function
        (Nvml.reader) and the failure handling out of line (_failed): this runs 13 NVML calls
        a GPU a tick, and the frames around them were half the probe's cost (issue 17). Once
        every reader is resolved, `d` holds their pynvml functions themselves (Nvml.direct),
        called here in a `try` whose failure the reader maps (Nvml.failed): the same values
        and outcomes, one Python frame less a read (issue 17, sixth pass)."""
        h, unsup, d, nv = dev.handle, dev.unsupported, self._direct_reads(k), self.nvml
        if "utilization" in unsup:
            errors["utilization"] = unsup["utilization"]
        else:
            try:
                v = d.util(h)
            except Exception as e:  # noqa: BLE001 - a direct read: mapped as its reader maps it
                v = nv.failed(k.util, e, (h,))
            if v.__class__ is Outcome:
                self._failed(dev, errors, "utilization", v)
            else:  # past pynvml's Python __getattribute__ (it only decodes bytes): ints here
                f["util_gpu_pct"], f["util_mem_pct"] = int(_oga(v, "gpu")), int(_oga(v, "memory"))
        self._memory(dev, errors, f, k, d)
        f["processes"] = self._processes(dev, i, errors, k, d)
        if "persistence_mode" in unsup:
            errors["persistence_mode"] = unsup["persistence_mode"]
        else:
            try:
                v = d.pm(h)
            except Exception as e:  # noqa: BLE001
                v = nv.failed(k.pm, e, (h,))
            if v.__class__ is Outcome:
                self._failed(dev, errors, "persistence_mode", v)
            else:
                f["persistence_mode"] = v == k.enabled
        if "clock_event_reasons" in unsup:
            errors["clock_event_reasons"] = unsup["clock_event_reasons"]
        else:
            try:
                v = d.clocks(h)
            except Exception as e:  # noqa: BLE001
                v = nv.failed(k.clocks, e, (h,))
            if v.__class__ is Outcome:
                self._failed(dev, errors, "clock_event_reasons", v)
            else:
                mask = int(v)
                names = k.clock_names.get(mask)
                if names is None:
                    names = k.clock_names[mask] = tuple(decode_clock_reasons(self.nvml.lib, mask))
                f["clock_event_reasons"] = list(names)
        # One key per counter type: when one ECC read is unsupported, its sibling is too.
        ecc_read = d.ecc_read
        for key, name, etype, counter in k.ecc:
            if key in unsup:
                errors[key] = unsup[key]
                continue
            try:
                v = ecc_read(h, etype, counter)
            except Exception as e:  # noqa: BLE001
                v = nv.failed(k.ecc_read, e, (h, etype, counter))
            if v.__class__ is Outcome:
                self._failed(dev, errors, key, v)
            else:
                f[name] = int(v)
        if "temperature" in unsup:
            errors["temperature"] = unsup["temperature"]
        else:
            try:
                v = d.temp(h, k.temp_gpu)
            except Exception as e:  # noqa: BLE001
                v = nv.failed(k.temp, e, (h, k.temp_gpu))
            if v.__class__ is Outcome:
                self._failed(dev, errors, "temperature", v)
            else:
                f["temperature_c"] = int(v)
        if "power" in unsup:
            errors["power"] = unsup["power"]
        else:
            try:
                v = d.power(h)
            except Exception as e:  # noqa: BLE001
                v = nv.failed(k.power, e, (h,))
            if v.__class__ is Outcome:
                self._failed(dev, errors, "power", v)
            else:  # mW: an int's quotient is already round(., 3) (checked for 0-3 kW), round is not free
                f["power_w"] = v / 1000.0 if v.__class__ is int else round(v / 1000.0, 3)
        if "pstate" in unsup:
            errors["pstate"] = unsup["pstate"]
        else:
            try:
                v = d.pstate(h)
            except Exception as e:  # noqa: BLE001
                v = nv.failed(k.pstate, e, (h,))
            if v.__class__ is Outcome:
                self._failed(dev, errors, "pstate", v)
            elif 0 <= v <= 15:
                f["pstate"] = int(v)

    def _direct_reads(self, k: _Bound) -> _Bound:
        """`k` with the fast path's readers replaced by their pynvml functions once every one
        is resolved (Nvml.direct), else `k` itself (a reader never raises: the `try` around
        it in _fast is then idle). Kept while Nvml.generation stands."""
        nv = self.nvml
        memo = self._direct
        if memo is not None and memo[0] == nv.generation and memo[1] is k:
            return memo[2]
        (_, _, compute), (_, _, graphics) = k.procs
        rds = (k.util, k.mem, compute, graphics, k.pm, k.clocks, k.ecc_read, k.temp, k.power,
               k.pstate)
        fns = [nv.direct(rd) for rd in rds]
        d = k
        if None not in fns:
            util, mem, compute, graphics, pm, clocks, ecc_read, temp, power, pstate = fns
            d = replace(k, util=util, mem=mem, pm=pm, clocks=clocks, ecc_read=ecc_read, temp=temp,
                        power=power, pstate=pstate,
                        procs=((k.procs[0][0], k.procs[0][1], compute),
                               (k.procs[1][0], k.procs[1][1], graphics)))
        self._direct = (nv.generation, k, d)
        return d

    def _bind(self) -> _Bound:
        """The readers and constants of the fast path, once per probe (the library is loaded)."""
        lib, rd = self.nvml.lib, self._reader
        ecc = []
        for counter, cname in (("volatile", "NVML_VOLATILE_ECC"), ("aggregate", "NVML_AGGREGATE_ECC")):
            for etype, ename in (("uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"),
                                 ("corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED")):
                ecc.append((f"ecc_{counter}", f"ecc_{counter}_{etype}", getattr(lib, ename),
                            getattr(lib, cname)))
        return _Bound(
            count=rd("nvmlDeviceGetCount"), wait=rd(_WAIT_FNS),
            util=rd("nvmlDeviceGetUtilizationRates"), mem=rd("nvmlDeviceGetMemoryInfo"),
            mem_v2=self.nvml.const("nvmlMemory_v2"),
            procs=(("compute", "processes_compute", rd(_COMPUTE_PROCS)),
                   ("graphics", "processes_graphics", rd(_GRAPHICS_PROCS))),
            pm=rd("nvmlDeviceGetPersistenceMode"),
            enabled=getattr(lib, "NVML_FEATURE_ENABLED", 1), clocks=rd(_CLOCK_FNS),
            ecc_read=rd("nvmlDeviceGetTotalEccErrors"), ecc=tuple(ecc), temp=rd(_TEMP_FNS),
            temp_gpu=getattr(lib, "NVML_TEMPERATURE_GPU", 0), power=rd("nvmlDeviceGetPowerUsage"),
            pstate=rd("nvmlDeviceGetPerformanceState"),
        )

    def _memory(self, dev: _Device, errors: dict[str, str], f: dict[str, Any], k: _Bound,
                d: _Bound) -> None:
        # v2 separates driver-reserved memory from `used`; fall back to v1 on older drivers.
        v2 = k.mem_v2
        mem = None
        if v2 is not None and "memory_v2" not in dev.unsupported:
            try:
                out = d.mem(dev.handle, v2)
            except Exception as e:  # noqa: BLE001 - a direct read (_fast): mapped as its reader maps it
                out = self.nvml.failed(k.mem, e, (dev.handle, v2))
            if out.__class__ is not Outcome:
                mem = out
            elif out.reason in LOST_REASONS:
                errors["memory"] = out.failure
                raise _Lost
            else:
                dev.unsupported["memory_v2"] = out.failure
        if mem is None:
            mem = self._read(dev, errors, "memory", "nvmlDeviceGetMemoryInfo")
        if mem is not None:
            f["mem_total_bytes"], f["mem_used_bytes"], f["mem_free_bytes"] = (
                int(_oga(mem, "total")), int(_oga(mem, "used")), int(_oga(mem, "free")))
            try:  # memory info v2 only; hasattr would go through pynvml's __getattribute__
                f["mem_reserved_bytes"] = int(_oga(mem, "reserved"))
            except AttributeError:
                pass

    def _processes(self, dev: _Device, i: int, errors: dict[str, str], k: _Bound,
                   d: _Bound) -> list[GpuProcessObs] | None:
        rows: list[tuple[str, Any, Any, Any, Any]] = []
        known = True
        for (kind, key, rd), (_, _, fn) in zip(k.procs, d.procs, strict=True):
            if key in dev.unsupported:
                errors[key] = dev.unsupported[key]
                lst = None
            else:
                try:
                    lst = fn(dev.handle)
                except Exception as e:  # noqa: BLE001 - a direct read (_fast): mapped as its reader maps it
                    lst = self.nvml.failed(rd, e, (dev.handle,))
                if lst.__class__ is Outcome:
                    self._failed(dev, errors, key, lst)
                    lst = None
            if lst is None:
                if errors.get(key) != "not_supported":
                    known = False  # unknown, not "no processes"
                continue
            for p in lst:
                rows.append((kind, p.pid, getattr(p, "usedGpuMemory", None),
                             getattr(p, "gpuInstanceId", None), getattr(p, "computeInstanceId", None)))
        if not known:
            return None
        # The same rows as last tick: the same list of observations (issue 17).
        memo = dev.procs
        if memo is not None and memo[0] == rows:
            return memo[1]
        out = _process_obs(rows, i)
        dev.procs = (rows, out)
        return out

    def _slow(self, dev: _Device, errors: dict[str, str], now: float) -> None:
        sample: dict[str, Any] = {"at": now, "errors": {}}
        try:
            self._slow_sample(dev, sample["errors"], sample)
        finally:
            errors.update(sample["errors"])

    def _slow_sample(self, dev: _Device, errors: dict[str, str], sample: dict[str, Any]) -> None:
        lib = self.nvml.lib
        # Samples newer than the last one seen; the first call takes what the driver still holds.
        out = self.nvml.call("nvmlDeviceGetProcessUtilization", dev.handle, dev.proc_util_since_us)
        proc_util: dict[int, tuple[int, int]] = {}
        if out.ok or out.reason in ("not_found", "empty"):  # no samples: nobody ran anything
            latest: dict[int, Any] = {}
            for s in out.value or ():
                if s.pid not in latest or s.timeStamp >= latest[s.pid].timeStamp:
                    latest[s.pid] = s
            proc_util = {pid: (int(s.smUtil), int(s.memUtil)) for pid, s in latest.items()}
            if latest:
                dev.proc_util_since_us = max(s.timeStamp for s in latest.values())
        else:
            errors["process_utilization"] = out.failure
            if out.reason == "gpu_lost":
                raise _Lost
        sample["proc_util"] = proc_util
        for direction, cname in (("tx", "NVML_PCIE_UTIL_TX_BYTES"), ("rx", "NVML_PCIE_UTIL_RX_BYTES")):
            kb = self._read(dev, errors, f"pcie_{direction}", "nvmlDeviceGetPcieThroughput",
                            getattr(lib, cname))
            if kb is not None:
                sample[f"pcie_{direction}"] = int(kb) * 1024  # NVML reports KB/s
        dev.slow = sample  # one assignment: a tick reading it meanwhile sees the old or the new

    # -- events ---------------------------------------------------------------------------------

    def _register_events(self, i: int, dev: _Device) -> None:
        nv = self.nvml
        if self._event_set is None:
            return
        wanted = [(nv.const(c), name) for c, name in _EVENTS if nv.const(c) is not None]
        supported = nv.call("nvmlDeviceGetSupportedEventTypes", dev.handle)
        if supported.ok:
            wanted = [(bit, name) for bit, name in wanted if supported.value & bit]
        else:  # cannot ask: try the one that matters most
            wanted = [(bit, name) for bit, name in wanted if name == "xid"]
        if not wanted:
            dev.events_error = "not_supported"
            return
        mask = 0
        for bit, _ in wanted:
            mask |= bit
        out = nv.call("nvmlDeviceRegisterEvents", dev.handle, mask, self._event_set)
        if not out.ok:
            dev.events_error = out.reason
            return
        dev.event_types = [name for _, name in wanted]
        self._by_handle[_handle_key(dev.handle)] = i

    def _drain(self, now: float, k: _Bound) -> None:
        if self._events_on is None:  # once per set of devices, not every tick
            self._events_on = any(d.event_types for d in self._devices.values())
        if self._event_set is None or not self._events_on:
            return
        self._drain_error = None
        wait = k.wait
        for _ in range(_MAX_DRAIN):
            out = wait(self._event_set, 0)  # 0 ms: never block the tick
            if out.__class__ is Outcome:
                if out.reason != "timeout":
                    self._drain_error = out.reason
                return
            self._record(out, now)

    def _record(self, data: Any, now: float) -> None:
        idx = self._by_handle.get(_handle_key(data.device))
        if idx is None:
            got = self.nvml.call("nvmlDeviceGetIndex", data.device)
            idx = got.value if got.ok else None
        etype, kind = int(data.eventType), None
        for cname, name in _EVENTS:
            if self.nvml.const(cname) == etype:
                kind = name
        dev = self._devices.get(idx) if idx is not None else None
        self._seq += 1
        self._events.append(XidEventObs(
            seq=self._seq, gpu_index=idx, gpu_uuid=dev.uuid if dev else None,
            kind=kind or f"event_{etype:#x}", xid=int(data.eventData) if kind == "xid" else None,
            wall_time=now,
        ))
