"""The log, the outputs, the disks and the kernel log as variables (features.py assembles the
parts)."""

from __future__ import annotations

from operator import attrgetter
from typing import Any, NamedTuple

from stallwatch.probes.disks import PathUsage
from stallwatch.probes.processes import ProcessObs
from stallwatch.probes.snapshot import Snapshot
from stallwatch.engine.features_text import _ranges, human_bytes
from stallwatch.engine.features_gpu import APPLICATION_XIDS, RECENT_EVENT_S, _norm_pci


# -------------------------------------------------------------------------------- log, outputs

def _log(snap: Snapshot) -> dict[str, Any]:
    log = snap.log
    if log is None:
        return dict(_NO_LOG)
    pr = log.progress
    tb = log.traceback
    fatal = log.fatal
    total = pr.total if pr and pr.total else None
    status = log.status._value_  # an Enum's .value is a Python property
    cadence = log.cadence_s
    rate = log.rate_per_s
    if rate is None:
        rate = log.tqdm_rate_per_s if log.tqdm_rate_per_s is not None else -1.0
    return {
        "configured": True,
        "present": status == "ok",
        "path": log.path,
        "status": status,
        "has_progress": pr is not None,
        "done": float(pr.done) if pr else -1.0,
        "total": float(total) if total else -1.0,
        "total_known": total is not None,
        "complete": bool(pr and total and pr.done >= total),
        "fraction": float(pr.done) / total if pr and total else -1.0,
        "idle_s": log.idle_s if log.idle_s is not None else -1.0,
        "idle_known": log.idle_s is not None,
        "idle_source": log.idle_source or "",
        "growth_age_s": log.last_growth_age_s if log.last_growth_age_s is not None else -1.0,
        "cadence_p90_s": cadence.p90_s if cadence else -1.0,
        "cadence_max_s": cadence.max_s if cadence else -1.0,
        "rate_per_s": rate,
        "long_rate_per_s": _long_rate(pr),
        "eta_s": log.eta_s if log.eta_s is not None else -1.0,
        "last_line": log.tail[-1] if log.tail else "",
        "traceback": tb is not None,
        "exception": _exception_text(tb),
        "fatal": bool(fatal),
        "fatal_line": fatal[-1].line if fatal else "",
        "fatal_kind": fatal[-1].kind if fatal else "",
    }


# The log's variables when none is configured.
_NO_LOG: dict[str, Any] = {
    "configured": False, "present": False, "path": "", "status": "absent", "has_progress": False,
    "done": -1.0, "total": -1.0, "total_known": False, "complete": False, "fraction": -1.0,
    "idle_s": -1.0, "idle_known": False, "idle_source": "", "growth_age_s": -1.0,
    "cadence_p90_s": -1.0, "cadence_max_s": -1.0, "rate_per_s": -1.0, "long_rate_per_s": -1.0,
    "eta_s": -1.0, "last_line": "", "traceback": False, "exception": "", "fatal": False,
    "fatal_line": "", "fatal_kind": ""}


