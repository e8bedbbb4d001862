"""The two SGLang shapes the stand-in server can take, and everything that differs between them.

Each difference is an upstream fact (sgl-project/sglang; docs/upstream.md §3):

| | `current` (0.5.15 line, 2026) | `0.5.4` (2025-11, pinned by SpecForge) |
|---|---|---|
| info routes | `/server_info`, `/model_info`; `/get_*` kept, a deprecation warning per call (0.5.6+, #13273) | `/get_server_info`, `/get_model_info` only |
| scheduler title | `sglang::scheduler` + `_DP _PP _ATTN_CP _MOE_DP _TP _EP` | `_DP _TP _EP _PP` |
| a child dies | SubprocessWatchdog (1 s poll, #18582, 2026-03-29) logs `Subprocess … crashed with exit code …`, SIGQUIT, the tree is killed | nothing: the HTTP front stays up (the zombie) |
| SIGQUIT handler | `SIGQUIT received. signum=…, frame=…. It usually means one child failed.` | `Received sigquit from a child process. It usually means the child failed.` |
| hard watchdog line | `Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)` | `Watchdog timeout (self.watchdog_timeout=300)` |

Both have the hard watchdog (`--watchdog-timeout`, active only while a batch runs, polled every
timeout/2, then 5 s of sleep and SIGQUIT to the HTTP process, which kills the tree).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    name: str
    version: str  # what /server_info reports
    new_routes: bool  # /server_info and /model_info exist
    title_order: tuple[str, ...]  # rank parts of a scheduler's title, in the order written
    subprocess_watchdog: bool  # a dead child takes the whole tree down
    watchdog_line: str  # format(timeout=...)
    sigquit_line: str  # format(signum=..., frame=...)

    def scheduler_title(self, ranks: dict[str, int], sizes: dict[str, int]) -> str:
        """`sglang::scheduler` plus a part for each dimension whose size is above 1."""
        return "sglang::scheduler" + "".join(f"_{p}{ranks[p]}" for p in self.title_order
                                             if sizes.get(p, 1) > 1)

    def watchdog_message(self, timeout_s: float) -> str:
        return self.watchdog_line.format(timeout=_num(timeout_s))

    def sigquit_message(self, signum: object, frame: object) -> str:
        return self.sigquit_line.format(signum=signum, frame=frame)


def _num(x: float) -> str:
    return f"{x:g}" if x != int(x) else str(int(x))


CURRENT = Shape(
    name="current", version="0.5.15", new_routes=True,
    title_order=("DP", "PP", "ATTN_CP", "MOE_DP", "TP", "EP"), subprocess_watchdog=True,
    watchdog_line="Scheduler watchdog timeout (self.watchdog_timeout={timeout}, self.soft=False)",
    sigquit_line="SIGQUIT received. signum={signum}, frame={frame}. It usually means one child failed.",
)
V0_5_4 = Shape(
    name="0.5.4", version="0.5.4", new_routes=False,
    title_order=("DP", "TP", "EP", "PP"), subprocess_watchdog=False,
    watchdog_line="Watchdog timeout (self.watchdog_timeout={timeout})",
    sigquit_line="Received sigquit from a child process. It usually means the child failed.",
)
SHAPES = {s.name: s for s in (CURRENT, V0_5_4)}
