"""SGLang's process titles and command lines, parsed: which process is what, and which rank.

Upstream facts (sgl-project/sglang, read 2026-12; docs/upstream.md §3):

- A scheduler calls itself `sglang::scheduler` plus one part per parallel dimension whose size
  is above 1: `_DP{dp}` (when data parallel), `_PP{pp}`, `_ATTN_CP{cp}`, `_MOE_DP{moe_dp}`,
  `_TP{tp}`, `_EP{ep}`, in that order on current `main` (0.5.6+, `run_scheduler_process`); in
  0.5.0-0.5.5 the order was DP, TP, EP, PP. tp=1 with nothing else: plain `sglang::scheduler`.
  So the rank is the tuple of every part, never "the number after the last _TP" (with expert
  parallelism every rank has an EP part after its TP part, and DP groups repeat TP numbers).
- Other titles: `sglang::detokenizer`, `sglang::data_parallel_controller` (the parent of the
  schedulers when dp > 1), `sglang::tokenizer_worker:PID` (multi-tokenizer mode),
  `sglang::detokenizer_router`.
- Servers start as `python -m sglang.launch_server ...` or with the `sglang serve` CLI.

Pure functions of a string: nothing here reads /proc.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Rank dimensions in the order they key a rank (current upstream's title order).
RANK_PARTS = ("DP", "PP", "ATTN_CP", "MOE_DP", "TP", "EP")
_PART = re.compile(r"_(ATTN_CP|MOE_DP|DP|PP|TP|EP|NP)(\d+)(?=_|$)")
_TITLE = re.compile(r"^sglang::([a-z_]+)(?::(\d+))?((?:_[A-Z_]+\d+)*)$")
ROLES = ("scheduler", "detokenizer", "data_parallel_controller", "tokenizer_worker",
         "detokenizer_router")

# Any SGLang process, whatever started it: a title, the launcher module, the `sglang serve` CLI,
# or stallwatch's own stand-in server.
SERVER_CMDLINE = re.compile(
    r"sglang[./]launch_server|(?:^|/)sglang serve(?:\s|$)"
    r"|sglang::(?:" + "|".join(ROLES) + r")"
    r"|stallwatch[./]sglang[./]protocol_server")
# A process title of one of SGLang's children (their parent is the server).
SGLANG_TITLE = re.compile(r"^sglang::(?:" + "|".join(ROLES) + r")")


@dataclass(frozen=True)
class Title:
    role: str  # scheduler, detokenizer, data_parallel_controller, ...
    parts: tuple[tuple[str, int], ...] = ()  # as written: (("DP", 0), ("TP", 2), ...)
    worker_of: int | None = None  # tokenizer_worker:PID

    @property
    def ranks(self) -> dict[str, int]:
        return dict(self.parts)

    @property
    def key(self) -> tuple[int, ...]:
        """The rank as a tuple in RANK_PARTS order (0 where a dimension is absent): sorts ranks
        and tells DP0_TP1 from DP1_TP1, whichever order the title wrote them in."""
        r = self.ranks
        return tuple(r.get(p, 0) for p in RANK_PARTS)

    @property
    def label(self) -> str:
        """`DP0_TP2_EP2` in the canonical order; `TP0` for a lone scheduler (as SGLang's
        single-rank log lines have no prefix, TP0 is what a person calls it)."""
        r = self.ranks
        text = "_".join(f"{p}{r[p]}" for p in RANK_PARTS + ("NP",) if p in r)
        return text or "TP0"

    @property
    def tp(self) -> int:
        return self.ranks.get("TP", 0)


def parse_title(cmdline: str) -> Title | None:
    """The Title of an SGLang child process from its command line (what setproctitle wrote);
    None for anything else. Unknown parts make it None rather than a wrong rank."""
    text = cmdline.split(" ", 1)[0].strip() if cmdline else ""
    m = _TITLE.match(text)
    if m is None or m[1] not in ROLES:
        return None
    suffix = m[3] or ""
    parts = tuple((p, int(n)) for p, n in _PART.findall(suffix))
    if "".join(f"_{p}{n}" for p, n in parts) != suffix:
        return None  # a part we do not know: do not guess
    return Title(m[1], parts, int(m[2]) if m[2] else None)


def is_server_cmdline(text: str) -> bool:
    return SERVER_CMDLINE.search(text) is not None