def _bar_vars(snap: Snapshot, threshold: float) -> dict[str, Any]:
    """Bars of several ranks in one log (bars.py): which stopped while the others went on.

    A bar is stalled when it has not moved for the stall threshold (or 3 x its own longest gap,
    whichever is longer: with N ranks the log's cadence is N times the bar's) and another bar
    moved after it or finished: the job as a whole may still progress, the rank does not."""
    log = snap.log
    bs = log.bars if log else None
    rc = log.root_cause if log else None
    out: dict[str, Any] = {
        "bar_count": len(bs.bars) if bs else 0, "bars": [], "bars_text": "",
        "bar_stalled": False, "bar_stalled_position": -1, "bar_stalled_s": -1.0,
        "bar_stalled_limit_s": -1.0, "bar_stalled_text": "",
        "failed_rank": rc.rank if rc else -1,
        "failed_pid": rc.pid if rc and rc.pid is not None else -1,
        "failed_exit_code": rc.exit_code if rc and rc.exit_code is not None else -1,
    }
    if not bs:
        return out
    out["complete"] = bs.complete
    bars = [{"position": b.position, "done": b.done, "total": b.total if b.total else -1.0,
             "samples": b.samples if b.samples is not None else -1, "idle_s": b.idle_s,
             "complete": b.complete, "text": _bar_text(b)} for b in bs.bars]
    out["bars"] = bars
    out["bars_text"] = "; ".join(f"position {b['position']}: {b['text']}" for b in bars)
    worst = None
    for b in bs.bars:
        if b.complete:
            continue
        limit = max(threshold, 3.0 * b.max_gap_s)
        others = [o for o in bs.bars if o is not b]
        went_on = any(o.complete or o.idle_s + 1.0 < b.idle_s for o in others)
        if b.idle_s >= limit and went_on and (worst is None or b.idle_s > worst[0].idle_s):
            worst = (b, limit)
    if worst is not None:
        b, limit = worst
        fin = [o.position for o in bs.bars if o is not b and o.complete]
        moving = [o.position for o in bs.bars if o is not b and not o.complete]
        parts = []
        if fin:
            parts.append(f"position(s) {_ranges(fin)} finished")
        if moving:
            parts.append(f"position(s) {_ranges(moving)} moved since")
        out.update(bar_stalled=True, bar_stalled_position=b.position, bar_stalled_s=b.idle_s,
                   bar_stalled_limit_s=limit,
                   bar_stalled_text=(f"the bar at position {b.position} stopped at {_bar_text(b)} "
                                     f"{b.idle_s:.0f} s ago while {' and '.join(parts)}"))
    return out


def _bar_text(b) -> str:
    total = f"/{b.total:g}" if b.total else ""
    samples = f" ({b.samples} samples)" if b.samples is not None else ""
    return f"{b.done:g}{total}{samples}" + (", complete" if b.complete else "")


def _long_rate(pr) -> float:
    """The job's average rate since it started, from tqdm's own elapsed time when it has one."""
    if pr is not None and pr.elapsed_s and pr.elapsed_s > 0:
        return float(pr.done) / pr.elapsed_s
    return -1.0


def _exception_text(tb) -> str:
    if tb is None:
        return ""
    return tb.exception or (tb.lines[-1] if tb.lines else "traceback")


def _outputs(snap: Snapshot) -> dict[str, Any]:
    o = snap.outputs
    ok = o if o is not None and o.status == "ok" else None  # a StrEnum: compared as its string
    return {
        "configured": o is not None,
        "present": ok is not None,
        "path": o.path if o else "",
        "files": float(ok.file_count) if ok else -1.0,
        "bytes": float(ok.total_bytes) if ok else -1.0,
        "change_age_s": ok.last_change_age_s if ok and ok.last_change_age_s is not None else -1.0,
        "newest": ok.newest.path if ok and ok.newest else "",
        "mean_file_bytes": float(ok.total_bytes) / ok.file_count if ok and ok.file_count else -1.0,
    }


# ----------------------------------------------------------------------------------- disk, kernel

