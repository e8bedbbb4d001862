"""The GPUs and the SGLang server as variables (features.py assembles the parts)."""

from __future__ import annotations

import operator
from typing import Any

from stallwatch.sglang.titles import parse_title
from stallwatch.probes.snapshot import Snapshot
from stallwatch.engine.features_text import human_bytes, human_s
from stallwatch.engine.features_job import _quiet


RECENT_EVENT_S = 900.0  # kernel and Xid events older than this are history, not the present

APPLICATION_XIDS = {13, 31, 43, 45}


# ------------------------------------------------------------------------------------------ GPU

def _server_pids(snap: Snapshot) -> set[int]:
    sp = snap.server_processes
    return {p.pid for p in sp.processes} if sp else set()


def _pipeline_gpus(snap: Snapshot, job_pids: set[int]) -> set[int] | None:
    """The GPUs the job or its server hold memory on; None when that is unknown (no process list,
    or nobody of the pipeline on a GPU): then every GPU of the host is the pipeline's."""
    g = snap.gpu
    if g is None or not g.devices:  # no GPU: no holder to look for
        return None
    pids = job_pids | _server_pids(snap)
    found = {d.index for d in (g.devices if g and g.status == "ok" else ())
             for pr in d.processes or () if pr.pid in pids}
    return found or None


def _norm_pci(bus_id: str) -> str:
    # NVML says "00000000:3B:00.0", the kernel "0000:3b:00": compare domain:bus:device.
    parts = bus_id.lower().split(".")[0].split(":")
    if len(parts) == 3:
        return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
    return bus_id.lower()


def _pcis_of(snap: Snapshot, mine: set[int] | None) -> set[str] | None:
    """The PCI bus ids of those GPUs, as kernel Xid lines name them; None: every GPU."""
    if mine is None or snap.gpu is None:
        return None
    pcis = {_norm_pci(d.pci_bus_id) for d in snap.gpu.devices if d.index in mine and d.pci_bus_id}
    return pcis or None


# The variables of the last GpuObs without devices or events, by identity: without NVML the gpu
# probe hands on the same observation tick after tick (issue 17), and then they depend on
# nothing else (no device, no pid, no event to date against t_wall). Read-only for callers.
_NO_GPU_MEMO: tuple[Any, dict[str, Any]] = (None, {})


# With NVML the observation is new every tick (its collected_at), but the probe hands on each
# device's observation while nothing read on it changed (issue 17): without an Xid event the
# variables depend on nothing but the devices, the status, the job's pids and the pipeline's
# GPUs, so the last dict stands while those are the same. (devices, pids, mine, variables).
_DEVICES_MEMO: tuple[Any, Any, Any, dict[str, Any]] = ((), None, None, {})


def _gpu(snap: Snapshot, job_pids: set[int], mine: set[int] | None) -> dict[str, Any]:
    """mine: the pipeline's GPUs (_pipeline_gpus), None when unknown."""
    global _NO_GPU_MEMO, _DEVICES_MEMO
    g = snap.gpu
    bare = g is not None and not g.devices and not g.xid_events
    memo = _NO_GPU_MEMO  # one read (features.py, _PROBES_MEMO)
    if bare and memo[0] is g:
        return memo[1]
    now = g.devices if g is not None else []
    steady = g is not None and bool(now) and not g.xid_events and g.status == "ok"
    if steady:
        devs, pids, m, out = _DEVICES_MEMO
        if (len(devs) == len(now) and all(map(operator.is_, devs, now))
                and pids == job_pids and m == mine):
            return out
    out = _gpu_vars(snap, job_pids, mine)
    if bare:
        _NO_GPU_MEMO = (g, out)
    elif steady:
        _DEVICES_MEMO = (tuple(now), frozenset(job_pids), None if mine is None else frozenset(mine), out)
    return out


