"""`stallwatch alert test`: a sample io_stall alert through every configured sink, one result line
per sink, exit 0 when all delivered, 2 otherwise, 3 on config errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stallwatch.alerts.redact import REDACTOR
from stallwatch.commands.cli import main

from alertkit import SLACK_PATH, Reply


@pytest.fixture(autouse=True)
def _forget():
    yield
    REDACTOR.forget_all()


def run(args: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(args)
    return int(e.value.code)


def test_all_sinks_ok(receiver_factory, tmp_path: Path, monkeypatch, capsys) -> None:
    slack = receiver_factory()
    hook = receiver_factory()
    monkeypatch.setenv("SLACK_WEBHOOK_URL", slack.url(SLACK_PATH))
    out = tmp_path / "stdin.json"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"""
[[alert]]
type = "slack"

[[alert]]
type = "webhook"
name = "ops-hook"
url = "{hook.url('/ops')}"
kinds = ["crash"]          # a test alert goes through filters all the same

[[alert]]
type = "command"
argv = ["{sys.executable}", "-c", "import sys; open({str(out)!r}, 'w').write(sys.stdin.read())"]
""")
    assert run(["alert", "test", "--config", str(cfg)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "slack: ok  [Slack incoming webhook ***]"
    assert lines[1] == f"ops-hook: ok  [POST http://127.0.0.1:{hook.port}/***]"
    assert lines[2].startswith("command: ok  [run ")
    msg = slack.requests[0].json()
    assert msg["blocks"][0]["text"]["text"].startswith("\U0001F9EA [TEST] I/O stall")
    doc = hook.requests[0].json()
    assert doc["test"] is True and doc["kind"] == "io_stall" and doc["state"] == "firing"
    assert json.loads(out.read_text())["test"] is True


def test_a_failing_sink_exits_2(receiver_factory, tmp_path: Path, capsys) -> None:
    good = receiver_factory()
    bad = receiver_factory([Reply(403, "action_prohibited")])
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"""
[[alert]]
type = "webhook"
url = "{good.url()}"

[[alert]]
type = "slack"
url = "{bad.url(SLACK_PATH)}"
""")
    assert run(["alert", "test", "--config", str(cfg), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    assert doc["sinks"][0] == {"name": "webhook", "type": "webhook", "target": f"POST http://127.0.0.1:{good.port}/***",
                               "ok": True, "error": None}
    assert doc["sinks"][1]["error"] == "Slack answered HTTP 403: action_prohibited"


def test_missing_secret_exits_2_with_the_reason(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[alert]]\ntype = "slack"\ncredential = "slack-webhook"\n')
    assert run(["alert", "test", "--config", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("slack: failed: credential 'slack-webhook': $CREDENTIALS_DIRECTORY is not set")


def test_timeout_while_a_sink_hangs(receiver_factory, tmp_path: Path, capsys) -> None:
    slow = receiver_factory([Reply(hang=True)])
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[[alert]]\ntype = "webhook"\nurl = "{slow.url()}"\ntimeout_s = 30\n')
    try:
        assert run(["alert", "test", "--config", str(cfg), "--timeout", "0.5"]) == 2
    finally:
        slow.release()
    assert "webhook: failed: not delivered within 0.5 s" in capsys.readouterr().out


@pytest.mark.parametrize("body,message", [
    ('[[alert]]\ntype = "slak"\n', "alert[0].type: unknown sink type 'slak'"),
    ('[[alert]]\ntype = "webhook"\nurl = "https://x/y"\n[[alert]]\ntype = "command"\n', "alert[1].argv: required"),
    ("[daemon]\ninterval_s = 1\n", "no [[alert]] tables: nothing to test"),
])
def test_config_errors_exit_3(tmp_path: Path, capsys, body: str, message: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(body)
    assert run(["alert", "test", "--config", str(cfg)]) == 3
    err = capsys.readouterr().err
    assert err.startswith(f"stallwatch: {cfg}") and message in err


def test_unknown_sink_name_and_missing_file_exit_3(tmp_path: Path, capsys) -> None:
    assert run(["alert", "test", "--config", str(tmp_path / "nope.toml")]) == 3
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[alert]]\ntype = "desktop"\nname = "laptop"\n')
    assert run(["alert", "test", "--config", str(cfg), "--sink", "phone"]) == 3
    assert "--sink phone: no such [[alert]] (names: laptop)" in capsys.readouterr().err


def test_console_script_and_python_m(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[alert]]\ntype = "command"\nargv = ["true"]\n')
    r = subprocess.run([sys.executable, "-m", "stallwatch", "alert", "test", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("command: ok")