def _disk(snap: Snapshot, d_file: str = "") -> dict[str, Any]:
    """The disks' variables, and (last) where a stuck job most likely waits (_io_place)."""
    d = snap.disks
    all_paths = d.paths if d else ()
    # What depends only on which paths are watched, on which mount and device, in which status:
    # the disks probe hands on the same mount and device objects tick after tick, so this
    # compares in C, and a tick only weighs the numbers (issue 17, sixth pass).
    key: list[Any] = list(map(_PATH_READS, all_paths))  # in C: one tuple a path
    key.append(snap.target.outputs)
    memo = _DISK_MEMO  # one read of an immutable pair (features.py, _PROBES_MEMO)
    st = memo[1] if memo[0] == key else _disk_static(all_paths, key, snap)
    tight = tight_inodes = None
    tight_i = -1  # tight's position among the `path` entries
    known = False
    i = -1
    for p in all_paths:
        if p.kind != "path":
            continue
        i += 1
        free = p.free_bytes
        if free is not None and p.total_bytes:
            known = True
            if tight is None or free < (tight.free_bytes or 0):
                tight, tight_i = p, i
        if p.free_inodes is not None and p.total_inodes and (
                tight_inodes is None or p.free_inodes < (tight_inodes.free_inodes or 0)):
            tight_inodes = p
    shm = all_paths[st.shm] if st.shm is not None else None
    all_devs = d.devices if d else ()
    job_devs = st.job_devs
    devs = [x for x in all_devs if x.name in job_devs] or all_devs
    worst_dev = max(devs, key=_INFLIGHT_STUCK, default=None)
    stuck = [all_paths[j] for j in st.stuck]
    out = {
        "known": known,
        "free_bytes": float(tight.free_bytes or 0) if tight else -1.0,
        "free_h": human_bytes(tight.free_bytes or 0) if tight else "",
        "total_bytes": float(tight.total_bytes or 0) if tight else -1.0,
        "used_pct": tight.used_pct if tight and tight.used_pct is not None else -1.0,
        "path": tight.path if tight else "",
        "mount": st.mounts[tight_i] if tight else "",
        "device": st.devnames[tight_i] if tight else "",
        "fstype": st.fstypes[tight_i] if tight else "",
        "free_inodes": float(tight_inodes.free_inodes or 0) if tight_inodes else -1.0,
        "inodes_used_pct": (tight_inodes.inodes_used_pct if tight_inodes and
                            tight_inodes.inodes_used_pct is not None else -1.0),
        "inodes_path": tight_inodes.path if tight_inodes else "",
        "stuck": bool(stuck),
        "stuck_path": stuck[0].path if stuck else "",
        "stuck_detail": (stuck[0].detail or "") if stuck else "",
        "stuck_for_s": max((p.stuck_for_s or 0.0 for p in stuck), default=0.0),
        "inflight_stuck_s": worst_dev.inflight_stuck_for_s if worst_dev else 0.0,
        "inflight_device": worst_dev.name if worst_dev else "",
        "inflight_ios": float(worst_dev.inflight_ios) if worst_dev else 0.0,
        "write_bytes_per_s": (worst_dev.write_bytes_per_s or 0.0) if worst_dev else 0.0,
        "shm_free_bytes": float(shm.free_bytes) if shm and shm.free_bytes is not None else -1.0,
        "shm_used_pct": shm.used_pct if shm and shm.used_pct is not None else -1.0,
        "shm_sgl_segments": float(shm.sgl_shm_segments or 0) if shm else 0.0,
        "paths": st.paths_vars,  # the same list while the key stands: handed on by identity
    }
    place = st.place if d_file[:1] != "/" else None
    out.update(place if place is not None else _io_place(snap, d_file))
    return out


class _DiskStatic(NamedTuple):
    shm: int | None  # the first /dev/shm entry's index in the probe's paths
    job_devs: frozenset[str]
    stuck: tuple[int, ...]  # the stuck `path` entries' indices in the probe's paths
    mounts: tuple[str, ...]  # per entry of `paths`
    devnames: tuple[str, ...]
    fstypes: tuple[str, ...]
    paths_vars: list[dict[str, str]]
    place: dict[str, str] | None  # _io_place's answer when it weighs no number (no D thread's file)


# (key, _DiskStatic): the last paths' static parts. Read-only for callers, like _LAST in features.
_DISK_MEMO: tuple[Any, Any] = (None, None)


def _disk_static(all_paths: tuple[PathUsage, ...], key: list[Any], snap: Snapshot) -> _DiskStatic:
    paths = tuple(p for p in all_paths if p.kind == "path")
    shm = next((i for i, p in enumerate(all_paths) if p.kind == "dev_shm"), None)
    job_devs: set[str] = set()
    for p in paths:
        dev = p.device
        if dev:
            job_devs.add(dev.name)
            if dev.parent_disk:
                job_devs.add(dev.parent_disk)
    devnames = tuple(_devname(p) for p in paths)
    mounts = tuple(p.mount.mount_point if p.mount else "" for p in paths)
    place = _io_place(snap, "")
    st = _DiskStatic(
        shm=shm, job_devs=frozenset(job_devs),
        # a StrEnum: compared as its string
        stuck=tuple(i for i, p in enumerate(all_paths) if p.kind == "path" and p.status in _STUCK),
        mounts=mounts, devnames=devnames,
        fstypes=tuple(p.mount.fs_type if p.mount else "" for p in paths),
        paths_vars=[{"path": p.path, "mount": m, "device": n, "status": p.status.value,
                     "detail": p.detail or ""} for p, m, n in zip(paths, mounts, devnames, strict=True)],
        # the tightest path's answer weighs free bytes, which move: asked again each tick
        place=None if place["io_why"] == _TIGHTEST else place)
    global _DISK_MEMO
    _DISK_MEMO = (key, st)
    return st


