"""The layout of the package holds (docs/README.md, "How the code is laid out"; issue 21).

Read from the source with `ast`, nothing imported, so a violation is found wherever it sits
(a function-local import, one under `if TYPE_CHECKING:`, a path in a rarely run branch).

1. Only `stallwatch/kernel/` knows where the kernel's files are. Outside it, a module must not
   - hold a string literal (each literal part of an f-string counts as one) that is `/proc`,
     `/sys` or `/dev/kmsg` or starts with one of them followed by `/`, except a docstring (a
     string that is a statement of its own) and an argument of a `.startswith(...)` call: that
     classifies a path someone else named (an open file of the job under /proc), it reads none;
   - read the `.proc` or `.sys` attribute of a Roots (a name or attribute ending in `roots`):
     those are directories, good only for building a path under them;
   - call `.pid_dir(...)`, the Roots' own path builder.
   `roots.kmsg` stays usable as it is: it names one file whole, nothing is built from it.
   `stallwatch/sglang/` is not checked: it stands in for SGLang, which reads /proc itself (its
   process-tree kill), and it imports nothing of stallwatch (rule 3).
2. The stallwatch modules import each other without a cycle, counting every import statement
   (module level, function level and under TYPE_CHECKING alike): `from P import name` counts as
   an import of `P.name` when that is a module, else of `P`.
3. No import runs back up the flow: each module belongs to a stage, by its folder,
       root (model, clock, errors, vocab) < kernel < probes < engine < actions, alerts
       < daemon < commands
   and imports only modules of its own or an earlier stage. `stallwatch/__main__.py` is the
   package's entry point and belongs to `commands`. `stallwatch/sglang/` is the stand-in SGLang
   server, a side package: it imports nothing of stallwatch outside itself, and the pipeline
   below the commands may import only its two shared vocabularies (`sglang.titles`: the process
   titles SGLang sets, `sglang.serverlog`: the lines it logs); the commands import any of it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "stallwatch"
STAGES = ("root", "kernel", "probes", "engine", "actions", "daemon", "commands")
RANK = {name: i for i, name in enumerate(STAGES)} | {"alerts": STAGES.index("actions")}
SGLANG_SHARED = {"stallwatch.sglang.titles", "stallwatch.sglang.serverlog"}
KERNEL_PREFIXES = ("/proc", "/sys", "/dev/kmsg")

def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _rel(path: Path) -> str:
    return str(path.relative_to(PKG.parent))


# ------------------------------------------------------------------------- kernel paths


def _is_kernel_path(s: str) -> bool:
    return any(s == p or s.startswith(p + "/") for p in KERNEL_PREFIXES)


def _roots_like(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.lower().endswith("roots")


def kernel_path_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every way `tree` builds a kernel path (the rule in the docstring)."""
    exempt: set[int] = set()  # ids of docstrings and of string nodes in .startswith() arguments
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            exempt.add(id(node.value))  # a docstring (or a bare string) names, it builds nothing
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "startswith":
            for arg in node.args:
                for sub in ast.walk(arg):
                    exempt.add(id(sub))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in exempt:
            if _is_kernel_path(node.value):
                found.append((node.lineno, f"literal {node.value!r}"))
        elif isinstance(node, ast.Attribute) and node.attr in ("proc", "sys") and _roots_like(node.value):
            found.append((node.lineno, f"roots.{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "pid_dir":
            found.append((node.lineno, "pid_dir()"))
    return sorted(set(found))


def test_kernel_path_rule_sees_what_it_claims():
    """The checker itself: each form it names is found, each exempt form is not."""
    src = '''
open("/proc/stat")
open(f"/proc/{pid}/stat")
x = roots.proc / "net"
y = self.roots.sys / "block"
z = self._roots.pid_dir(3)
k = "/dev/kmsg"
ok1 = path.startswith(("/dev/", "/proc/", "/sys/"))
ok2 = "/procession"
ok3 = roots.kmsg
ok4 = "/dev/shm"
def f():
    "/proc/uptime, read once a tick"
'''
    found = kernel_path_uses(ast.parse(src))
    assert [line for line, _ in found] == [2, 3, 4, 5, 6, 7], found


def test_no_kernel_path_outside_kernel():
    bad = []
    for name, path in MODULES.items():
        rel = _rel(path)
        if name.startswith(("stallwatch.kernel", "stallwatch.sglang")):
            continue
        for line, what in kernel_path_uses(ast.parse(path.read_text(), rel)):
            bad.append(f"{rel}:{line}: {what}")
    assert not bad, ("kernel paths built outside stallwatch/kernel/ (use kernel/proc.py's "
                     "helpers):\n" + "\n".join(bad))


# ------------------------------------------------------------------------- import graph


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path) -> set[str]:
    """Every stallwatch module `module` imports, anywhere in its source."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target
                     for a in node.names]
        else:
            continue
        out |= {n for n in names if n == "stallwatch" or n.startswith("stallwatch.")}
    out.discard(module)
    return out


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def stage(module: str) -> str:
    parts = module.split(".")
    if module == "stallwatch.__main__":
        return "commands"
    if len(parts) == 1 or (len(parts) == 2 and (PKG / f"{parts[1]}.py").exists()):
        return "root"
    return parts[1]


def test_every_module_has_a_stage():
    unknown = {m for m in MODULES if stage(m) not in RANK and stage(m) != "sglang"}
    assert not unknown, f"modules in no stage (add the folder to STAGES and docs/README.md): {unknown}"


def test_imports_follow_the_flow():
    bad = []
    for mod, targets in GRAPH.items():
        s = stage(mod)
        for t in sorted(targets):
            ts = stage(t)
            if s == "sglang":
                ok = ts in ("sglang", "root")
            elif ts == "sglang":
                ok = s == "commands" or t in SGLANG_SHARED
            else:
                ok = RANK[ts] <= RANK[s]
            if not ok:
                bad.append(f"{mod} ({s}) imports {t} ({ts})")
    assert not bad, "imports that run back up the flow:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        n = stack.pop()
                        on_stack.discard(n)
                        comp.append(n)
                        if n == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert not _cycles(GRAPH), f"import cycles: {_cycles(GRAPH)}"