def _gpu_vars(snap: Snapshot, job_pids: set[int], mine: set[int] | None) -> dict[str, Any]:
    g = snap.gpu
    devs = list(g.devices) if g and g.status == "ok" else []
    utils = [d.util_gpu_pct for d in devs if isinstance(d.util_gpu_pct, (int, float))]
    job_mem = 0
    job_gpus: set[int] = set()
    for d in devs:
        for pr in d.processes or ():
            if pr.pid in job_pids:
                job_mem += pr.used_bytes or 0
                job_gpus.add(d.index)
    # A fault on another tenant's GPU is not this pipeline's: on a shared 8-GPU node a job on
    # GPUs 0-1 must not be called gpu_fault (and left unrestarted) for an Xid on GPU 5.
    scoped = (lambda i: True) if mine is None else (lambda i: i in mine)
    # Corrected single-bit ECC is the hardware working as designed, and Xids 13, 31, 43 and 45
    # are raised by the application itself (an illegal access, a page fault, a killed context):
    # the job's problem, judged by its own verdict, not a GPU fault.
    xids = [e for e in (g.xid_events if g else ()) if snap.t_wall - e.wall_time < RECENT_EVENT_S
            and e.kind != "ecc_single_bit" and e.xid not in APPLICATION_XIDS]
    lost = [d.index for d in devs if d.lost]
    ecc = [d.index for d in devs if (d.ecc_volatile_uncorrected or 0) > 0]
    others = (len([i for i in lost if not scoped(i)]) + len([i for i in ecc if not scoped(i)])
              + len([e for e in xids if e.gpu_index is not None and not scoped(e.gpu_index)]))
    lost, ecc = [i for i in lost if scoped(i)], [i for i in ecc if scoped(i)]
    xids = [e for e in xids if e.gpu_index is None or scoped(e.gpu_index)]
    return {
        "present": bool(devs),
        "status": g.status if g else "absent",
        "count": len(devs),
        "util_max_pct": max(utils) if utils else -1.0,
        "util_mean_pct": sum(utils) / len(utils) if utils else -1.0,
        "mem_used_bytes": float(sum(d.mem_used_bytes or 0 for d in devs)),
        "job_mem_bytes": float(job_mem),
        "job_mem_h": human_bytes(job_mem),
        "job_gpus": sorted(job_gpus),
        "pipeline_gpus": sorted(mine) if mine is not None else [d.index for d in devs],
        "faults_elsewhere": float(others),
        "lost": lost,
        "ecc_uncorrected_gpus": ecc,
        "xid_recent": [{"gpu": e.gpu_index, "xid": e.xid if e.xid is not None else -1, "kind": e.kind}
                       for e in xids],
        "list": [{"index": d.index, "name": d.name or "", "util_pct": d.util_gpu_pct
                  if isinstance(d.util_gpu_pct, (int, float)) else -1.0,
                  "mem_used_bytes": float(d.mem_used_bytes or 0),
                  "mem_used_h": human_bytes(d.mem_used_bytes or 0),
                  "mem_total_bytes": float(d.mem_total_bytes or 0),
                  "pids": [pr.pid for pr in d.processes or ()]} for d in devs],
    }


# ------------------------------------------------------------------------------ server, client

