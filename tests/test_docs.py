"""The documentation keeps up with the code.

- every variable the rules see (`diagnose.schema()`) is named in docs/rules.md's Variables section;
- every built-in rule is named in the runbook of its verdict kind, and every kind has a runbook
  linked from docs/runbooks/README.md and docs/rules.md;
- every CLI command (and each of its options) is in docs/guide.md (or the command's own page);
- every key of the config models (`[daemon]`, `[[job]]`, every `[[alert]]` type) is in
  docs/configuration.md, in the section of its table;
- relative links between the pages point at files that exist.

A failure names what is missing and where it belongs: add it to the page, do not loosen the test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNBOOKS = DOCS / "runbooks"

KINDS = ("healthy", "slow", "hang", "io_stall", "server_hang", "server_down", "crash",
         "gpu_fault", "disk_full", "finished", "unknown")


def _section(path: Path, heading: str) -> str:
    """The text under `heading` (a markdown heading line, any level) up to the next heading of
    the same or a higher level."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(#+)\s+(.*?)\s*$", line)
        if m and m.group(2) == heading:
            level = len(m.group(1))
            out = []
            for nxt in lines[i + 1:]:
                n = re.match(r"^(#+)\s", nxt)
                if n and len(n.group(1)) <= level:
                    break
                out.append(nxt)
            return "\n".join(out)
    raise AssertionError(f"{path.relative_to(ROOT)}: no heading {heading!r}")


def _code_spans(text: str) -> set[str]:
    """Everything written `like this` (inline code)."""
    return set(re.findall(r"`([^`\n]+)`", text))


def _paths(d: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in d.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, dict):
            yield from _paths(value, path + ".")


# ---------------------------------------------------------------------------------- variables

def test_every_variable_is_documented_in_rules_md() -> None:
    from stallwatch.engine.diagnose import schema

    section = _section(DOCS / "rules.md", "Variables")
    assert "TODO" not in section, "docs/rules.md: the Variables section still has a TODO"
    spans = _code_spans(section)
    missing = [p for p in _paths(schema()) if p not in spans]
    assert not missing, ("docs/rules.md, section Variables: document these variables of "
                         f"diagnose.schema() (as `name` in a table row): {missing}")


def test_documented_variables_exist() -> None:
    """The other direction: a documented `group.key` that the schema does not have is a typo or
    a variable that was removed (a rule written from the docs would be refused at load)."""
    from stallwatch.engine.diagnose import schema

    known = set(_paths(schema()))
    groups = {k for k, v in schema().items() if isinstance(v, dict)}
    # Keys of list elements (`it.…` in `each` evidence) and of the dynamic maps are documented
    # as `it.key` or in prose; only dotted names that start with a schema group are checked.
    dynamic = ("proc.states.", "probes.")
    element_lists = {p for p in known if not isinstance(_get(schema(), p), dict)}
    stale = []
    for span in _code_spans(_section(DOCS / "rules.md", "Variables")):
        if not re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", span):
            continue
        if span.split(".")[0] not in groups or span.startswith(dynamic):
            continue
        if span in known:
            continue
        parent = span.rsplit(".", 1)[0]
        if parent in element_lists:  # `gpu.list.index`: a field of the list's elements
            continue
        stale.append(span)
    assert not stale, f"docs/rules.md, Variables: these are not variables of diagnose.schema(): {stale}"


