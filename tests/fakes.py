"""Doubles of what a test machine lacks: NVML with GPUs (FakeNvml) and an SGLang server
(FakeSGLang, a real loopback HTTP server speaking SGLang's endpoints).

FakeNvml is kept honest: it copies pynvml's real constants, exception classes and ctypes
structures, raises `pynvml.NVMLError(code)` (which pynvml maps to its own subclasses), returns the
same shapes pynvml returns (ctypes structs, friendly objects, str), and only delivers events that
were registered. tests/gpu_live_check.py checks the same probe against a real GPU.
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pynvml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# -- NVML ------------------------------------------------------------------------------------------

GiB = 1 << 30


# ---------------------------------------------------------------------------------------------
# The double


@dataclass
class FakeGpu:
    uuid: str
    name: str | bytes = "NVIDIA H200"
    bus_id: bytes = b"00000000:19:00.0"
    util: tuple[int, int] = (0, 0)
    mem: tuple[int, int, int, int] = (141 * GiB, 0, 141 * GiB, 0)  # total, used, free, reserved
    compute: list[tuple[int, int | None, int, int]] = field(default_factory=list)  # pid, bytes, gi, ci
    graphics: list[tuple[int, int | None, int, int]] = field(default_factory=list)
    persistence: int = pynvml.NVML_FEATURE_ENABLED
    clocks: int = 0
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)  # (error type, counter) -> n
    temp: int = 40
    power_mw: int = 100_000
    pstate: int = 0
    events: int = (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
                   | pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypePState)
    samples: list[tuple[int, int, int, int]] = field(default_factory=list)  # pid, ts_us, sm, mem
    pcie_kb: tuple[int, int] = (0, 0)
    fail: dict[str, object] = field(default_factory=dict)  # fn name or "*" -> NVML code or exception


def _api(fn):
    """Count the call, then fail the way the real library would if told to."""
    def wrapper(self, handle, *args):
        self.calls[fn.__name__] = self.calls.get(fn.__name__, 0) + 1
        self._need_init()
        gpu = self._gpu(handle)
        err = gpu.fail.get(fn.__name__, gpu.fail.get("*"))
        if isinstance(err, int):
            raise pynvml.NVMLError(err)
        if isinstance(err, BaseException):
            raise err
        return fn(self, gpu, *args)
    wrapper.__name__ = fn.__name__
    return wrapper


class FakeNvml:
    """Enough of the pynvml module for the probe; everything but the functions is pynvml's own."""

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None) -> None:
        for k, v in vars(pynvml).items():
            if not k.startswith("__") and (not callable(v) or isinstance(v, type)):
                setattr(self, k, v)  # constants, NVMLError_* classes, ctypes structures
        self.gpus = gpus
        self.init_error = init_error
        self.init_calls = 0
        self.initialized = False
        self.calls: dict[str, int] = {}
        self.fail_count: int | None = None
        # Real opaque handles: pointers to distinct structs, as nvmlDeviceGetHandleByIndex returns.
        self._structs = [pynvml.struct_c_nvmlDevice_t() for _ in gpus]
        self.handles = [ctypes.pointer(s) for s in self._structs]
        self.queued: deque[tuple[int, int, int]] = deque()  # gpu index, event type, data
        self.registered: dict[int, int] = {}  # gpu index -> event mask
        self.handle_fail: dict[int, int] = {}  # gpu index -> code for nvmlDeviceGetHandleByIndex
        self.init_gate: threading.Event | None = None

    def _need_init(self) -> None:
        if not self.initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle) -> FakeGpu:
        addr = ctypes.addressof(handle.contents)
        for s, g in zip(self._structs, self.gpus, strict=True):
            if ctypes.addressof(s) == addr:
                return g
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def index_of(self, gpu: FakeGpu) -> int:
        return self.gpus.index(gpu)

    def queue_event(self, index: int, etype: int, data: int = 0) -> None:
        self.queued.append((index, etype, data))

    # -- library -------------------------------------------------------------------------------
    def nvmlInit(self):
        self.init_calls += 1
        if self.init_gate is not None:
            self.init_gate.wait(10)
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self):
        self._need_init()
        self.initialized = False

    def nvmlSystemGetDriverVersion(self):
        self._need_init()
        return "580.159.04"

    def nvmlSystemGetNVMLVersion(self):
        self._need_init()
        return "13.580.159.04"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        self._need_init()
        return 13000

    def nvmlDeviceGetCount(self):
        self._need_init()
        if self.fail_count is not None:
            raise pynvml.NVMLError(self.fail_count)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._need_init()
        if index in self.handle_fail:
            raise pynvml.NVMLError(self.handle_fail[index])
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.handles[index]

    # -- device --------------------------------------------------------------------------------
    @_api
    def nvmlDeviceGetIndex(self, gpu):
        return self.index_of(gpu)

    @_api
    def nvmlDeviceGetUUID(self, gpu):
        return gpu.uuid

    @_api
    def nvmlDeviceGetName(self, gpu):
        return gpu.name  # bytes on purpose for one GPU: older pynvml returned bytes

    @_api
    def nvmlDeviceGetPciInfo(self, gpu):
        return pynvml.nvmlPciInfo_t(busId=gpu.bus_id)

    @_api
    def nvmlDeviceGetUtilizationRates(self, gpu):
        return pynvml.c_nvmlUtilization_t(gpu=gpu.util[0], memory=gpu.util[1])

    @_api
    def nvmlDeviceGetMemoryInfo(self, gpu, version=None):
        total, used, free, reserved = gpu.mem
        if version:
            if version != pynvml.nvmlMemory_v2:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved,
                                            free=free, used=used)
        return pynvml.c_nvmlMemory_t(total=total, free=free, used=used + reserved)

    def _procs(self, rows):
        out = []
        for pid, used, gi, ci in rows:
            na = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            obj = pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_v2_t(
                pid=pid, usedGpuMemory=na if used is None else used, gpuInstanceId=gi,
                computeInstanceId=ci))
            if obj.usedGpuMemory == na:
                obj.usedGpuMemory = None  # what pynvml does with NVML_VALUE_NOT_AVAILABLE
            out.append(obj)
        return out

    @_api
    def nvmlDeviceGetComputeRunningProcesses_v3(self, gpu):
        return self._procs(gpu.compute)

    @_api
    def nvmlDeviceGetComputeRunningProcesses_v2(self, gpu):
        return self._procs(gpu.compute)

    @_api
    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, gpu):
        return self._procs(gpu.graphics)

    @_api
    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, gpu):
        return self._procs(gpu.graphics)

    @_api
    def nvmlDeviceGetPersistenceMode(self, gpu):
        return gpu.persistence

    @_api
    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu):
        return gpu.clocks

    @_api
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu):
        return gpu.clocks

    @_api
    def nvmlDeviceGetTotalEccErrors(self, gpu, error_type, counter_type):
        if not gpu.ecc:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.ecc[(error_type, counter_type)]

    @_api
    def nvmlDeviceGetTemperatureV(self, gpu, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return gpu.temp

    @_api
    def nvmlDeviceGetTemperature(self, gpu, sensor):
        return gpu.temp

    @_api
    def nvmlDeviceGetPowerUsage(self, gpu):
        return gpu.power_mw

    @_api
    def nvmlDeviceGetPerformanceState(self, gpu):
        return gpu.pstate

    @_api
    def nvmlDeviceGetProcessUtilization(self, gpu, last_seen_us):
        rows = [s for s in gpu.samples if s[1] > last_seen_us]
        if not rows:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)  # what the H200 answers
        return [pynvml.c_nvmlProcessUtilizationSample_t(pid=p, timeStamp=t, smUtil=s, memUtil=m)
                for p, t, s, m in rows]

    @_api
    def nvmlDeviceGetPcieThroughput(self, gpu, counter):
        return gpu.pcie_kb[0 if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else 1]

    @_api
    def nvmlDeviceGetSupportedEventTypes(self, gpu):
        return gpu.events

    # -- events --------------------------------------------------------------------------------
    def nvmlEventSetCreate(self):
        self._need_init()
        self._set = pynvml.struct_c_nvmlEventSet_t()
        return ctypes.pointer(self._set)

    def nvmlDeviceRegisterEvents(self, handle, event_types, event_set):
        self._need_init()
        gpu = self._gpu(handle)
        err = gpu.fail.get("nvmlDeviceRegisterEvents", gpu.fail.get("*"))
        if isinstance(err, int):
            raise pynvml.NVMLError(err)
        if event_types & ~gpu.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        i = self.index_of(gpu)
        self.registered[i] = self.registered.get(i, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        self._need_init()
        self.calls["wait"] = self.calls.get("wait", 0) + 1
        assert timeout_ms == 0, "the probe must never block on events"
        while self.queued:
            i, etype, data = self.queued.popleft()
            if self.registered.get(i, 0) & etype:
                ev = pynvml.c_nvmlEventData_t()
                ev.device = self.handles[i]
                ev.eventType, ev.eventData = etype, data
                return ev
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set):
        self._need_init()


