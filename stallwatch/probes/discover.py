"""Finding the job when the user names nothing: the pipeline, from /proc (and NVML) alone.

Zero-config diagnosis starts from what an expert starts from. `nvidia-smi`: whoever holds GPU
memory is the pipeline. Without a GPU (or besides it), SGLang's process titles: the schedulers,
the detokenizer and the rest call themselves `sglang::scheduler*`, `sglang::detokenizer`,
`sglang::data_parallel_controller` ... whatever script started them, and their parent is the
HTTP server; `sglang.launch_server`, `sglang serve` and stallwatch's own
`stallwatch.sglang.protocol_server` say so on their command lines. Then:

- the **port** the server listens on: its LISTEN sockets in /proc/net/tcp{,6}, matched by inode
  with the fds of the server's process tree (as stallwatch.probes.server_processes does);
- the **clients**: ESTABLISHED sockets whose remote port is that port, held by processes outside
  the server's tree (stallwatch's own processes excepted: a daemon's health checks are not a job);
- the client's **log**: its stdout/stderr (fd 1/2) when they point to a regular file, else a
  regular file it has open for writing whose name ends in .log/.txt/.out, else — stdout piped to
  `tee` — the file the process at the other end of the pipe writes;
- its **outputs**: the most common folder of the output files (*.pt, *.ckpt, ...) it has open
  for writing or wrote in the last 10 minutes under the folders its command line names and its
  cwd (a bounded walk with a deadline: the outputs' filesystem may be the stuck thing), widened
  to the folder its command line names when the files sit in shard folders below it.

The Target names the client (the job), its log, outputs and the server URL; what was found, and
from what, is told through `report` (stderr by default). With no server found, the GPU processes
are the job (their logs and outputs found the same way). Nothing at all: UsageError (exit 3).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stallwatch.kernel import proc as kproc
from stallwatch.kernel import procfs

from stallwatch.probes import torchrun
from stallwatch.probes.discover_files import find_log, log_and_outputs, short
from stallwatch.errors import UsageError
from stallwatch.probes.gpu import GpuProbe, gpu_pids
from stallwatch.kernel.roots import DEFAULT_ROOTS, Absent, Denied, Roots
from stallwatch.sglang.titles import SERVER_CMDLINE, SGLANG_TITLE
from stallwatch.probes.targets import Target

# Command lines (or process titles) that are an SGLang server, whatever started them: every
# title SGLang sets, `sglang.launch_server` and `sglang serve` (stallwatch.sglang.titles).
__all__ = ["discover", "find_pipeline", "Discovery", "SERVER_CMDLINE"]

CLIENT_RETRIES = 4  # a client between two requests may hold no connection at this instant
CLIENT_RETRY_S = 0.4
_LOCAL = ("127.", "::1", "::ffff:127.")


@dataclass
class Proc:
    pid: int
    ppid: int
    comm: str
    state: str
    start_ticks: int
    cmdline: tuple[str, ...]
    fds: dict[int, str] | None = None  # fd -> readlink target, read once, on demand

    @property
    def text(self) -> str:
        return " ".join(self.cmdline) if self.cmdline else f"[{self.comm}]"


@dataclass
class Discovery:
    target: Target
    notes: list[str] = field(default_factory=list)
    server_pid: int | None = None
    server_url: str | None = None
    client_pids: tuple[int, ...] = ()


class _Host:
    """One read of the process table and the TCP tables, shared by every step."""

    def __init__(self, roots: Roots) -> None:
        self.roots = roots
        self.procs: dict[int, Proc] = {}
        self.children: dict[int, list[int]] = {}
        self.self_pids = {os.getpid()}
        try:
            listed = kproc.pids(roots)
        except (Absent, Denied):
            listed = []
        for pid in listed:
            kp = kproc.Proc(pid, roots)
            try:
                st = kp.stat()
            except (Absent, Denied, ValueError):
                continue
            try:
                argv = kp.argv()
            except (Absent, Denied):
                argv = ()
            self.procs[pid] = Proc(pid, st.ppid, st.comm, st.state, st.start_ticks, argv)
        for p in self.procs.values():
            self.children.setdefault(p.ppid, []).append(p.pid)
        # our own ancestry: the shell that runs `stallwatch diagnose` is no job
        pid = os.getpid()
        while pid in self.procs and pid > 1:
            self.self_pids.add(pid)
            pid = self.procs[pid].ppid
        self.tcp: tuple[procfs.TcpSocket, ...] = ()
        self.read_tcp()

    def read_tcp(self) -> None:
        socks: list[procfs.TcpSocket] = []
        for table in ("tcp", "tcp6"):
            try:
                socks += procfs.parse_net_tcp(kproc.net_tcp(table, self.roots))
            except (Absent, Denied, ValueError):
                continue
        self.tcp = tuple(socks)

    def fds(self, pid: int, refresh: bool = False) -> dict[int, str]:
        p = self.procs.get(pid)
        if p is None:
            return {}
        if p.fds is None or refresh:
            out: dict[int, str] = {}
            kp = kproc.Proc(pid, self.roots)
            try:
                fds = kp.fds()
            except (Absent, Denied):
                fds = []
            for fd in fds:
                try:
                    out[fd] = kp.fd_target(fd)
                except (Absent, Denied):
                    continue
            p.fds = out
        return p.fds

    def fd_flags(self, pid: int, fd: int) -> int | None:
        try:
            _pos, flags = kproc.Proc(pid, self.roots).fdinfo(fd)
        except (Absent, Denied, ValueError):
            return None
        return flags

    def cwd(self, pid: int) -> str | None:
        try:
            return kproc.Proc(pid, self.roots).cwd()
        except (Absent, Denied):
            return None

    def tree(self, root: int) -> list[int]:
        out, todo = [], [root]
        while todo:
            pid = todo.pop()
            if pid in out:
                continue
            out.append(pid)
            todo.extend(self.children.get(pid, ()))
        return out

    def socket_owners(self, inodes: set[int], pids: list[int] | None = None,
                      refresh: bool = False) -> dict[int, list[int]]:
        """inode -> pids holding it (among `pids`, default every process)."""
        out: dict[int, list[int]] = {}
        if not inodes:
            return out
        for pid in (pids if pids is not None else list(self.procs)):
            for link in self.fds(pid, refresh=refresh).values():
                ino = procfs.socket_inode(link)
                if ino in inodes:
                    out.setdefault(ino, [])
                    if pid not in out[ino]:
                        out[ino].append(pid)
        return out

    def is_stallwatch(self, pid: int) -> bool:
        """stallwatch's own tools (a daemon's health checks, a diagnose), never a job; the
        reference client `python -m stallwatch.sglang.extract_client` is a job."""
        if pid in self.self_pids:
            return True
        argv = self.procs[pid].cmdline if pid in self.procs else ()
        if not argv:
            return False
        if os.path.basename(argv[0]) == "stallwatch":
            return True
        for i, a in enumerate(argv[:-1]):
            if a == "-m" and argv[i + 1] in ("stallwatch", "stallwatch.commands.cli", "stallwatch.daemon.wrap"):
                return True
        return False


def _say_default(msg: str) -> None:
    print(f"stallwatch: discovered: {msg}", file=sys.stderr)


def discover(target: Target, gpu_probe: GpuProbe | None = None, *, roots: Roots = DEFAULT_ROOTS,
             report: Callable[[str], None] | None = _say_default) -> Target:
    """The Target for `diagnose` with no --pid/--match: the pipeline's client, its log, outputs
    and server (what the user gave is kept). Tells what it found, and from what, via `report`."""
    d = find_pipeline(target, gpu_probe, roots=roots)
    if report is not None:
        for note in d.notes:
            report(note)
    return d.target


def find_pipeline(target: Target, gpu_probe: GpuProbe | None = None, *,
                  roots: Roots = DEFAULT_ROOTS, http_timeout_s: float = 1.0) -> Discovery:
    notes: list[str] = []
    probe = gpu_probe or GpuProbe()
    try:
        obs = probe.collect()
        gpu = gpu_pids(obs)
        gpu_status: str = obs.status
    except Exception as e:  # noqa: BLE001 - NVML trouble is no reason not to look at /proc
        gpu, gpu_status = {}, f"error: {type(e).__name__}"
    host = _Host(roots)

    # -- the server: SGLang process titles and command lines, their parents, GPU holders
    why: dict[int, str] = {}
    for p in host.procs.values():
        if p.pid in host.self_pids:
            continue
        text = p.text
        if SERVER_CMDLINE.search(text):
            why.setdefault(p.pid, f"its command line reads {short(text)!r}")
            if SGLANG_TITLE.match(text) and p.ppid in host.procs and p.ppid > 1:
                parent = host.procs[p.ppid]
                why.setdefault(parent.pid, f"the parent of {text.split()[0]} (pid {p.pid})")
    for pid in gpu:
        if pid in host.procs:
            why.setdefault(pid, "it holds GPU memory (NVML)")
    servers = _server_roots(host, why)
    found: list[tuple[int, int, str, list[int]]] = []  # (root, port, url, clients)
    for root in servers:
        port, addr = _listen_port(host, root)
        if port is None:
            continue
        url = _url(addr, port)
        clients = _clients(host, root, port)
        found.append((root, port, url, clients))
    # A port becomes a server only on positive evidence: an SGLang title or command line in its
    # tree, or a JSON answer from /model_info (/get_model_info before 0.5.6). Holding GPU memory
    # and a port is what every torchrun rank does too (gloo), and that is no server.
    sglang_servers = [f for f in found if any(not why[p].startswith("it holds GPU")
                                              for p in host.tree(f[0]) if p in why)]
    gpu_servers = [f for f in found if f not in sglang_servers and f[3]
                   and not _in_torchrun(host, f[0]) and _answers_model_info(f[2], http_timeout_s)]
    for f in found:
        if f not in sglang_servers and f not in gpu_servers:
            notes.append(f"pid {f[0]} holds GPU memory and listens on port {f[1]}, but is not "
                         "an SGLang server (no sglang:: title or command line, no JSON from "
                         "/model_info or /get_model_info)")
    candidates = sglang_servers + gpu_servers
    candidates.sort(key=lambda f: (not f[3], f[0]))  # with clients first

    # Whoever holds GPU memory is the pipeline: a torchrun job whose ranks hold it comes before an
    # SGLang server that holds none (on a GPU host, such a server is not the one at work).
    if not sglang_servers or (gpu and not any(p in gpu for f in sglang_servers
                                              for p in host.tree(f[0]))):
        job = _torchrun_job(host, gpu, target, notes)
        if job is not None:
            return job
    if candidates:
        root, port, url, clients = candidates[0]
        rp = host.procs[root]
        kids = [f"{host.procs[c].text.split()[0]} (pid {c})" for c in host.tree(root)[1:]
                if c in host.procs and SGLANG_TITLE.match(host.procs[c].text)]
        gpu_held = [p for p in host.tree(root) if p in gpu]
        reasons = []
        if root in why and not why[root].startswith(("the parent of", "it holds GPU")):
            reasons.append(why[root])
        if kids:
            reasons.append(f"its children are {', '.join(kids)}")
        if gpu_held:
            reasons.append(f"pid(s) {', '.join(map(str, gpu_held))} hold GPU memory (NVML)")
        notes.append(f"server: pid {root} ({short(rp.text)}), listening on port {port} "
                     f"(/proc/net/tcp LISTEN, socket held by its tree) → {url}; an SGLang server "
                     f"because {'; '.join(reasons) or why.get(root, '?')}")
        for other in candidates[1:]:
            notes.append(f"also a server: pid {other[0]} on port {other[1]} "
                         f"({len(other[3])} client(s)): not chosen; name it with --server/--pid")
        server = target.server or url
        if not clients:
            notes.append(f"no client is connected to port {port}: diagnosing the server's "
                         "processes themselves")
            return Discovery(target.model_copy(update={"pids": tuple(host.tree(root)),
                                                       "name": "sglang-server",
                                                       "server": server}),
                             notes, root, url, ())
        main = clients[0]
        cp = host.procs[main]
        notes.append(f"client: pid {main} ({short(cp.text)}): an ESTABLISHED connection to "
                     f"port {port}"
                     + (f"; also pids {', '.join(map(str, clients[1:]))}" if clients[1:] else ""))
        log, outputs = log_and_outputs(host, main, target, notes)
        name = _job_name(cp)
        return Discovery(target.model_copy(update={
            "pids": tuple(clients), "name": name, "server": server,
            "log": target.log or log, "outputs": target.outputs or outputs}),
            notes, root, url, tuple(clients))

    # -- no server: the GPU processes are the job (the original zero-config behaviour)
    pids = sorted(p for p in gpu if p in host.procs) or sorted(gpu)
    if not pids:
        if servers:
            detail = ", ".join(f"pid {r}" for r in servers)
            raise UsageError(f"no target given; found an SGLang server ({detail}) but no port it "
                             "listens on: name the job with --pid PID or --match REGEX")
        why_not = "no GPU process" if gpu_status == "ok" else f"no GPU process (NVML: {gpu_status})"
        raise UsageError(f"no target given and {why_not} or SGLang server found: name the job "
                         "with --pid PID or --match REGEX")
    notes.append("GPU processes (NVML): " + ", ".join(
        f"pid {p} ({short(host.procs[p].text) if p in host.procs else '?'})" for p in pids))
    log = outputs = None
    if pids[0] in host.procs:
        log, outputs = log_and_outputs(host, pids[0], target, notes)
    return Discovery(target.model_copy(update={"pids": tuple(pids), "name": "gpu-processes",
                                               "log": target.log or log,
                                               "outputs": target.outputs or outputs}),
                     notes, None, None, tuple(pids))


# ------------------------------------------------------------------------------- torchrun


def _launchers(host: _Host) -> list[int]:
    return [p.pid for p in host.procs.values() if p.pid not in host.self_pids
            and not host.is_stallwatch(p.pid) and torchrun.is_launcher(p.comm, p.cmdline)]


def _in_torchrun(host: _Host, pid: int) -> bool:
    """pid is a torchrun agent or one of its descendants."""
    seen = set()
    while pid in host.procs and pid > 1 and pid not in seen:
        seen.add(pid)
        p = host.procs[pid]
        if torchrun.is_launcher(p.comm, p.cmdline):
            return True
        pid = p.ppid
    return False


def _torchrun_job(host: _Host, gpu: dict, target: Target, notes: list[str]) -> Discovery | None:
    """A torchrun agent and its workers are one job (SpecForge's prepare_hidden_states.py runs
    SGLang inside each rank: the ranks hold the GPUs and gloo ports, and serve nobody). With GPU
    processes, the agent above them; without, any agent on the host (the oldest first)."""
    launchers = _launchers(host)
    with_gpu = [L for L in launchers if any(p in gpu for p in host.tree(L))]
    if gpu and not with_gpu:
        return None
    pick = sorted(with_gpu or launchers, key=lambda L: host.procs[L].start_ticks)
    if not pick:
        return None
    L = pick[0]
    lp = host.procs[L]
    workers = [c for c in host.children.get(L, ()) if c in host.procs]
    held = [p for p in host.tree(L) if p in gpu]
    ranks = []
    for w in sorted(workers):
        info = torchrun.read_rank(host.roots, w) if _same_owner(host, L, w) else None
        ranks.append(f"rank {info.rank} pid {w}" if info else f"pid {w}")
    notes.append(f"torchrun job: agent pid {L} ({short(lp.text)}) with {len(workers)} worker(s): "
                 f"{', '.join(ranks) or 'none yet'}"
                 + (f"; pid(s) {', '.join(map(str, held))} hold GPU memory (NVML)" if held else "")
                 + "; one job (its ranks' ports are their own gloo mesh, not a server)")
    for other in pick[1:]:
        notes.append(f"also a torchrun job: agent pid {other}: not chosen; name it with --pid")
    main = workers[0] if workers else L
    log, outputs = log_and_outputs(host, main, target, notes)
    if log is None and target.log is None and main != L:
        found, how = find_log(host, L)
        if found:
            log = Path(found)
            notes.append(f"log: {found} (the agent's: {how})")
    name = _job_name(host.procs[main]) if main in host.procs else "torchrun"
    return Discovery(target.model_copy(update={
        "pids": (L,), "name": name, "log": target.log or log,
        "outputs": target.outputs or outputs}), notes, None, None, (L,))


def _same_owner(host: _Host, a: int, b: int) -> bool:
    """Both processes have one real uid: b's environment is readable to a's user too."""
    uids = []
    for pid in (a, b):
        try:
            uids.append(kproc.Proc(pid, host.roots).status().uid)
        except (Absent, Denied, ValueError, KeyError):
            return False
    return uids[0] == uids[1]


def _answers_model_info(url: str, timeout_s: float) -> bool:
    """An SGLang server answers GET /model_info (0.5.6 on) or /get_model_info (0.5.0-0.5.5) with
    a JSON object. Loopback only, bounded in time and size."""
    if timeout_s <= 0 or not url.startswith(("http://127.", "http://[::1]")):
        return False
    for route in ("/model_info", "/get_model_info"):
        try:
            with urllib.request.urlopen(url + route, timeout=timeout_s) as resp:
                body = resp.read(64 << 10)
            if isinstance(json.loads(body), dict):
                return True
        except (OSError, ValueError):
            continue
    return False


# ------------------------------------------------------------------------------- the server


def _server_roots(host: _Host, why: dict[int, str]) -> list[int]:
    """The top process of each server tree: climb while the parent is a server process too."""
    roots: list[int] = []
    for pid in sorted(why):
        top = pid
        seen = {pid}
        while True:
            parent = host.procs[top].ppid if top in host.procs else 0
            if parent in why and parent not in seen:
                top = parent
                seen.add(top)
            else:
                break
        if top not in roots:
            roots.append(top)
    # a root inside another root's tree (a GPU child of an SGLang server) is that server
    out = []
    for r in roots:
        if not any(r != o and r in host.tree(o) for o in roots):
            out.append(r)
    return out


def _listen_port(host: _Host, root: int) -> tuple[int | None, str]:
    listening = {s.inode: s for s in host.tcp if s.state == "LISTEN"}
    tree = host.tree(root)
    owners = host.socket_owners(set(listening), tree)
    if not owners:
        return None, ""
    by_root = [listening[i] for i, pids in owners.items() if root in pids]
    socks = by_root or [listening[i] for i in owners]
    established = Counter(s.remote_port for s in host.tcp if s.state == "ESTABLISHED")
    # the HTTP port: held by the top process, with clients connected, else the lowest
    socks.sort(key=lambda s: (-established.get(s.local_port, 0), s.local_port))
    best = socks[0]
    return best.local_port, best.local_addr


def _url(addr: str, port: int) -> str:
    if addr in ("0.0.0.0", "::", "", "::ffff:0.0.0.0") or addr.startswith("127."):
        host = "127.0.0.1" if not addr.startswith("127.") else addr
    elif ":" in addr:
        host = "[::1]" if addr == "::1" else f"[{addr}]"
    else:
        host = addr
    return f"http://{host}:{port}"


def _clients(host: _Host, root: int, port: int) -> list[int]:
    """Processes outside the server's tree with an ESTABLISHED connection to its port."""
    tree = set(host.tree(root))
    for attempt in range(CLIENT_RETRIES):
        if attempt:
            time.sleep(CLIENT_RETRY_S)
            host.read_tcp()
        local_addrs = {s.local_addr for s in host.tcp}
        inodes = {s.inode for s in host.tcp if s.state == "ESTABLISHED" and s.remote_port == port
                  and s.local_port != port and s.inode
                  and (s.remote_addr.startswith(_LOCAL) or s.remote_addr in local_addrs)}
        if not inodes:
            continue
        pids = [p for p in host.procs if p not in tree and not host.is_stallwatch(p)]
        owners = host.socket_owners(inodes, pids, refresh=attempt > 0)
        clients = sorted({p for ps in owners.values() for p in ps})
        # a launcher and its child sharing the socket: the child does the work
        clients = [c for c in clients if not any(o != c and host.procs[o].ppid == c
                                                 for o in clients)]
        if clients:
            return clients
    return []


def _job_name(p: Proc) -> str:
    for a in p.cmdline[1:4]:
        if a.endswith(".py"):
            return re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(a)[:-3])[:64] or "job"
    for i, a in enumerate(p.cmdline[:-1]):
        if a == "-m":
            return re.sub(r"[^A-Za-z0-9_.-]", "_", p.cmdline[i + 1].rsplit(".", 1)[-1])[:64]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", p.comm)[:64] or "job"
