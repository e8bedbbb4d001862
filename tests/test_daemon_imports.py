"""What the running daemon imports (issue 17: its RSS). `stallwatch run --config FILE` ticks
without the command-line framework (typer, click, rich), without prometheus_client and
http.client (the SGLang server probe imports them when a job has a server), and without an
alert sink's HTTP stack (urllib.request, ssl, slack_sdk) until it sends. Each of them is
megabytes of RSS for the daemon's whole life, and one top-level import anywhere brings it back
silently: these tests say which one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stallwatch.commands import cli, entry
from stallwatch.kernel import nvml

ROOT = Path(__file__).resolve().parents[1]

# Modules the daemon's run path must not import: (module, what brought it in last time).
NOT_IMPORTED = {
    "typer": "the CLI (stallwatch.commands.cli): run --config goes through commands/entry.py",
    "click": "the CLI",
    "rich": "the CLI",
    "stallwatch.commands.cli": "the CLI",
    "prometheus_client": "probes/server.py's metrics parser, at module level",
    "http.client": "probes/server.py's requests, at module level",
    "ssl": "http.client or urllib.request, at module level",
    "urllib.request": "alerts/webhook.py, at module level",
    "slack_sdk": "alerts/slack.py's client, built with the sink",
    "stallwatch.engine.ruletest": "engine/__init__.py (`stallwatch rules test` only)",
    "stallwatch.sglang.ptfile": "sglang/__init__.py (torch.save files: the templates' clients)",
}

# The daemon in a subprocess, through the console script's entry point, for three ticks and
# until it has tried NVML; then the names in sys.modules. One Slack and one webhook sink are
# configured (never sent to: nothing fires that soon), so building sinks is on the path too.
SCRIPT = textwrap.dedent("""
    import json, os, sys
    from stallwatch.daemon import core
    from stallwatch.kernel import nvml

    ticks = [0]
    tick = core.Daemon.tick

    def counted(self):
        tick(self)
        ticks[0] += 1
        # After the gpu probe's first NVML init (its own thread): pynvml's import is there.
        if ticks[0] >= 3 and nvml.default_nvml().status is not None or ticks[0] == 150:
            print(json.dumps([nvml.default_nvml().status, sorted(sys.modules)]), flush=True)
            os._exit(0)

    core.Daemon.tick = counted
    from stallwatch.commands.entry import main
    main(["run", "--config", sys.argv[1]])
""")


def test_the_daemons_run_path_imports_none_of_the_lazy_modules(tmp_path: Path) -> None:
    job = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "job.pid").write_text(f"{job.pid}\n")
        cfg = tmp_path / "sw.toml"
        cfg.write_text(textwrap.dedent(f"""
            [daemon]
            interval_s = 0.2
            state_dir = "{tmp_path}/state"
            evidence = false
            dry_run = true

            [[job]]
            name = "j"
            pid_file = "{tmp_path}/job.pid"

            [[alert]]
            type = "slack"
            url = "https://hooks.slack.com/services/T0/B0/notarealsecret"

            [[alert]]
            type = "webhook"
            url = "http://127.0.0.1:9/hook"
        """))
        cfg.chmod(0o644)
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(cfg)], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)
    finally:
        job.kill()
        job.wait()
    assert out.returncode == 0, out.stderr
    status, names = json.loads(out.stdout.splitlines()[-1])
    assert status is not None, "the gpu probe never tried NVML"
    modules = set(names)
    assert "stallwatch.probes.server" in modules  # the run path did run (the collector's probes)
    not_imported = dict(NOT_IMPORTED)
    if not nvml._library_loads():  # a host without NVML's library: no pynvml either
        not_imported["pynvml"] = "kernel/nvml.py's init, before it knew the library is there"
    found = {m: why for m, why in not_imported.items()
             if m in modules or any(n.startswith(m + ".") for n in modules)}
    assert not found, f"imported by the running daemon: {found}"


@pytest.mark.parametrize("args", [
    ["run", "--config", "{d}/missing.toml"],
    ["run", "--config={d}/missing.toml"],
    ["run", "--config", "{d}/open.toml"],
    ["run", "--config", "{d}/bad.toml"],
])
def test_run_config_says_what_the_cli_says(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           args: list[str]) -> None:
    """The short path of `run --config FILE` answers every error as the full CLI does."""
    (tmp_path / "open.toml").write_text("[daemon]\n")
    (tmp_path / "open.toml").chmod(0o666)
    (tmp_path / "bad.toml").write_text("[daemon]\ninterval_s = -1\n")
    (tmp_path / "bad.toml").chmod(0o644)
    argv = [a.format(d=tmp_path) for a in args]
    assert entry.daemon_config(argv) is not None
    answers = []
    for main in (entry.main, cli.main):
        with pytest.raises(SystemExit) as e:
            main(argv)
        answers.append((e.value.code, capsys.readouterr()))
    assert answers[0] == answers[1]
    assert answers[0][0] == 3 and answers[0][1].err.startswith("stallwatch: ")


@pytest.mark.parametrize("argv", [
    ["run"], ["run", "--config"], ["run", "--config", ""], ["run", "--config", "--dry-run"],
    ["run", "--config", "x.toml", "--dry-run"], ["run", "--dry-run", "--config", "x.toml"],
    ["status", "--config", "x.toml"], ["run", "--", "sleep", "1"], ["--help"], [],
])
def test_every_other_command_line_goes_to_the_cli(argv: list[str]) -> None:
    assert entry.daemon_config(argv) is None


NO_LIBRARY = textwrap.dedent("""
    import ctypes, sys
    import pynvml
    from stallwatch.kernel import nvml

    def missing(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    pynvml.CDLL = missing  # as on a host without the driver (pynvml: `from ctypes import *`)
    nvml.NVML_LIBRARY = "libstallwatch-no-such-nvml.so.1"
    real = nvml.Nvml(lib=pynvml)
    short = nvml.Nvml()
    print(repr((real.init(), real.error)))
    print(repr((short.init(), short.error)))
""")


def test_without_nvmls_library_the_init_says_what_pynvml_says() -> None:
    """No pynvml import where its library does not load, and the same status and error."""
    out = subprocess.run([sys.executable, "-c", NO_LIBRARY], capture_output=True, text=True,
                         timeout=60, check=True)
    real, short = out.stdout.splitlines()
    assert real == short
    assert "no_library" in short and "NVML Shared Library Not Found" in short
