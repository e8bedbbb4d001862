"""The human view of a diagnosis: a verdict panel, evidence, progress, GPUs, the process tree."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

STYLE = {"healthy": "green", "finished": "green", "slow": "yellow", "unknown": "magenta",
         "hang": "red", "io_stall": "red", "server_hang": "red", "server_down": "red",
         "crash": "red", "gpu_fault": "red", "disk_full": "red"}


def duration(s: float | None) -> str:
    if s is None or s < 0:
        return "?"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def gib(n: float | None) -> str:
    return "?" if n is None else f"{n / (1 << 30):.1f} GiB"


def render(doc: dict[str, Any], console: Console) -> None:
    v = doc["verdict"]
    style = STYLE.get(v["kind"], "white")
    body = [Text(v["summary"], style="bold")]
    if v.get("cause"):
        body.append(Text(f"cause: {v['cause']}", style=style))
    if v["evidence"]:
        body.append(Text("\nEvidence", style="bold underline"))
        for e in v["evidence"]:
            body.append(Text.assemble(("  • ", style), (f"{e['signal']}: ", "dim"), e["detail"]))
    if v["advice"]:
        body.append(Text("\nWhat to do", style="bold underline"))
        for a in v["advice"]:
            body.append(Text(f"  → {a}"))
    console.print(Panel(Group(*body), title=f"[bold {style}] {v['kind'].upper()} [/]",
                        subtitle=f"{doc['host']} · watched {doc['window_s']:g}s", border_style=style))

    p = doc.get("progress")
    if p:
        total = p["total"]
        line = Table.grid(padding=(0, 1))
        bar = ProgressBar(total=total or 1, completed=p["done"] if total else 0, width=40)
        rate = f"{p['rate_per_s']:.3g}/s" if p["rate_per_s"] is not None else "?/s"
        line.add_row(Text("progress", style="bold"), bar,
                     Text(f"{p['done']:g}/{total:g}" if total else f"{p['done']:g}"),
                     Text(f"{rate} · ETA {duration(p['eta_s'])} · last progress "
                          f"{duration(p['last_progress_age_s'])} ago "
                          f"(stalled after {duration(p['stall_threshold_s'])})", style="dim"))
        console.print(line)

    if doc["gpus"]:
        t = Table(title="GPUs", title_justify="left", show_edge=False)
        for c in ("gpu", "name", "util", "memory", "processes"):
            t.add_column(c)
        for g in doc["gpus"]:
            procs = ", ".join(f"{pr['pid']} ({gib(pr.get('used_bytes'))})" for pr in g.get("processes") or [])
            t.add_row(str(g["index"]), g.get("name") or "?", f"{g.get('util_gpu_pct', '?')}%",
                      f"{gib(g.get('mem_used_bytes'))} / {gib(g.get('mem_total_bytes'))}", procs)
        console.print(t)
    elif doc.get("gpu_status") and doc["gpu_status"] != "ok":
        console.print(Text(f"GPUs: {doc['gpu_status']}", style="dim"))

    if doc["processes"] or doc["exited"]:
        tree = Tree(Text("processes", style="bold"))
        nodes: dict[int, Tree] = {}
        for p in doc["processes"]:
            states: dict[str, int] = {}
            for th in p["threads"]:
                states[th["state"]] = states.get(th["state"], 0) + 1
            st = " ".join(f"{n}{s}" for s, n in sorted(states.items()))
            label = Text.assemble((f"{p['pid']} ", "bold"), (f"[{p['state']}] ", _state_style(p["state"])),
                                  (" ".join(p["cmdline"].split())[:100] or p["comm"]), (f"  threads {st}", "dim"))
            if p.get("wchan"):
                label.append(f"  wchan {p['wchan']}", style="dim")
            parent = nodes.get(p["ppid"], tree)
            node = parent.add(label)
            nodes[p["pid"]] = node
            for th in p["threads"]:
                if th["state"] == "D":
                    node.add(Text(f"tid {th['tid']} D in {th['syscall'] or '?'} wchan {th['wchan'] or '?'}"
                                  + (f" on {th['file']}" if th.get("file") else ""), style="red"))
        for e in doc["exited"]:
            rc = e.get("returncode")
            tree.add(Text(f"{e['pid']} exited ({'status unknown' if rc is None else rc}) {e.get('cmdline') or ''}",
                          style="dim"))
        console.print(tree)

    if doc["disks"]:
        t = Table(title="Filesystems", title_justify="left", show_edge=False)
        for c in ("path", "mount", "device", "free", "used"):
            t.add_column(c)
        for d in doc["disks"]:
            mount = (d.get("mount") or {}).get("mount_point", "?")
            dev = (d.get("device") or {}).get("name") or (d.get("mount") or {}).get("source", "?")
            free = gib(d["free_bytes"]) if d.get("free_bytes") is not None else d.get("detail") or d["status"]
            used = f"{d['used_pct']:.1f}%" if d.get("used_pct") is not None else "?"
            t.add_row(d["path"], mount, dev, free, used)
        console.print(t)

    for w in doc["warnings"]:
        console.print(Text(f"warning: {w['summary']}", style="yellow"))
    for p in doc["probes"]:
        if p["status"] not in ("ok", "absent"):
            console.print(Text(f"probe {p['name']}: {p['status']}: {p.get('error') or ''}", style="dim"))


def _state_style(state: str) -> str:
    return {"D": "bold red", "T": "yellow", "Z": "magenta", "R": "green"}.get(state, "")
