#!/usr/bin/env python
"""Live check of the GPU probe on a real GPU. Not a pytest module (its name does not match).

    PYTHONPATH=. python tests/gpu_live_check.py [--gpu N] [--driver auto|torch|cuda] [--hold-mib M]

A child process keeps one GPU busy (a torch matmul loop; without torch, a spin kernel through
libcuda's driver API, so no CUDA toolkit or CuPy is needed) while holding memory. Through the
probe only, we check what stall diagnosis relies on:
  running  -> utilisation > 0 and the child's pid holds memory
  SIGSTOP  -> utilisation falls to 0 within a few seconds, and the pid still holds its memory
  SIGKILL  -> the pid's memory is released
A JSON summary of timings and readings goes to stdout. Exit 0: every check passed; 1: one
failed; 2: could not run (no GPU, no NVML, the child never started).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import time

from stallwatch.probes.gpu import GpuObs, GpuProbe, gpu_pids

# Synchronise every step: a stopped process must not leave seconds of queued kernels behind,
# or "utilisation drops when the job stops" would measure the queue, not the probe.
CHILD_TORCH = r"""
import os, torch
hold = torch.empty(int(os.environ["HOLD_BYTES"]), dtype=torch.uint8, device="cuda")
a = torch.randn(8192, 8192, device="cuda"); b = torch.randn(8192, 8192, device="cuda")
torch.cuda.synchronize()
print("ready torch", torch.__version__, flush=True)
while True:
    c = a @ b
    torch.cuda.synchronize()
"""

# The driver API only (libcuda.so.1 ships with the driver): a PTX kernel that spins on the SM
# clock, which no compiler can optimise away.
CHILD_CUDA = r"""
import ctypes, os
cu = ctypes.CDLL("libcuda.so.1")
def ck(r, what):
    if r != 0:
        raise SystemExit(f"{what}: CUresult {r}")
