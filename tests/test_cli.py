"""The command line as a user meets it: real subprocesses, real exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stallwatch.probes.trace import read_trace

SW = [sys.executable, "-m", "stallwatch"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*SW, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, needle", [
    (["diagnose", "--pid", "abc"], "--pid"),
    (["diagnose", "--pid", "0"], "--pid"),
    (["diagnose", "--match", "(unclosed"], "--match"),
    (["diagnose", "--progress-regex", "(?P<x>\\d+)", "--pid", "1"], "named group 'done'"),
    (["diagnose", "--server", "not a url", "--pid", "1"], "--server"),
    (["diagnose", "--log", "/", "--pid", "1"], "is a directory"),
    (["diagnose", "--window", "-1", "--pid", "1"], "--window"),
    (["diagnose", "--rules", "/nonexistent/rules.toml", "--pid", "1"], "/nonexistent/rules.toml"),
    (["record", "--out", "/nonexistent/dir/t.jsonl", "--pid", "1", "--duration", "0"], "cannot write trace"),
    (["replay", "/nonexistent/trace.jsonl"], "cannot read trace"),
    (["rules", "check", "/nonexistent.toml"], "/nonexistent.toml"),
    (["no-such-command"], "No such command"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_3(args, needle):
    r = run(*args)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_bad_rule_file_names_file_line_column_and_exits_3(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nname = "x"\nkind = "hang"\nsummary = "s"\ncondition = "lgo.idle_s > 1"\n')
    r = run("rules", "check", str(bad))
    assert r.returncode == 3
    assert f"{bad}:5:" in r.stderr and "lgo" in r.stderr
    r = run("diagnose", "--pid", "1", "--rules", str(bad))
    assert r.returncode == 3 and f"{bad}:5:" in r.stderr


def test_builtin_rules_check_clean():
    r = run("rules", "check")
    assert r.returncode == 0, r.stderr
    assert "rules OK" in r.stdout


def test_python_dash_m_and_help_work():
    r = run("--help")
    assert r.returncode == 0 and "diagnose" in r.stdout and "snapshot" in r.stdout


def test_snapshot_json_reports_every_probe_with_status_and_duration(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("step 5/10\n")
    with subprocess.Popen(["sleep", "60"]) as p:
        try:
            r = run("snapshot", "--pid", str(p.pid), "--log", str(log), "--outputs", str(tmp_path), "--json")
        finally:
            p.kill()
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    names = {x["name"]: x for x in snap["probes"]}
    assert {"processes", "gpu", "log", "outputs", "kmsg", "disks"} <= set(names)
    assert all(x["duration_s"] >= 0 for x in names.values())
    # No GPU in CI: a reported state, not an error.
    assert names["gpu"]["status"] in ("absent", "ok", "denied")
    assert snap["processes"]["processes"][0]["pid"] == p.pid
    assert snap["processes"]["processes"][0]["cmdline"] == "sleep 60"
    assert snap["log"]["progress"]["done"] == 5 and snap["log"]["progress"]["total"] == 10


def test_record_then_replay_round_trip(tmp_path):
    out = tmp_path / "t.jsonl"
    log = tmp_path / "job.log"
    log.write_text("".join(f"step {i}/100\n" for i in range(1, 6)))
    with subprocess.Popen(["sleep", "60"]) as p:
        try:
            r = run("record", "--pid", str(p.pid), "--log", str(log), "--out", str(out),
                    "--duration", "1", "--interval", "0.3")
        finally:
            p.kill()
    assert r.returncode == 0, r.stderr
    header, snaps, _ = read_trace(out)
    assert header["format"] == 1 and len(snaps) >= 3
    assert all(s["processes"]["targets"] == [p.pid] for s in snaps)
    r = run("replay", str(out), "--json")
    assert r.stdout.strip(), r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert rows[0]["kind"] in ("healthy", "unknown", "hang")


def test_a_torn_last_line_of_a_trace_is_ignored(tmp_path):
    src = Path(__file__).parent / "data" / "gpu_h200_stop_kill.jsonl"
    lines = src.read_text().splitlines()[:6]
    t = tmp_path / "torn.jsonl"
    t.write_text("\n".join(lines) + "\n" + lines[5][: len(lines[5]) // 2])
    _, snaps, _ = read_trace(t)
    assert len(snaps) == 5


def test_diagnose_a_pid_that_has_exited_uses_what_outlives_it(tmp_path):
    log = tmp_path / "job.log"
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-c", "import sys\n"
                              "print('step 3/10', file=sys.stderr, flush=True)\n"
                              "raise RuntimeError('CUDA error: an illegal memory access was encountered')"],
                             stderr=err)
    p.wait()
    r = run("diagnose", "--pid", str(p.pid), "--log", str(log), "--json", "--window", "0.5")
    doc = json.loads(r.stdout)
    assert doc["verdict"]["kind"] == "crash", doc["verdict"]
    assert r.returncode == 2
    assert any("illegal memory access" in e["detail"] for e in doc["verdict"]["evidence"])
    assert doc["progress"]["done"] == 3 and doc["progress"]["total"] == 10


def test_diagnose_exit_codes_follow_nagios(tmp_path):
    log = tmp_path / "job.log"
    # A job that finished its work: progress reached the total, process gone.
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-c", "print('step 10/10', flush=True)"], stdout=out)
    p.wait()
    r = run("diagnose", "--pid", str(p.pid), "--log", str(log), "--json", "--window", "0.5")
    assert json.loads(r.stdout)["verdict"]["kind"] == "finished" and r.returncode == 0
    # Nothing to judge a live job by: unknown, exit 3.
    with subprocess.Popen(["sleep", "60"]) as s:
        try:
            r = run("diagnose", "--pid", str(s.pid), "--json", "--window", "0.5")
        finally:
            s.kill()
    assert json.loads(r.stdout)["verdict"]["kind"] == "unknown" and r.returncode == 3


def test_diagnose_json_has_the_contract_keys(tmp_path):
    with subprocess.Popen(["sleep", "60"]) as s:
        try:
            r = run("diagnose", "--pid", str(s.pid), "--json", "--window", "0.5")
        finally:
            s.kill()
    doc = json.loads(r.stdout)
    assert {"verdict", "progress", "processes", "gpus", "disks", "server", "warnings"} <= set(doc)
    assert {"kind", "summary", "evidence", "advice", "cause"} <= set(doc["verdict"])
    assert {"pid", "state", "wchan", "cmdline"} <= set(doc["processes"][0])


def test_diagnose_renders_for_a_person(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("Generating Hidden States:  49%|████▉     | 18380/37312 [4:58:10<5:07:01,  1.03it/s]\r")
    with subprocess.Popen(["sleep", "60"]) as s:
        try:
            r = subprocess.run([*SW, "diagnose", "--pid", str(s.pid), "--log", str(log), "--window", "0.5"],
                               capture_output=True, text=True, timeout=60,
                               env={**os.environ, "COLUMNS": "120"})
        finally:
            s.kill()
    assert "18380/37312" in r.stdout and "sleep 60" in r.stdout


def test_record_a_job_named_in_a_daemon_config(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("step 3/10\n")
    cfg = tmp_path / "sw.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n\n[[job]]\nname = "sleeper"\n'
                   f'match = "sleep 4243"\nlog = "{log}"\n')
    cfg.chmod(0o644)
    out = tmp_path / "t.jsonl.gz"
    with subprocess.Popen(["sleep", "4243"]) as p:
        try:
            r = run("record", "--config", str(cfg), "--out", str(out), "--duration", "0.5", "--interval", "0.25")
        finally:
            p.kill()
    assert r.returncode == 0, r.stderr
    _header, snaps, _ = read_trace(out)
    assert snaps and snaps[-1]["target"]["name"] == "sleeper"
    assert snaps[-1]["processes"]["targets"] == [p.pid]
    r = run("record", "--config", str(cfg), "--job", "nope", "--out", str(out))
    assert r.returncode == 3 and "no [[job]] named 'nope'" in r.stderr
