"""Security, the bounds and rendering half of issue 22 (#8–#12), at the unit level.

What the job's user controls (process names, file names, log lines, how many processes and
threads it runs, connections to the loopback metrics port) must neither exhaust the daemon nor
come out as markup or an evaluation failure. The attacks run for real as uid 65534 under a root
daemon are in tests/test_security_attacks_bounds.py.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
from test_alerts_http import SLACK_PATH, dispatcher, event, receiver_factory  # noqa: F401

from stallwatch.alerts.slack import slack_message

# ----------------------------------------------------------------------------- #11 Slack


CHANNEL = "<!channel>"


def _no_markup(text: str) -> None:
    """No control sequence a job's user could have planted: every <, > and & is escaped."""
    assert "<!" not in text and "<http" not in text and "<@" not in text
    assert CHANNEL not in text


def test_slack_escapes_everything_the_job_names(receiver_factory) -> None:  # noqa: F811
    rx = receiver_factory()
    d = dispatcher([{"type": "slack", "url": rx.url(SLACK_PATH), "mention": "<!here>"}])
    hostile = f"{CHANNEL} <http://evil.example|click> & <@U123>"
    try:
        d.submit(event(summary=f"process {hostile} exited 1", job="job<!channel>",
                       host="h<!everyone>", cause=hostile, evidence_bundle=f"/x/{hostile}",
                       advice=(hostile,), actions=(hostile,)))
        d.submit(event(state="resolved", summary=hostile, job="job<!channel>"))
        firing, resolved = (r.json() for r in rx.wait_for(2))
    finally:
        d.close()
    # The admin's own mention stays live; nothing else is markup.
    assert firing["text"].startswith("<!here> ")
    _no_markup(firing["text"][len("<!here> "):])
    assert "&lt;!channel&gt;" in firing["text"] and "&amp;" in firing["text"]
    assert firing["blocks"][1]["text"]["text"].startswith("<!here> ")
    rest = [firing["blocks"][0]["text"]["text"], firing["blocks"][1]["text"]["text"][8:]]
    for b in firing["blocks"][1:]:
        rest += [f["text"] for f in b.get("fields", ())]
        rest += [e["text"] for e in b.get("elements", ())]
        if b is not firing["blocks"][1] and "text" in b:
            rest.append(b["text"]["text"])
    for t in rest:
        _no_markup(t)
    _no_markup(resolved["text"])
    for b in resolved["attachments"][0]["blocks"]:
        for t in [b.get("text", {}).get("text", "")] + [e["text"] for e in b.get("elements", ())]:
            _no_markup(t)


def test_slack_message_escapes_top_level_text_without_a_mention() -> None:
    msg = slack_message(event(summary="a & b <!channel>"))
    assert msg["text"].endswith(": a &amp; b &lt;!channel&gt;")