PTX = b'''
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 cycles)
{
  .reg .u64 %rd<5>;
  .reg .pred %p;
  ld.param.u64 %rd1, [cycles];
  mov.u64 %rd2, %clock64;
LOOP:
  mov.u64 %rd3, %clock64;
  sub.u64 %rd4, %rd3, %rd2;
  setp.lt.u64 %p, %rd4, %rd1;
  @%p bra LOOP;
  ret;
}
''' + b"\0"
ck(cu.cuInit(0), "cuInit")
dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
ptr = ctypes.c_uint64()
ck(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(os.environ["HOLD_BYTES"]))), "cuMemAlloc")
mod = ctypes.c_void_p(); ck(cu.cuModuleLoadData(ctypes.byref(mod), PTX), "cuModuleLoadData")
fn = ctypes.c_void_p(); ck(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin"), "cuModuleGetFunction")
cycles = ctypes.c_uint64(20_000_000)  # ~10 ms a launch at ~2 GHz
params = (ctypes.c_void_p * 1)(ctypes.addressof(cycles))
print("ready cuda-driver-api", flush=True)
while True:
    ck(cu.cuLaunchKernel(fn, 264, 1, 1, 128, 1, 1, 0, None, params, None), "cuLaunchKernel")
    ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")
"""


def has_torch() -> bool:
    return subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
                          capture_output=True, timeout=120).returncode == 0


def wait_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        r, _, _ = select.select([proc.stdout], [], [], 0.2)
        if r:
            return proc.stdout.readline().decode(errors="replace").strip()
    return None


def held_by(obs: GpuObs, pid: int, gpu: int) -> int | None:
    """Bytes the pid holds on the GPU; 0 when it is not listed; None when the list is unknown."""
    dev = next((d for d in obs.devices if d.index == gpu), None)
    if dev is None or dev.processes is None:
        return None
    return sum(b or 0 for g, b in gpu_pids(obs).get(pid, []) if g == gpu)


def poll(probe: GpuProbe, pred, timeout_s: float, every_s: float = 0.05):
    """Collect until pred(obs) holds; returns (seconds taken or None, last obs)."""
    t0 = time.monotonic()
    while True:
        obs = probe.collect()
        if pred(obs):
            return time.monotonic() - t0, obs
        if time.monotonic() - t0 > timeout_s:
            return None, obs
        time.sleep(every_s)


def dev_of(obs: GpuObs, gpu: int):
    return next(d for d in obs.devices if d.index == gpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=int, default=None, help="NVML index (default: least memory used)")
    ap.add_argument("--driver", choices=("auto", "torch", "cuda"), default="auto")
    ap.add_argument("--hold-mib", type=int, default=2048)
    ap.add_argument("--stop-hold-s", type=float, default=3.0, help="watch memory this long after SIGSTOP")
    args = ap.parse_args()
    out: dict = {"checks": {}, "timings_s": {}, "readings": {}}
    checks, timings, readings = out["checks"], out["timings_s"], out["readings"]

    probe = GpuProbe(slow_every_s=1.0)
    obs = probe.collect()
    out.update(status=obs.status, error=obs.error, driver_version=obs.driver_version,
               nvml_version=obs.nvml_version, cuda_driver_version=obs.cuda_driver_version,
               device_count=obs.device_count, xid_watch=obs.xid_watch)
    if obs.status != "ok" or not obs.devices:
        print(json.dumps(out, indent=2))
        return 2
    gpu = args.gpu if args.gpu is not None else min(
        (d for d in obs.devices if not d.lost), key=lambda d: d.mem_used_bytes or 0).index
    d0 = dev_of(obs, gpu)
    out["gpu"] = {"index": gpu, "name": d0.name, "uuid": d0.uuid, "pci_bus_id": d0.pci_bus_id,
                  "errors": d0.errors, "event_types": d0.event_types}
    readings["idle"] = d0.model_dump(exclude={"processes", "errors", "event_types"})
    checks["xid_watch_on"] = obs.xid_watch.startswith("on")

    # Fast path cost (no slow sampling), including the non-blocking event drain.
    fast = GpuProbe(nvml=probe.nvml, slow_every_s=math.inf)
    fast.collect()
    ds = []
    for _ in range(30):
        t = time.perf_counter()
        fast.collect()
        ds.append(time.perf_counter() - t)
    timings["fast_collect_median"] = statistics.median(ds)
    timings["fast_collect_max"] = max(ds)
    t = time.perf_counter()
    probe._slow_mono = None  # force one slow sample to time it
    probe.collect()
    timings["slow_collect"] = time.perf_counter() - t

    driver = args.driver
    if driver == "auto":
        driver = "torch" if has_torch() else "cuda"
    out["driver"] = driver
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=d0.uuid or str(gpu), HOLD_BYTES=str(args.hold_mib << 20))
    code = CHILD_TORCH if driver == "torch" else CHILD_CUDA
    t_spawn = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                             start_new_session=True)
    pid = child.pid
    out["child_pid"] = pid
    try:
        line = wait_line(child, 180)
        out["child_says"] = line
        if not line or not line.startswith("ready"):
            out["error"] = f"child did not start (exit {child.poll()})"
            print(json.dumps(out, indent=2))
            return 2
        timings["child_ready"] = time.monotonic() - t_spawn

        took, obs = poll(probe, lambda o: (dev_of(o, gpu).util_gpu_pct or 0) > 0
                         and (held_by(o, pid, gpu) or 0) > 0, 30)
        timings["running_seen"] = took
        checks["running_util_and_memory_seen"] = took is not None
        checks["pid_visible_to_nvml"] = pid in gpu_pids(obs)
        if not checks["pid_visible_to_nvml"]:
            readings["pids_seen"] = sorted(gpu_pids(obs))
        time.sleep(1.2)  # let the 1 s slow path take a per-process utilisation sample
        obs = probe.collect()
        d = dev_of(obs, gpu)
        mine = next((p for p in d.processes or [] if p.pid == pid), None)
        readings["running"] = {"util_gpu_pct": d.util_gpu_pct, "mem_used_bytes": d.mem_used_bytes,
                               "pid_bytes": held_by(obs, pid, gpu), "power_w": d.power_w,
                               "pstate": d.pstate, "clock_event_reasons": d.clock_event_reasons,
                               "pid_sm_util_pct": mine.sm_util_pct if mine else None,
                               "pcie_tx_bytes_per_s": d.pcie_tx_bytes_per_s, "errors": d.errors}
        held_running = held_by(obs, pid, gpu) or 0

        os.kill(pid, signal.SIGSTOP)
        took, obs = poll(probe, lambda o: dev_of(o, gpu).util_gpu_pct == 0, 10)
        timings["stop_to_util_zero"] = took
        checks["util_zero_after_sigstop"] = took is not None and took <= 5.0
        held_min, t_end = None, time.monotonic() + args.stop_hold_s
        while time.monotonic() < t_end:
            obs = probe.collect()
            h = held_by(obs, pid, gpu)
            held_min = h if held_min is None or (h is not None and h < held_min) else held_min
            time.sleep(0.1)
        d = dev_of(obs, gpu)
        mine = next((p for p in d.processes or [] if p.pid == pid), None)
        readings["stopped"] = {"util_gpu_pct": d.util_gpu_pct, "pid_bytes_min": held_min,
                               "power_w": d.power_w, "clock_event_reasons": d.clock_event_reasons,
                               "pid_sm_util_pct": mine.sm_util_pct if mine else None}
        checks["memory_held_while_stopped"] = bool(held_min) and held_min >= 0.9 * held_running

        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        took, obs = poll(probe, lambda o: held_by(o, pid, gpu) == 0, 20, every_s=0.01)
        timings["kill_to_memory_released"] = took
        checks["memory_released_after_sigkill"] = took is not None
        child.wait(10)
        timings["kill_to_reaped"] = time.monotonic() - t_kill
        readings["killed"] = {"mem_used_bytes": dev_of(obs, gpu).mem_used_bytes,
                              "pid_bytes": held_by(obs, pid, gpu)}
    finally:
        if child.poll() is None:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
            child.wait(10)
    final = probe.collect()
    out["xid_events"] = [e.model_dump() for e in final.xid_events]
    out["passed"] = all(checks.values())
    print(json.dumps(out, indent=2, default=str))
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
