"""Secrets never reach logs, JSON output, status, spool files or tracebacks.

The end-to-end test runs Slack (secret URL from the environment) and a webhook with a secret
header against loopback receivers that fail and then succeed, with every logger at DEBUG (the
Slack SDK's included), then greps the captured logs, status JSON, `alert test --json` output and
every file the test wrote for the secret.
"""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest

from stallwatch.alerts.redact import REDACTOR, RedactingFilter, redact, redact_traceback, register_secret
from stallwatch.commands.cli import main

from alertkit import FAST, SECRET_TOKEN, SLACK_PATH, Reply, dispatcher, event

HEADER_SECRET = "hdr-SECRET-0123456789"


@pytest.fixture(autouse=True)
def _forget():
    yield
    REDACTOR.forget_all()


@pytest.mark.parametrize("text,expected", [
    ("post https://hooks.slack.com/services/T01/B02/abcDEF123 failed",
     "post https://hooks.slack.com/services/*** failed"),
    ("url='https://hooks.slack.com/workflows/T1/A2/3/xyz'", "url='https://hooks.slack.com/workflows/***'"),
    ("token xoxb-1234-5678-abcdefgh in use", "token xoxb-*** in use"),
    ("https://user:pa55word@example.com/x", "https://***@example.com/x"),
    ("https://example.com/hook?token=abc123&x=1", "https://example.com/hook?token=***&x=1"),
    ("Authorization: Bearer eyJhbGciOi.abc.def", "Authorization: Bearer ***"),
    ("nothing secret here", "nothing secret here"),
])
def test_patterns(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_registered_values_are_masked() -> None:
    register_secret("http://127.0.0.1:8080/private/route-42")
    register_secret("abc")  # too short to mask safely: ignored
    assert redact("POST http://127.0.0.1:8080/private/route-42 timed out") == "POST *** timed out"
    assert redact("abc") == "abc"


def test_filter_redacts_message_args_and_traceback(caplog) -> None:
    secret = "https://hooks.slack.com/services/T9/B9/tracebackSecret"
    lg = logging.getLogger("test.alerts.redact")
    lg.addFilter(RedactingFilter())
    try:
        raise RuntimeError(f"cannot post to {secret}")
    except RuntimeError:
        with caplog.at_level(logging.DEBUG, logger="test.alerts.redact"):
            lg.error("sending to %s", secret, exc_info=True)
    text = caplog.text
    assert "tracebackSecret" not in text
    assert "sending to https://hooks.slack.com/services/***" in text
    assert "RuntimeError: cannot post to https://hooks.slack.com/services/***" in text
    try:
        raise ValueError(secret)
    except ValueError as e:
        assert "tracebackSecret" not in redact_traceback(e)


def test_no_secret_anywhere(receiver_factory, tmp_path: Path, monkeypatch, caplog, capsys) -> None:
    slack = receiver_factory([Reply(500, "oops"), Reply(200, "ok")])
    hook = receiver_factory([Reply(429, "slow down", {"Retry-After": "0"}), Reply(200, "ok")])
    secret_url = slack.url(SLACK_PATH)
    monkeypatch.setenv("SLACK_WEBHOOK_URL", secret_url)
    out = tmp_path / "cmd.json"
    recorder = tmp_path / "rec.py"
    recorder.write_text(textwrap.dedent("""
        import json, os, sys
        json.dump({k: v for k, v in os.environ.items() if k.startswith("STALLWATCH_")} | {"stdin": sys.stdin.read()},
                  open(sys.argv[1], "w"))
    """))
    tables = [
        {"type": "slack", **FAST},
        {"type": "webhook", "url": hook.url("/in"), "headers": {"X-Api-Key": HEADER_SECRET}, **FAST},
        {"type": "desktop", "mode": "spool", "spool_dir": str(tmp_path / "spool")},
        {"type": "command", "argv": [sys.executable, str(recorder), str(out)]},
    ]
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="stallwatch.alerts.slack_sdk")  # the SDK logs the URL at DEBUG
    d = dispatcher(tables)
    try:
        d.submit(event())
        d.submit(event(state="resolved"))
        assert d.flush(10)
        status = json.dumps(d.status())
    finally:
        d.close()
    assert json.loads(status)["sinks"][0]["sent"] == 2
    assert json.loads(status)["sinks"][0]["retries"] == 1
    assert "hooks" not in status  # the loopback stands in for Slack; its path is the secret

    # the same set-up through `stallwatch alert test --json`
    cfg = tmp_path / "stallwatch.toml"
    cfg.write_text("\n".join(
        ["[[alert]]\ntype = \"slack\"\nretry_initial_s = 0.05",
         f"[[alert]]\ntype = \"webhook\"\nurl = \"{hook.url('/in')}\"\n"
         f"headers = {{\"X-Api-Key\" = \"{HEADER_SECRET}\"}}"]))
    with pytest.raises(SystemExit) as e:
        main(["alert", "test", "--config", str(cfg), "--json"])
    assert e.value.code == 0
    cli_out = capsys.readouterr()
    assert json.loads(cli_out.out)["ok"] is True

    blobs = {"logs": caplog.text + "\n".join(str(r.args) + str(r.msg) for r in caplog.records),
             "status": status, "cli": cli_out.out + cli_out.err}
    for f in tmp_path.rglob("*"):
        if f.is_file() and f != cfg:  # the config itself holds the header secret, by design
            blobs[str(f)] = f.read_text(errors="replace")
    assert any("/services/***" in b or "***" in b for b in blobs.values())
    assert len(slack.requests) >= 3 and len(hook.requests) >= 3
    for where, text in blobs.items():
        assert SECRET_TOKEN not in text, f"Slack URL secret in {where}"
        assert secret_url not in text, f"Slack URL in {where}"
        assert HEADER_SECRET not in text, f"header secret in {where}"
    # what the receiver got still has it (it is only kept out of our own output)
    assert hook.requests[0].headers["X-Api-Key"] == HEADER_SECRET


def test_invalid_slack_url_error_is_redacted() -> None:
    # slack_sdk raises SlackRequestError("Invalid URL detected: <url>") for a non-http URL
    from stallwatch.alerts.config import parse_alerts
    from stallwatch.alerts.slack import SlackSink

    c = parse_alerts([{"type": "slack", "url": "https://hooks.slack.com/services/T1/B1/zzzSECRETzzz"}], "t")[0]
    sink = SlackSink(c)
    sink._client.url = "hxxps://hooks.slack.com/services/T1/B1/zzzSECRETzzz"
    with pytest.raises(Exception) as e:
        sink.deliver(event())
    assert "zzzSECRETzzz" not in str(e.value)
    assert "zzzSECRETzzz" not in redact_traceback(e.value)