def _get(d: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        d = d[part]
    return d


# ----------------------------------------------------------------------------------- runbooks

def test_every_kind_has_a_runbook_linked_from_the_index_and_rules_md() -> None:
    index = (RUNBOOKS / "README.md").read_text(encoding="utf-8")
    rules_md = (DOCS / "rules.md").read_text(encoding="utf-8")
    for kind in KINDS:
        page = RUNBOOKS / f"{kind}.md"
        assert page.is_file(), f"docs/runbooks/{kind}.md is missing"
        assert f"({kind}.md)" in index, f"docs/runbooks/README.md does not link {kind}.md"
        assert f"(runbooks/{kind}.md)" in rules_md, f"docs/rules.md does not link runbooks/{kind}.md"


def test_every_builtin_rule_is_in_the_runbook_of_its_kind() -> None:
    from stallwatch.engine.diagnose import load

    missing = []
    for rule in load().rules:
        page = RUNBOOKS / f"{rule.kind}.md"
        text = page.read_text(encoding="utf-8") if page.is_file() else ""
        if f"`{rule.name}`" not in text:
            missing.append(f"{rule.name} (kind {rule.kind}) in docs/runbooks/{rule.kind}.md")
    assert not missing, f"built-in rules not named (as `name`) in their runbook: {missing}"


# ---------------------------------------------------------------------------------- the guide

# Commands with a page of their own may document their options there instead of in the guide.
OWN_PAGE = {"demo": "demo.md", "alert test": "alerts.md", "run": "daemon.md", "status": "daemon.md",
            "watch": "run.md", "top": "run.md"}


def _commands() -> Iterator[tuple[str, list[str]]]:
    import typer.main

    from stallwatch.commands.cli import app

    def walk(group, prefix: str) -> Iterator[tuple[str, list[str]]]:
        for name, cmd in sorted(group.commands.items()):
            if getattr(cmd, "hidden", False):
                continue
            if hasattr(cmd, "commands"):
                yield from walk(cmd, f"{prefix}{name} ")
            else:
                opts = [o for p in cmd.params for o in p.opts if o.startswith("--")]
                yield f"{prefix}{name}", opts

    yield from walk(typer.main.get_command(app), "")


def test_every_command_is_in_the_guide() -> None:
    guide = (DOCS / "guide.md").read_text(encoding="utf-8")
    missing = [c for c, _ in _commands() if f"stallwatch {c}" not in guide]
    assert not missing, f"docs/guide.md does not show these commands (as `stallwatch CMD`): {missing}"


def test_every_option_is_documented() -> None:
    guide = (DOCS / "guide.md").read_text(encoding="utf-8")
    missing = []
    for cmd, opts in _commands():
        own = DOCS / OWN_PAGE[cmd] if cmd in OWN_PAGE else None
        other = own.read_text(encoding="utf-8") if own is not None and own.is_file() else ""
        for opt in opts:
            pat = re.compile(re.escape(opt) + r"(?![\w-])")
            if not (pat.search(guide) or pat.search(other)):
                missing.append(f"stallwatch {cmd} {opt}")
    assert not missing, f"options documented neither in docs/guide.md nor on their command's page: {missing}"


# ------------------------------------------------------------------------------ configuration

def _config_models() -> list[tuple[str, Any]]:
    from stallwatch.alerts.config import (
        CommandConfig,
        DesktopConfig,
        SlackConfig,
        WebhookConfig,
    )
    from stallwatch.daemon.config import DaemonConfig, JobConfig

    return [("[daemon]", DaemonConfig), ("[[job]]", JobConfig), ("[[alert]]", WebhookConfig),
            ("[[alert]]", SlackConfig), ("[[alert]]", DesktopConfig), ("[[alert]]", CommandConfig)]


def test_every_config_key_is_in_configuration_md() -> None:
    path = DOCS / "configuration.md"
    missing = []
    for table, model in _config_models():
        spans = _code_spans(_section(path, f"`{table}`"))
        for name, field in model.model_fields.items():
            if field.exclude:
                continue
            if name not in spans:
                missing.append(f"{table} {name} ({model.__name__})")
    assert not missing, f"docs/configuration.md: keys missing from their table's section: {missing}"


def test_configuration_md_names_no_unknown_keys() -> None:
    """A key in a table row of configuration.md that no model has would be refused by the loader."""
    path = DOCS / "configuration.md"
    for table, models in (("[daemon]", ["[daemon]"]), ("[[job]]", ["[[job]]"]),
                          ("[[alert]]", ["[[alert]]"])):
        known = {n for t, m in _config_models() if t in models for n in m.model_fields}
        rows = re.findall(r"^\|\s*`([a-z_0-9]+)`", _section(path, f"`{table}`"), re.MULTILINE)
        unknown = sorted(set(rows) - known)
        assert not unknown, f"docs/configuration.md {table}: rows for unknown keys {unknown}"


# --------------------------------------------------------------------------------------- links

# The pages this test owns; the other pages have owners of their own (a link there to a page
# still being written is theirs to fix).
PAGES = sorted([DOCS / "README.md", DOCS / "guide.md", DOCS / "configuration.md",
                DOCS / "rules.md", DOCS / "performance.md", DOCS / "reliability.md",
                *RUNBOOKS.glob("*.md")])
# Written alongside their features (the demo command, the benchmark suite): links to them are
# expected before they land.
IN_PROGRESS: tuple[str, ...] = ()


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1 -2 for
    repeats."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+\s+(.*?)\s*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_relative_links_resolve(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code blocks hold no links
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file) if file else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    broken = [b for b in broken if not b.split("#")[0].endswith(IN_PROGRESS)]
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_docs_index_lists_every_page() -> None:
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in DOCS.glob("*.md") if p.name != "README.md" and f"({p.name})" not in index]
    assert not missing, f"docs/README.md does not link: {missing}"


def test_configuration_examples_load() -> None:
    """Every TOML example in configuration.md is a valid config."""
    from stallwatch.daemon.config import parse_config

    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```toml\n(.*?)```", text, re.DOTALL)
    assert blocks
    for block in blocks:
        parse_config(block, "docs/configuration.md")
