"""systemd/stallwatch.service: verified by systemd-analyze where it exists, and read for the
settings a watchdog needs (and those that would blind it, per docs/field.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "stallwatch.service"


def service() -> dict[str, list[str]]:
    """Every key of [Service] with all its values (systemd allows repeats)."""
    out: dict[str, list[str]] = {}
    section = None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            k, _, v = line.partition("=")
            out.setdefault(k, []).append(v)
    return out


def test_unit_settings() -> None:
    s = service()
    assert s["Type"] == ["notify"] and s["Restart"] == ["on-failure"]
    assert s["WatchdogSec"] and s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["StateDirectory"] == ["stallwatch"]
    assert s["KillMode"] == ["process"], "restarting the daemon must never kill setsid jobs"
    assert s["NoNewPrivileges"] == ["yes"] and s["ProtectSystem"] == ["strict"]
    caps = set(s["CapabilityBoundingSet"][0].split())
    assert {"CAP_KILL", "CAP_SYS_PTRACE", "CAP_SYS_ADMIN", "CAP_SYSLOG",
            "CAP_DAC_READ_SEARCH"} <= caps
    # a job's `user`: its first stage drops to it (docs/security.md)
    assert {"CAP_SETUID", "CAP_SETGID"} <= caps
    for forbidden in ("PrivateDevices", "ProtectProc", "ProcSubset", "ProtectKernelLogs",
                      "PrivateTmp", "MemoryDenyWriteExecute"):
        assert forbidden not in s, f"{forbidden} would blind the watchdog (docs/field.md)"
    assert "run --config" in s["ExecStart"][0]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze not installed (apt-get install systemd)")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: point it at this checkout's stallwatch.
    exe = Path(sys.executable).with_name("stallwatch")
    if not exe.exists():
        pytest.skip(f"{exe} not installed")
    unit = tmp_path / "stallwatch.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/stallwatch", str(exe)))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                       timeout=120)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if str(unit) in line]
    assert r.returncode == 0 and problems == [], r.stdout + r.stderr


def test_example_config_is_valid_toml_for_the_unit() -> None:
    # The unit's ExecStart names /etc/stallwatch.toml; the example is what goes there.
    s = service()
    assert "/etc/stallwatch.toml" in s["ExecStart"][0]
    assert (ROOT / "systemd" / "stallwatch.toml.example").exists()
