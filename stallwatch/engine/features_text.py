"""How numbers read in the variables and the summaries: bytes, durations, lists of ranks."""

from __future__ import annotations




def _ranges(xs: list[int]) -> str:
    xs = sorted(xs)
    if len(xs) > 1 and xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}–{xs[-1]}" if len(xs) > 2 else f"{xs[0]} and {xs[1]}"
    return ", ".join(map(str, xs[:-1])) + f" and {xs[-1]}" if len(xs) > 1 else str(xs[0])


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def human_s(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"
