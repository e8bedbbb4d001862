"""`stallwatch run` with real supervised jobs: the daemon as a subprocess, a real writer of
`.pt`-style zip files (tests/jobs/pt_writer.py), real faults, real kills.

Every wait is on an event — a state-database row, a daemon log line, a /proc state — with a
deadline; never a bare sleep. Rules: the stall tests use a copy of the built-in rules with small
thresholds (the defaults wait 20 s for a stall, by contract); the crash-loop and re-attach tests
run on the default rules.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stallwatch.actions.filecheck import validate_file

from daemonkit import Harness, fast_rules, scan_writers, start_ticks
from rigs import wait_until

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------------- tests

def test_deadlock_mid_write_killed_quarantined_resumed(h: Harness, tmp_path: Path) -> None:
    h.write_config(["--count", "12", "--interval", "0.1", "--deadlock-at", "5",
                    "--once", str(tmp_path / "fault-fired")],
                   rules=fast_rules(tmp_path / "rules"), job="max_restarts = 2\nstartup_grace_s = 2")
    t0 = time.monotonic()
    daemon = h.start()
    # The writer deadlocks half-way through data_5.pt: detected as a hang, killed, the truncated
    # file quarantined, the job restarted, and it finishes.
    h.wait_phase("finished", 60)
    took = time.monotonic() - t0
    assert h.job()["restarts"] == 1
    inc, = h.incidents()
    assert inc["kind"] == "hang" and inc["state"] == "resolved" and inc["evidence_bundle"]
    whats = [a["what"] for a in h.actions() if a["incident_id"] == inc["id"]]
    assert whats[:1] == ["detect"] and {"evidence", "kill", "validate", "restart", "resolve"} <= set(whats)
    assert whats.index("kill") < whats.index("validate") < whats.index("restart")
    kill, = h.actions("kill")
    assert kill["outcome"].startswith("done")
    # every output present exactly once, each a whole archive; the half-written one is aside
    h.assert_outputs_complete(12)
    q = h.state / "quarantine" / "extract"  # root's side of the trust boundary (docs/security.md)
    assert sorted(p.name for p in q.iterdir()) == ["MANIFEST.jsonl", "data_5.pt"]
    assert not validate_file(q / "data_5.pt").ok
    assert "data_5.pt" in h.actions("validate")[0]["outcome"]
    assert Path(inc["evidence_bundle"], "verdict.json").exists()
    # status --json: docs/contract.md
    doc = h.status_json()
    j, = doc["jobs"]
    assert {"name", "verdict", "restarts", "pid", "incidents"} <= set(j)
    assert j["name"] == "extract" and j["restarts"] == 1 and j["verdict"]["kind"] == "finished"
    i, = j["incidents"]
    assert {"kind", "started_at", "resolved_at", "actions"} <= set(i) and i["kind"] == "hang"
    assert i["resolved_at"] >= i["started_at"] > 0
    assert [a["what"] for a in i["actions"]] == whats
    assert doc["daemon"]["running"] is True
    assert h.stop(daemon) == 0
    print(f"deadlock → finished in {took:.1f} s")


def test_crash_loop_restarted_max_times_then_stopped_with_alert(h: Harness, webhook) -> None:
    url, events = webhook
    # Default rules: a crash is judged at once (no `for`).
    h.write_config(["--crash-always", "--interval", "0.05"],
                   job="max_restarts = 2",
                   alerts=f'[[alert]]\ntype = "webhook"\nurl = "{url}"\nretry_initial_s = 0.2\n')
    daemon = h.start()
    wait_until(lambda: h.phase() == "stopped", 60, "the job to be given up")
    j = h.job()
    assert j["restarts"] == 2
    runs = h.q("SELECT * FROM runs ORDER BY id")
    assert len(runs) == 3 and all(r["returncode"] == 1 for r in runs)
    incs = h.incidents()
    assert [i["kind"] for i in incs] == ["crash"] * 3
    assert [i["state"] for i in incs] == ["resolved", "resolved", "open"]
    assert "restart budget used up (2 of max_restarts = 2)" in incs[-1]["note"] or \
        "gave up" in incs[-1]["note"]
    give_up, = h.actions("give_up")
    assert "restart budget used up" in give_up["outcome"] and "left stopped" in give_up["outcome"]
    # the alerts: each crash fired; the two that were restarted resolved; the last one says so
    wait_until(lambda: len(events) >= 5, 20, "five webhook deliveries")
    assert [(e["kind"], e["state"]) for e in events] == [
        ("crash", "firing"), ("crash", "resolved"), ("crash", "firing"), ("crash", "resolved"),
        ("crash", "firing")]
    assert "restart budget used up" in events[-1]["summary"]
    assert all(e["job"] == "extract" and "evidence" in e for e in events)
    # left stopped: no new run appears while the daemon keeps ticking
    ticks = h.ticks()
    wait_until(lambda: h.ticks() >= ticks + 8, 20, "eight more ticks")
    assert len(h.q("SELECT * FROM runs")) == 3 and scan_writers(str(h.dir)) == []
    assert h.status_json()["jobs"][0]["phase"] == "stopped"
    assert h.stop(daemon) == 0


def test_status_after_give_up_shows_the_hang_and_stallwatchs_kill(h: Harness, tmp_path: Path) -> None:
    """Every run deadlocks: hang, killed, restarted once, hang again, killed, given up. `status`
    shows the verdict that led there (hang, "gave up after 1 restart"), not the `crash` by
    SIGTERM that stallwatch's own kill caused, and says who ended the last run."""
    h.write_config(["--count", "12", "--interval", "0.1", "--deadlock-at", "3"],
                   rules=fast_rules(tmp_path / "rules"), job="max_restarts = 1\nstartup_grace_s = 2")
    daemon = h.start()
    h.wait_phase("stopped", 90)
    assert h.job()["restarts"] == 1 and len(h.actions("give_up")) == 1
    assert json.loads(h.job()["verdict_json"])["kind"] == "crash"  # what the last tick saw
    doc = h.status_json()
    j, = doc["jobs"]
    assert j["phase"] == "stopped"
    assert j["verdict"]["kind"] == "hang", j["verdict"]
    assert j["verdict"]["summary"].endswith("; gave up after 1 restart"), j["verdict"]
    assert j["verdict"]["gave_up"]["last_verdict"]["kind"] == "crash"
    assert "restart budget used up" in j["verdict"]["gave_up"]["outcome"]
    last = j["last_exit"]
    assert last["caused_by"] == "stallwatch" and last["returncode"] < 0, last
    assert last["text"].startswith("killed by SIG") and "stallwatch's kill (incident #" in last["text"]
    assert last["incident"] == j["verdict"]["gave_up"]["incident"]
    r = subprocess.run([sys.executable, "-m", "stallwatch", "status", "--config", str(h.cfg),
                        "--state-dir", str(h.state)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200"})
    assert "gave up after 1 restart" in r.stdout and "last exit: killed by SIG" in r.stdout, r.stdout
    assert h.stop(daemon) == 0


@pytest.mark.parametrize("reset_after", ['"2s"', "0"])
def test_a_run_that_stayed_up_resets_the_restart_streak(h: Harness, reset_after: str) -> None:
    """Failures far apart are not a crash loop: a run that stayed up restart_reset_after_s with no
    incident open gives back the whole budget and the shortest backoff. The 30-minute soak found
    the budget and the doubling backoff counted over the job's life (its restarts waited 64, 128,
    256, 300 s, and later faults struck a job still waiting). With 0, the old accounting."""
    h.write_config(["--count", "100000", "--interval", "0.05", "--crash-after-s", "3"],
                   job=f'max_restarts = 2\n'
                       f'restart_reset_after_s = {reset_after}')
    daemon = h.start()
    if reset_after == "0":
        h.wait_phase("stopped", 60)
        assert h.job()["restarts"] == 2
        assert "in 0.4 s" in h.daemon_log()  # the second restart waited twice as long
    else:
        wait_until(lambda: (h.job() or {}).get("restarts", 0) >= 4, 90, "a fourth restart")
        assert h.phase() != "stopped" and not h.actions("give_up")
        log = h.daemon_log()
        assert log.count("the restart streak starts over") >= 3, log[-3000:]
        waits = re.findall(r"backoff \(restart \d+ of 2 in ([\d.]+) s\)", log)
        assert len(waits) >= 4 and set(waits) == {"0.2"}, waits
    assert h.stop(daemon) == 0


def test_daemon_sigkilled_mid_run_new_daemon_reattaches(h: Harness, tmp_path: Path) -> None:
    # Default rules. Run 1 crashes half-way through data_3.pt (once), so a restart is counted
    # and a broken file quarantined before the daemon dies.
    h.write_config(["--count", "70", "--interval", "0.1", "--crash-at", "3",
                    "--once", str(tmp_path / "fault-fired")], job="max_restarts = 3")
    first = h.start()
    wait_until(lambda: (j := h.job()) and j["phase"] == "running" and j["restarts"] == 1, 60,
               "the restarted run")
    run2 = h.q("SELECT * FROM runs ORDER BY id")[-1]
    pid, ticks = run2["pid"], run2["start_ticks"]
    wait_until(lambda: "10/70" in h.log.read_text(), 30, "some progress of run 2")
    first.kill()  # SIGKILL: no chance to tidy up
    first.wait(30)
    assert start_ticks(pid) == ticks, "the job outlives its daemon"
    writers = scan_writers(str(h.out))
    assert writers == [(pid, writers[0][1])]

    second = h.start()
    h.wait_log(rf"re-attached to pid {pid} ", 30)
    assert h.job()["restarts"] == 1, "the counter survived"
    assert [w[0] for w in scan_writers(str(h.out))] == [pid], "one copy of the job"
    wait_until(lambda: h.phase() == "finished", 60, "the job to finish under the new daemon")
    assert h.job()["restarts"] == 1
    assert len(h.q("SELECT * FROM runs")) == 2, "no second copy was started"
    assert h.q("SELECT returncode FROM runs ORDER BY id")[-1]["returncode"] == 0
    h.assert_outputs_complete(70)
    q = h.state / "quarantine" / "extract"  # root's side of the trust boundary (docs/security.md)
    assert "data_3.pt" in {p.name for p in q.iterdir()}
    assert h.stop(second) == 0


SIGNAL_RECORDER = """
import signal, sys, time
out = sys.argv[1]
def on(sig, _f):
    with open(out, "a") as f:
        f.write(f"{signal.Signals(sig).name}\\n")
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGCONT):
    signal.signal(s, on)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_reused_pid_is_never_adopted_or_killed(h: Harness, tmp_path: Path) -> None:
    h.write_config(["--count", "1000", "--interval", "0.2"], job="max_restarts = 3")
    first = h.start()
    wait_until(lambda: h.phase() == "running", 30, "the job to run")
    first.kill()
    first.wait(30)
    run = h.q("SELECT * FROM runs ORDER BY id")[-1]
    # The machine "reboots": the job and its wrapper vanish without a word ...
    os.kill(run["wrapper_pid"], signal.SIGKILL)
    os.killpg(run["pgid"], signal.SIGKILL)
    wait_until(lambda: start_ticks(run["pid"]) is None or start_ticks(run["pid"]) != run["start_ticks"], 10,
               "the job to be gone")
    # ... and an unrelated process now holds the job's pid (same pid, another start time).
    record = tmp_path / "signals.txt"
    stranger = subprocess.Popen([sys.executable, "-c", SIGNAL_RECORDER, str(record)],
                                stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert stranger.stdout.readline() == b"ready\n"
        st = start_ticks(stranger.pid)
        conn = sqlite3.connect(h.state / "stallwatch.db")
        conn.execute("UPDATE runs SET pid = ?, pgid = ?, start_ticks = ? WHERE id = ?",
                     (stranger.pid, stranger.pid, st - 1, run["id"]))
        conn.execute("UPDATE jobs SET pid = ?, start_ticks = ?", (stranger.pid, st - 1))
        conn.commit()
        conn.close()
        sf = Path(run["status_file"])
        doc = json.loads(sf.read_text())
        doc.update(pid=stranger.pid, pgid=stranger.pid, start_ticks=st - 1)
        sf.write_text(json.dumps(doc))

        second = h.start()
        h.wait_log(rf"pid {stranger.pid} now belongs to another process", 30)
        # The old run is lost (no exit status): a crash incident, and a restart of the job ...
        wait_until(lambda: len(h.q("SELECT * FROM runs")) == 2 and h.phase() == "running", 30,
                   "the job to be started again")
        inc = h.incidents()[-1]
        assert inc["kind"] == "crash" and "lost" in inc["verdict_json"]
        # ... while the stranger was never signalled, never adopted.
        assert stranger.poll() is None and start_ticks(stranger.pid) == st
        assert not record.exists(), record.read_text()
        new = h.q("SELECT * FROM runs ORDER BY id")[-1]
        assert new["pid"] != stranger.pid and h.job()["pid"] == new["pid"]
        assert h.stop(second) == 0
        assert stranger.poll() is None and not record.exists()
    finally:
        stranger.kill()
        stranger.wait(10)


def test_bad_reload_keeps_old_config_and_sd_notify(h: Harness, tmp_path: Path) -> None:
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    msgs: list[dict[str, str]] = []
    got: queue.Queue[dict[str, str]] = queue.Queue()
    done = threading.Event()

    def drain() -> None:
        # The kernel queues at most net.unix.max_dgram_qlen datagrams (10 by default) and the
        # daemon drops what does not fit (MSG_DONTWAIT): read them as they come, or a test that
        # spends 2.5 s elsewhere under load (ten WATCHDOGs at 4 ticks/s) loses STOPPING=1.
        while not done.is_set():
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            got.put(dict(line.split("=", 1) for line in data.decode().split("\n")))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()

    def expect(key: str) -> dict[str, str]:
        deadline = time.monotonic() + 30
        while True:
            m = got.get(timeout=max(0.0, deadline - time.monotonic()))  # queue.Empty: late
            msgs.append(m)
            if key in m:
                return m

    try:
        h.write_config(["--count", "100000", "--interval", "0.2"])
        daemon = h.start(env={"NOTIFY_SOCKET": str(sock_path)})
        ready = expect("READY")
        assert "extract" in ready["STATUS"]
        expect("WATCHDOG")
        h.wait_log(r"garbage collector: [1-9]\d* start-up objects frozen", 20)  # daemon/gcpolicy.py
        good = h.cfg.read_text()

        h.cfg.write_text(good.replace('restart = "on-failure"', 'restart = "sometimes"'))
        daemon.send_signal(signal.SIGHUP)
        expect("RELOADING")
        expect("READY")
        m = h.wait_log(r"reload failed, keeping the last good configuration: (.*)", 20)
        assert f"{h.cfg}:" in m.group(1) and "job[0].restart" in m.group(1)
        ticks = h.ticks()
        wait_until(lambda: h.ticks() > ticks + 2, 10, "ticks after the bad reload")
        assert daemon.poll() is None and h.phase() == "running"
        assert json.loads(h.job()["config_json"])["restart"] == "on-failure"
        assert h.status_json()["daemon"]["last_reload_error"]

        # A good reload: a second job appears (attached by pid file: never restarted).
        sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
        try:
            (tmp_path / "sleeper.pid").write_text(f"{sleeper.pid}\n")
            h.cfg.write_text(good + f'\n[[job]]\nname = "sleeper"\npid_file = "{tmp_path / "sleeper.pid"}"\n')
            daemon.send_signal(signal.SIGHUP)
            h.wait_log(r"reloaded .*: 2 job\(s\)", 20)
            wait_until(lambda: (j := h.job("sleeper")) and j["pid"] == sleeper.pid, 20,
                       "the new job attached")
            st = h.status_json()
            assert [j["name"] for j in st["jobs"]] == ["extract", "sleeper"]
            assert st["daemon"]["last_reload_error"] is None
            assert "never restarts" in st["jobs"][1]["note"]
        finally:
            sleeper.kill()
            sleeper.wait(10)

        # SIGTERM: the daemon stops (STOPPING=1), the job keeps running.
        pid = h.job()["pid"]
        assert h.stop(daemon) == 0
        expect("STOPPING")
        assert start_ticks(pid) is not None and scan_writers(str(h.out)) != []
        assert "jobs left running" in h.daemon_log()
    finally:
        done.set()
        reader.join(5)
        sock.close()


@pytest.mark.root
def test_writer_frozen_in_d_io_stall_no_second_writer_then_resumed(h: Harness,
                                                                    tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (loop device, mount, fsfreeze)")
    from rigs import RigUnavailable, loop_ext4

    try:
        rig = loop_ext4(16)
        fs = rig.__enter__()
    except RigUnavailable as e:
        pytest.skip(f"no loop-mounted ext4 here: {e}")
    safety = threading.Timer(90, fs.thaw)  # a wedged test must not leave the fs frozen
    safety.daemon = True
    safety.start()
    try:
        out = fs.mnt / "out"
        h.out = out
        h.write_config(["--count", "30", "--interval", "0.15", "--size", "65536", "--chunks", "8"],
                       rules=fast_rules(tmp_path / "rules"), outputs=out,
                       job="max_restarts = 2\nstartup_grace_s = 2")
        daemon = h.start()
        wait_until(lambda: h.log.exists() and "4/30" in h.log.read_text(), 30, "progress")
        (writer, _), = scan_writers(str(out))
        fs.freeze()
        frozen_at = time.monotonic()
        from rigs import wait_for_state
        wait_for_state(writer, "D", 10)
        # io_stall within the bound: 3 s without progress and 2 s in D, `for` 1 s, a tick.
        wait_until(lambda: [i for i in h.incidents() if i["kind"] == "io_stall"], 30,
                   "an io_stall incident")
        detected = time.monotonic() - frozen_at
        assert detected < 12, f"io_stall took {detected:.1f} s"
        assert h.q("SELECT COUNT(*) AS n FROM incidents")[0]["n"] == 1
        # SIGKILL cannot take a task out of D: the kill says so, and the resume waits.
        note = wait_until(lambda: (i := h.incidents()[0]) and i["note"].startswith("unkillable")
                          and i["note"], 30, "the unkillable note")
        assert f"pid {writer} in D" in note and "resume waits" in note
        ticks = h.ticks()
        while h.ticks() < ticks + 12:  # three seconds of ticks: never a second writer
            assert [w[0] for w in scan_writers(str(out))] == [writer]
            assert len(h.q("SELECT * FROM runs")) == 1
            time.sleep(0.05)
        assert h.phase() == "recovering" and h.job()["restarts"] == 0
        fs.thaw()
        wait_until(lambda: h.phase() == "finished", 60, "the job to finish after the thaw")
        assert h.job()["restarts"] == 1
        h.assert_outputs_complete(30)
        qdir = h.state / "quarantine" / "extract"
        moved = [p for p in qdir.iterdir() if p.suffix == ".pt"] if qdir.exists() else []
        for p in moved:
            assert not validate_file(p).ok, f"{p} was quarantined but is whole"
        kill = h.actions("kill")
        assert any(a["outcome"].startswith("unkillable") for a in kill)
        assert h.stop(daemon) == 0
    finally:
        safety.cancel()
        fs.thaw()
        h.cleanup()
        rig.__exit__(None, None, None)


def test_daemon_killed_during_backoff_resumes_the_recovery_counting_once(h: Harness,
                                                                          tmp_path: Path) -> None:
    once = str(tmp_path / "fault-fired")
    h.write_config(["--count", "6", "--interval", "0.05", "--crash-at", "0", "--once", once],
                   job="max_restarts = 3")
    h.cfg.write_text(h.cfg.read_text().replace("restart_backoff_s = 0.2", "restart_backoff_s = 60"))
    first = h.start()
    wait_until(lambda: (j := h.job()) and "backoff" in j["phase_detail"], 30, "the backoff")
    first.kill()
    first.wait(30)
    assert h.job()["restarts"] == 0 and h.phase() == "recovering"
    h.cfg.write_text(h.cfg.read_text().replace("restart_backoff_s = 60", "restart_backoff_s = 0.2"))
    second = h.start()
    h.wait_log(r"resuming the recovery from crash", 30)
    wait_until(lambda: h.phase() == "finished", 60, "the job to finish")
    assert h.job()["restarts"] == 1
    assert len(h.q("SELECT * FROM runs")) == 2
    h.assert_outputs_complete(6)
    assert (h.state / "quarantine" / "extract" / "data_0.pt").exists()
    assert h.stop(second) == 0


def test_a_hanging_job_gives_one_firing_and_one_resolved_alert(h: Harness, webhook, tmp_path: Path) -> None:
    """Issue 5's contract on a real daemon: one alert when the incident fires, one when it
    resolves (here: killed and resumed), however many ticks it lasts in between."""
    url, events = webhook
    h.write_config(["--count", "200", "--interval", "0.05"],
                   rules=fast_rules(tmp_path / "rules"), job="startup_grace_s = 1",
                   alerts=f'[[alert]]\ntype = "webhook"\nurl = "{url}"\nretry_initial_s = 0.2\n')
    daemon = h.start()
    wait_until(lambda: h.log.exists() and "20/200" in h.log.read_text(), 60, "some progress")
    (pid, _), = wait_until(lambda: scan_writers(str(h.out)), 10, "the writer")
    os.kill(pid, signal.SIGSTOP)  # a hang: alive, no progress, not in the kernel
    wait_until(lambda: any(e["state"] == "firing" for e in events), 60, "the firing alert")
    wait_until(lambda: any(e["state"] == "resolved" for e in events), 60, "the resolved alert")
    h.wait_phase("finished", 120)
    ticks = h.ticks()
    wait_until(lambda: h.ticks() >= ticks + 4, 20, "a few more ticks after the job finished")
    hang = [(e["kind"], e["state"]) for e in events if e["kind"] == "hang"]
    assert hang == [("hang", "firing"), ("hang", "resolved")], events
    fired, resolved = [e for e in events if e["kind"] == "hang"]
    assert fired["job"] == "extract" and fired["evidence"] and "stopped" in fired["summary"]
    assert resolved["incident_id"] == fired["incident_id"]
    inc, = [i for i in h.incidents() if i["kind"] == "hang"]
    assert inc["state"] == "resolved" and h.job()["restarts"] == 1
    h.assert_outputs_complete(200)
    assert h.stop(daemon) == 0
