"""torchrun jobs: the launcher and its ranks, recognised from /proc.

`torchrun` (`python -m torch.distributed.run`, torch 2.x) runs an elastic agent whose main thread
names itself `pt_elastic`; it starts one worker per rank with `RANK`, `LOCAL_RANK`,
`WORLD_SIZE`, `GROUP_RANK` and `TORCHELASTIC_RUN_ID` in its environment, each worker in a session
of its own (torch.distributed.elastic's subprocess handler uses `start_new_session`; seen on torch
2.13: every worker's sid is its own pid). SpecForge's `prepare_hidden_states.py` is run this way
(docs/upstream.md §1): the ranks hold the GPUs and keep gloo sockets to each other, so the launcher
and its workers are one job, never "a server and its clients".

The environment is the job's to forge: a rank number read from it is a label for evidence, never
a reason to signal or trust anything. It is read only from a worker owned by the launcher's own
uid (what the job's user could read too), bounded, once per process identity.
"""

from __future__ import annotations

import os
import re

from stallwatch.model import Frozen
from stallwatch.kernel.proc import Proc
from stallwatch.kernel.roots import Absent, Denied, Roots

__all__ = ["LAUNCHER_COMM", "RankInfo", "RootCause", "RootCauseTracker", "is_launcher", "parse_environ", "rank_info",
           "read_rank"]

LAUNCHER_COMM = "pt_elastic"
RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE")
# torchrun appends its variables to a copy of the launcher's environment: they sit near the end,
# so a large environment is read whole up to this bound (a typical one is 2-20 KiB).
ENVIRON_MAX_BYTES = 256 << 10
_LAUNCH_MODULES = ("torch.distributed.run", "torch.distributed.launch")


class RankInfo(Frozen):
    rank: int
    local_rank: int | None = None
    world_size: int | None = None
    group_rank: int | None = None  # the node's index in a multi-node job


def is_launcher(comm: str, argv: tuple[str, ...] | list[str]) -> bool:
    """The torchrun agent: its thread title, or `torchrun ...` / `python -m torch.distributed.run`."""
    if comm == LAUNCHER_COMM:
        return True
    for i, a in enumerate(argv[:3]):
        base = os.path.basename(a)
        if base == "torchrun" or (a == "-m" and i + 1 < len(argv) and argv[i + 1] in _LAUNCH_MODULES):
            return True
    return False


def parse_environ(data: bytes, keys: tuple[str, ...] = RANK_KEYS) -> dict[str, str]:
    """`KEY=value` records split by NUL; only `keys` are kept (nothing else is looked at)."""
    out: dict[str, str] = {}
    for rec in data.split(b"\0"):
        k, sep, v = rec.partition(b"=")
        if sep and k.decode("ascii", "replace") in keys:
            out[k.decode()] = v.decode("utf-8", "replace")[:32]
    return out


def _int(v: str | None) -> int | None:
    if v is None or not v.strip().isdigit() or len(v.strip()) > 9:
        return None
    return int(v)


def rank_info(env: dict[str, str]) -> RankInfo | None:
    rank = _int(env.get("RANK"))
    if rank is None:
        return None
    return RankInfo(rank=rank, local_rank=_int(env.get("LOCAL_RANK")),
                    world_size=_int(env.get("WORLD_SIZE")), group_rank=_int(env.get("GROUP_RANK")))


def read_rank(roots: Roots, pid: int) -> RankInfo | None:
    """The worker's rank from /proc/PID/environ (the caller checked the owner); None when absent,
    denied or not a rank."""
    try:
        data = Proc(pid, roots).environ_bytes(ENVIRON_MAX_BYTES)
    except (Absent, Denied):
        return None
    return rank_info(parse_environ(data))


# torchrun's failure summary (torch.distributed.elastic.multiprocessing.errors, torch 2.x):
#   Root Cause (first observed failure):
#   [0]:
#     rank      : 2 (local_rank: 2)
#     exitcode  : 1 (pid: 16400)
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\)")
_RANK_LINE = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)")
_EXIT_LINE = re.compile(r"^\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)")


class RootCause(Frozen):
    rank: int
    local_rank: int | None = None
    exit_code: int | None = None  # negative: killed by that signal
    pid: int | None = None


class RootCauseTracker:
    """Follows log lines for torchrun's "Root Cause" block; keeps the last one (pure)."""

    WINDOW = 12  # lines after the header in which the rank and exitcode lines are looked for

    def __init__(self) -> None:
        self.current: RootCause | None = None
        self._left = 0
        self._rank: tuple[int, int] | None = None

    def feed(self, line: str) -> None:
        if _ROOT_CAUSE.search(line):
            self._left, self._rank = self.WINDOW, None
            return
        if self._left <= 0:
            return
        self._left -= 1
        m = _RANK_LINE.match(line)
        if m:
            self._rank = (int(m["rank"]), int(m["local"]))
            return
        m = _EXIT_LINE.match(line)
        if m and self._rank is not None:
            self.current = RootCause(rank=self._rank[0], local_rank=self._rank[1],
                                     exit_code=int(m["code"]), pid=int(m["pid"]))
            self._left = 0