_STUCK = ("timeout", "busy")
_PATH_READS = attrgetter("path", "kind", "status", "detail", "mount", "device")
_INFLIGHT_STUCK = attrgetter("inflight_stuck_for_s")
_TIGHTEST = "the watched filesystem with the least free space"


def _io_place(snap: Snapshot, d_file: str) -> dict[str, str]:
    """The filesystem a stuck job most likely waits on, for the io_stall advice: the mount holding
    the file the worst D thread's syscall is on; else a watched path whose statvfs is stuck; else
    the outputs directory's (where an extraction job writes); else the tightest."""
    d = snap.disks
    paths = [p for p in (d.paths if d else ()) if p.kind == "path" and p.mount]
    if not paths:
        return {"io_mount": "", "io_device": "", "io_why": ""}

    def under(f: str, mp: str) -> bool:
        return f == mp or f.startswith(mp.rstrip("/") + "/")

    def mount_of(p: PathUsage) -> str:
        return p.mount.mount_point if p.mount else ""  # every path here has one

    if d_file.startswith("/"):
        owners = [p for p in paths if under(d_file, mount_of(p))]
        if owners:
            p = max(owners, key=lambda p: len(mount_of(p)))
            return {"io_mount": mount_of(p), "io_device": _devname(p),
                    "io_why": f"holds {d_file}, the stuck thread's file"}
    stuck = [p for p in paths if p.status.value in ("timeout", "busy")]
    if stuck:
        return {"io_mount": mount_of(stuck[0]), "io_device": _devname(stuck[0]),
                "io_why": f"statvfs of {stuck[0].path} does not return"}
    out = str(snap.target.outputs) if snap.target.outputs else ""
    mine = next((p for p in paths if out and p.path == out), None)
    if mine is not None:
        return {"io_mount": mount_of(mine), "io_device": _devname(mine),
                "io_why": "holds the outputs directory"}
    tight = min((p for p in paths if p.free_bytes is not None), key=lambda p: p.free_bytes or 0,
                default=paths[0])
    return {"io_mount": mount_of(tight), "io_device": _devname(tight),
            "io_why": _TIGHTEST}


def _devname(p) -> str:
    if p is None or p.device is None:
        return p.mount.source if p is not None and p.mount else ""
    dev = p.device
    name = f"/dev/{dev.name}"
    if dev.parent_disk:
        name += f" (on {dev.parent_disk})"
    if dev.dm_name:
        name += f" ({dev.dm_name})"
    return f"{name} backed by {dev.loop_backing_file}" if dev.loop_backing_file else name


def _kernel(snap: Snapshot, procs: list[ProcessObs], pcis: set[str] | None = None) -> dict[str, Any]:
    k = snap.kernel
    events = [e for e in (k.events if k else ())
              if e.wall_time is None or snap.t_wall - e.wall_time < RECENT_EVENT_S]
    job_pids = {p.pid for p in procs}
    if snap.processes:
        job_pids |= {e.pid for e in snap.processes.exited}
    job_pids |= set(snap.target.pids)
    ooms = [e for e in events if e.kind == "oom_kill"]
    job_oom = next((e for e in reversed(ooms) if e.pid in job_pids), None)
    hung = [e for e in events if e.kind == "hung_task" and e.pid in job_pids]
    xids = [e for e in events if e.kind == "gpu_xid" and e.xid not in APPLICATION_XIDS
            and (pcis is None or not e.pci or _norm_pci(e.pci) in pcis)]
    ioerr = [e for e in events if e.kind in ("block_io_error", "fs_error")]
    return {
        "readable": bool(k and k.status.value == "ok"),
        "oom_job": job_oom is not None,
        "oom_line": job_oom.message if job_oom else "",
        "oom_pid": float(job_oom.pid) if job_oom and job_oom.pid else -1.0,
        "oom_comm": (job_oom.comm or "") if job_oom else "",
        "oom_any": len(ooms),
        "hung_job": bool(hung),
        "hung_line": hung[-1].message if hung else "",
        "xid": [{"xid": e.xid if e.xid is not None else -1, "pci": e.pci or "", "line": e.message}
                for e in xids],
        "io_errors": [e.message for e in ioerr][-5:],
    }
