"""Alert state with a real daemon (`stallwatch run` as a subprocess, a real supervised writer):
a pending `for` timer and a firing alert survive SIGHUP; a `for` timer survives a daemon restart.

The rules are the test's own: always true while the job shows progress (`log.has_progress`),
`warning = true` so that they never decide the verdict or act. What the daemon holds is read from
the state database row it keeps for a restart (`alerts:extract`: state and wall-clock anchors,
daemon/alertmemory.py): an anchor that moves is a timer that started over.
"""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from stallwatch.daemon.alertmemory import ANCHOR_SLACK_S
from rigs import wait_until
from daemonkit import Harness

# A saved anchor is rewritten only when it moves by more than ANCHOR_SLACK_S (or the state
# changes); a timer that started over moves it by seconds.
SAME_S = ANCHOR_SLACK_S + 0.1

pytestmark = pytest.mark.slow


def _rule(name: str, for_: str, summary: str = "held") -> str:
    return (f'[[rule]]\nname = "{name}"\nkind = "slow"\nseverity = "info"\nwarning = true\n'
            f'condition = "log.has_progress"\nfor = "{for_}"\nsummary = "{summary}"\n\n')


BROKEN = ('[[rule]]\nname = "broken"\nkind = "slow"\nseverity = "info"\nwarning = true\n'
          'condition = "log.has_progress && int(log.path) > 0"\nsummary = "never"\n\n')


def _alerts(h: Harness) -> dict[str, dict[str, Any]]:
    rows = h.q("SELECT value FROM meta WHERE key = 'alerts:extract'")
    return {d["rule"]: d for d in json.loads(rows[0]["value"])} if rows else {}


def _start(h: Harness, rules: str):
    rdir = h.dir / "rules"
    rdir.mkdir(exist_ok=True)
    (rdir / "held.toml").write_text(rules)
    h.write_config(["--count", "100000", "--interval", "0.2"], rules=rdir, interval=0.2)
    return rdir / "held.toml", h.start()


def test_a_pending_timer_and_a_firing_alert_survive_sighup(h: Harness) -> None:
    rule_file, daemon = _start(h, _rule("waiting", "1h") + _rule("fired", "1s") + BROKEN)
    before = wait_until(lambda: (a := _alerts(h)) and a.get("fired", {}).get("state") == "firing"
                        and "waiting" in a and a, 60, "one alert pending, one firing")
    assert before["waiting"]["state"] == "pending"
    wait_until(lambda: time.time() - before["waiting"]["active_at"] > 2.0, 30, "2 s of pending")
    # Changed rule files (other summaries): a reload that builds new rules for the job.
    rule_file.write_text(_rule("waiting", "1h", "still") + _rule("fired", "1s", "still") + BROKEN)
    daemon.send_signal(signal.SIGHUP)
    h.wait_log(r"job extract: new rules: 2 alert\(s\) carried over", 30)
    ticks = h.ticks()
    wait_until(lambda: h.ticks() > ticks + 3, 30, "ticks after the reload")
    after = _alerts(h)
    assert after["waiting"] == before["waiting"], "the pending timer started over"
    assert after["fired"] == before["fired"], "the firing alert went back to pending"
    # Each rule's health and last error, in `status` (the broken one's health carried too)
    rules = {r["rule"]: r for r in h.status_json()["jobs"][0]["rules"]}
    assert {n: r["health"] for n, r in rules.items()} == {"waiting": "ok", "fired": "ok",
                                                         "broken": "err"}
    assert rules["broken"]["last_error"].startswith("condition: ")
    assert rules["waiting"]["last_error"] == ""

    # A new `for` shorter than the time already pending: it fires now, from the same timer.
    rule_file.write_text(_rule("waiting", "2s", "still") + _rule("fired", "1s", "still"))
    daemon.send_signal(signal.SIGHUP)
    fired = wait_until(lambda: (a := _alerts(h)).get("waiting", {}).get("state") == "firing" and a,
                       30, "the carried timer to fire under its new `for`")
    assert abs(fired["waiting"]["active_at"] - before["waiting"]["active_at"]) < SAME_S
    assert h.stop(daemon) == 0


def test_a_for_timer_survives_a_daemon_restart(h: Harness) -> None:
    _, first = _start(h, _rule("waiting", "8s"))
    pending = wait_until(lambda: _alerts(h).get("waiting"), 60, "the alert pending")
    wait_until(lambda: h.job()["verdict_at"] - pending["active_at"] >= 3.0, 30, "3 s of pending")
    assert h.stop(first) == 0  # SIGTERM: the job keeps running
    down_at = h.job()["verdict_at"]
    held_s = down_at - pending["active_at"]  # pending time the first daemon saw
    assert 3.0 <= held_s < 8.0
    # the restarted daemon must resume with those 3+ s, not start at 0: it fires within 8 s of
    # observation in all, not 8 s after its first tick
    restarted_at = time.time()
    second = h.start()
    h.wait_log(r"job extract: 1 of 1 saved alert timer\(s\) restored after [\d.]+ s", 30)
    wait_until(lambda: h.job()["verdict_at"] > restarted_at, 30, "a tick of the new daemon")
    resumed = _alerts(h)["waiting"]
    # The timer resumed where it stopped: the outage is not pending time, the time before is.
    outage_s = resumed["active_at"] - pending["active_at"]
    assert outage_s >= restarted_at - down_at - 1.0, "the outage was counted as pending"
    assert resumed["active_at"] <= h.job()["verdict_at"] - held_s + 1.0, "the timer started over"
    fired = wait_until(lambda: (a := _alerts(h)["waiting"])["state"] == "firing" and a, 30,
                       "the alert to fire")
    assert abs(fired["active_at"] - resumed["active_at"]) < SAME_S
    assert fired["fired_at"] - fired["active_at"] >= 8.0  # never early: the outage not counted
    assert h.stop(second) == 0