# -- SGLang ----------------------------------------------------------------------------------------

class FakeSGLang:
    """Just enough of sglang.srt.entrypoints.http_server: switchable health, gates that hold a
    request open until the test releases it, and a /metrics body the test sets."""

    def __init__(self) -> None:
        self.health_status = 200
        self.has_health_generate = True
        self.health_gate: threading.Event | None = None
        self.info_gate: threading.Event | None = None
        self.metrics_body = b""
        self.metrics_content_length = True
        self.paths: list[str] = []
        self.old_routes = False  # SGLang 0.5.0-0.5.5: only /get_server_info and /get_model_info
        self.server_args = {"watchdog_timeout": 300, "soft_watchdog_timeout": None}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

            def do_GET(self) -> None:  # http.server's naming
                fake.paths.append(self.path)
                if self.path == "/health_generate" and not fake.has_health_generate:
                    return self.reply(404, b'{"detail":"Not Found"}')
                if self.path in ("/health", "/health_generate"):
                    if fake.health_gate is not None:
                        fake.health_gate.wait(30)
                    return self.reply(fake.health_status, b"")
                new = self.path in ("/server_info", "/model_info")
                if (new and fake.old_routes) or (self.path.startswith("/get_") and not fake.old_routes):
                    return self.reply(404, b'{"detail":"Not Found"}')
                if self.path in ("/server_info", "/get_server_info"):
                    if fake.info_gate is not None:
                        fake.info_gate.wait(30)
                    return self.reply(200, json.dumps({"version": "0.5.23", "tp_size": 2,
                                                       **fake.server_args}).encode())
                if self.path in ("/model_info", "/get_model_info"):
                    return self.reply(200, json.dumps({"model_path": "meta-llama/Llama-3.1-8B-Instruct",
                                                       "is_generation": True}).encode())
                if self.path == "/metrics":
                    return self.reply(200, fake.metrics_body, length=fake.metrics_content_length,
                                      ctype="text/plain; version=0.0.4; charset=utf-8")
                return self.reply(404, b'{"detail":"Not Found"}')

            def reply(self, code: int, body: bytes, length: bool = True, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                if length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass  # the probe hung up on an oversized body: that is the point

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        for gate in (self.health_gate, self.info_gate):
            if gate is not None:
                gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def sglang_metrics(gen: tuple[float, float] = (100, 50), prompt: float = 1000, reqs: float = 10,
                   running: float = 2, queued: float = 0, fwd: float = 3.0, idle: float = 1.0,
                   usage: tuple[float, float] = (0.25, 0.5)) -> bytes:
    """A /metrics body in the exposition format prometheus_client writes, with SGLang's names:
    tokenizer-side counters once, scheduler-side families per tp_rank label set, each rank
    exporting its DP group's same gauges (as with --enable-metrics-for-all-schedulers)."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine_type", "tp_rank", "pp_rank"]
    tok = ["model_name", "engine_type"]
    g = Counter("sglang:generation_tokens", "Generation tokens", tok, registry=reg)
    p = Counter("sglang:prompt_tokens", "Prompt tokens", tok, registry=reg)
    n = Counter("sglang:num_requests", "Requests", tok, registry=reg)
    f = Counter("sglang:forward_execution_seconds", "Forward time", labels + ["category"], registry=reg)
    i = Counter("sglang:scheduler_idle_seconds", "Idle time", labels, registry=reg)
    r = Gauge("sglang:num_running_reqs", "Running", labels, registry=reg)
    q = Gauge("sglang:num_queue_reqs", "Queued", labels, registry=reg)
    u = Gauge("sglang:token_usage", "Token usage", labels, registry=reg)
    h = Histogram("sglang:e2e_request_latency_seconds", "E2E", labels, registry=reg, buckets=(1, 10))
    for rank in (0, 1):
        lv = ["m", "unified", str(rank), "0"]
        if rank == 0:
            g.labels("m", "unified").inc(sum(gen))
            p.labels("m", "unified").inc(prompt)
            n.labels("m", "unified").inc(reqs)
            h.labels(*lv).observe(2.0)
        f.labels(*lv, "prefill").inc(fwd / 3)  # every rank runs the same forwards
        f.labels(*lv, "decode").inc(fwd * 2 / 3)
        i.labels(*lv).inc(idle)
        r.labels(*lv).set(running)  # the same DP group's count, once per rank
        q.labels(*lv).set(queued)
        u.labels(*lv).set(usage[rank])
    return generate_latest(reg)