def _server(snap: Snapshot) -> dict[str, Any]:
    s = snap.server
    h = s.health if s else None
    info = s.server_info if s else None
    m = s.metrics if s else None
    rates = m.rates_per_s if m and m.ok else {}
    gauges = m.gauges if m and m.ok else {}
    gen = rates.get("sglang:generation_tokens_total")
    prompt = rates.get("sglang:prompt_tokens_total")
    return {
        "configured": s is not None,
        "url": s.base_url if s else "",
        "port": float(s.port) if s else -1.0,
        "reachable": bool(s and s.reachable),
        "unreachable": bool(s and s.reachable is False),
        "error": (s.error or "") if s else "",
        "health_known": bool(h and h.ok is not None),
        "health_ok": bool(h and h.ok),
        "health_failed": bool(h and h.ok is False),
        "health_overdue": bool(h and h.overdue),
        "health_in_flight_s": (h.in_flight_for_s or 0.0) if h else 0.0,
        "health_status": float(h.status_code) if h and h.status_code else -1.0,
        "health_error": (h.error or "") if h else "",  # why it failed: a timeout has no status
        "info_overdue": bool(info and (info.overdue or info.timed_out)),
        # The server itself says it is not well: what tells "the client waits on a sick server"
        # from "the client is stuck on its own while connected to a healthy one".
        "trouble": bool((h and (h.ok is False or h.overdue)) or (info and (info.overdue or info.timed_out))),
        "metrics_ok": bool(m and m.ok),
        "gen_tokens_per_s": gen if gen is not None else -1.0,
        "prompt_tokens_per_s": prompt if prompt is not None else -1.0,
        "progress_unchanged_s": (m.progress_unchanged_for_s if m and m.progress_unchanged_for_s
                                 is not None else -1.0),
        "running_reqs": gauges.get("sglang:num_running_reqs", -1.0),
        "queue_reqs": gauges.get("sglang:num_queue_reqs", -1.0),
        "gauges_possibly_stale": bool(m and m.gauges_possibly_stale),
    }


def _ranks(snap: Snapshot) -> dict[str, Any]:
    """The server's worker processes (one per tensor-parallel rank) and what each is doing.

    Tells "all ranks idle" from "one rank stuck while the others spin or wait on it in a
    collective" (NCCL busy-waits: the healthy ranks show R at ~100% CPU, the stuck one does not).
    """
    sp = snap.server_processes
    gpu_of: dict[int, list[tuple[int, int]]] = {}
    for d in (snap.gpu.devices if snap.gpu else ()):
        for pr in d.processes or ():
            gpu_of.setdefault(pr.pid, []).append((d.index, pr.used_bytes or 0))
    util = {d.index: d.util_gpu_pct for d in (snap.gpu.devices if snap.gpu else ())
            if isinstance(d.util_gpu_pct, (int, float))}
    ranks: list[dict[str, Any]] = []
    for p in (sp.processes if sp else ()):
        title = parse_title(p.cmdline)
        if title is None or title.role != "scheduler":
            continue
        gpus = gpu_of.get(p.pid, [])
        quiet = _quiet(p.ctx_unchanged_for_s, p.last_ran_age_s)
        is_stuck = p.state in ("T", "t", "D", "Z") or quiet >= 10
        ranks.append({"rank": title.tp, "label": title.label, "key": list(title.key), "pid": p.pid,
                      "state": p.state, "state_for_s": p.state_since_s, "cpu_util": p.cpu_util or 0.0,
                      "cpu_pct": round((p.cpu_util or 0.0) * 100.0), "quiet_s": quiet,
                      "quiet_h": human_s(quiet), "wchan": p.wchan or "", "stuck": is_stuck,
                      "gpu": gpus[0][0] if gpus else -1,
                      "gpu_util_pct": util.get(gpus[0][0], -1.0) if gpus else -1.0,
                      "mem_h": human_bytes(sum(b for _, b in gpus))})
    gone = [e for e in (sp.exited if sp else ()) if (e.cmdline or "").startswith("sglang::scheduler")]
    ranks.sort(key=lambda r: r["key"])  # by the whole rank tuple: DP groups repeat TP numbers
    stuck = [r for r in ranks if r["stuck"]]
    busy = [r for r in ranks if not r["stuck"] and (r["state"] == "R" or r["cpu_util"] > 0.5)]
    return {
        "ranks": ranks,
        "ranks_gone": [{"pid": e.pid, "cmdline": e.cmdline or ""} for e in gone],
        # One rank stopped, in D or dead while others spin: the others wait on it in a collective.
        "rank_stuck": bool((stuck or gone) and busy),
        "ranks_all_idle": bool(ranks) and not busy and not stuck and not gone,
        "ranks_text": ", ".join(f"{r['label']} {r['state']}" + (" (stuck)" if r["stuck"] else "")
                                for r in ranks) + "".join(f", {e.cmdline or e.pid} gone" for e in gone),
    }
