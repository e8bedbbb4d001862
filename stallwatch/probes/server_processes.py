"""Who listens on a TCP port: the server process behind a URL, found from /proc alone.

The server's processes are not in the job's tree (they were started elsewhere), yet their states
are the evidence for server_hang: which rank is stopped, which spins in a collective. We find
the listening socket's inode in /proc/net/tcp{,6} and the process holding it among /proc/*/fd.
That scan touches every fd on the host, so it runs once and again only when the pid is gone.
"""

from __future__ import annotations

from stallwatch.kernel import procfs
from stallwatch.kernel.proc import Proc, net_tcp, pids
from stallwatch.kernel.roots import Absent, Denied, Roots
from stallwatch.probes.processes import ProcessesProbe
from stallwatch.probes.targets import Target

LISTEN = "LISTEN"


def listener_pid(port: int, roots: Roots) -> int | None:
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            text = net_tcp(table, roots)
        except (Absent, Denied):
            continue
        inodes |= {s.inode for s in procfs.parse_net_tcp(text) if s.state == LISTEN and s.local_port == port}
    if not inodes:
        return None
    owners = []
    for pid in pids(roots):
        p = Proc(pid, roots)
        try:
            for fd in p.fds():
                try:
                    if procfs.socket_inode(p.fd_target(fd)) in inodes:
                        owners.append(pid)
                        break
                except (Absent, Denied):
                    continue
        except (Absent, Denied):
            continue
    # Forked workers inherit the listening socket: the lowest pid is the one that created it.
    return min(owners) if owners else None


class ServerProcessesProbe:
    """The process tree of whoever listens on the server's port (local servers only)."""

    name = "server_processes"

    def __init__(self, port: int, roots: Roots, clock) -> None:
        self.port = port
        self.roots = roots
        self.clock = clock
        self._probe: ProcessesProbe | None = None
        self._pid: int | None = None

    @property
    def pid(self) -> int | None:
        """The listening process (the server's HTTP process), once found."""
        return self._pid

    def collect(self):
        if self._probe is not None:
            obs = self._probe.collect()
            if obs.targets:
                return obs
            self._probe = None  # the server is gone (or restarted): look again
        pid = listener_pid(self.port, self.roots)
        if pid is None:
            raise Absent(f"no local process listens on port {self.port}")
        self._pid = pid
        self._probe = ProcessesProbe(Target(pids=(pid,)), roots=self.roots, clock=self.clock,
                                     read_stacks=True)
        return self._probe.collect()
