"""`[[alert]]` tables: the discriminated union, defaults, every error as `file: alert[N].key: problem`,
secret sources (url, url_env, url_file, systemd credential) and secrets kept out of repr/JSON."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from stallwatch.alerts.config import (CommandConfig, DesktopConfig, SecretSourceError, SlackConfig,
                                      WebhookConfig, load_alerts_file, parse_alerts)
from stallwatch.alerts.redact import REDACTOR, redact
from stallwatch.errors import UsageError

SECRET = "https://hooks.slack.com/services/T0AAA/B0BBB/SecretSecretSecret42"


@pytest.fixture(autouse=True)
def _forget():
    yield
    REDACTOR.forget_all()


def one(table: dict):
    return parse_alerts([table], "f.toml")[0]


def err(table: dict | list, file: str = "f.toml") -> str:
    with pytest.raises(UsageError) as e:
        parse_alerts(table if isinstance(table, list) else [table], file)
    return str(e.value)


def test_each_type_and_defaults() -> None:
    w = one({"type": "webhook", "url": "https://example.com/hook", "headers": {"X-A": "1"}})
    assert isinstance(w, WebhookConfig) and w.name == "webhook"
    assert w.timeout_s == 10 and w.send_resolved is True and w.renotify_every_s is None
    assert w.rate_limit_per_min == 20 and w.min_severity == "info" and w.kinds is None
    s = one({"type": "slack"})
    assert isinstance(s, SlackConfig) and s.url is None and s.url_env is None  # SLACK_WEBHOOK_URL
    d = one({"type": "desktop", "user": "alice", "urgency_map": {"warning": 2}})
    assert isinstance(d, DesktopConfig) and d.urgency("warning", "firing") == 2
    assert d.urgency("critical", "firing") == 2 and d.urgency("info", "firing") == 0
    assert d.urgency("critical", "resolved") == 0
    c = one({"type": "command", "argv": ["notify-pager", "--team", "ml"], "timeout_s": 3})
    assert isinstance(c, CommandConfig) and c.argv == ("notify-pager", "--team", "ml")


def test_names_are_unique() -> None:
    cfgs = parse_alerts([{"type": "webhook", "url": "http://a/x"}, {"type": "webhook", "url": "http://b/y"},
                         {"type": "slack", "name": "oncall"}], "f.toml")
    assert [c.name for c in cfgs] == ["webhook", "webhook-2", "oncall"]
    assert err([{"type": "slack", "name": "x"}, {"type": "desktop", "name": "x"}]) == \
        "f.toml: alert[1].name: 'x' is used by another [[alert]]"


@pytest.mark.parametrize("table,message", [
    ({"url": "https://x/y"}, "alert[0].type: required: one of webhook, slack, desktop, command"),
    ({"type": "pager"}, "alert[0].type: unknown sink type 'pager': use one of webhook, slack, desktop, command"),
    ({"type": "webhook"}, "alert[0]: give one of url, url_env, url_file, credential"),
    ({"type": "webhook", "url": "ftp://x"}, "alert[0].url: expected an http(s):// URL"),
    ({"type": "slack", "url_evn": "X"}, "alert[0].url_evn: unknown key (did you mean 'url_env'?)"),
    ({"type": "slack", "url": "https://a/b", "url_env": "X"},
     "alert[0]: give only one of url, url_env, url_file, credential (got url, url_env)"),
    ({"type": "slack", "kinds": ["io-stall"]},
     "alert[0].kinds: unknown verdict kind 'io-stall' (did you mean 'io_stall'?)"),
    ({"type": "slack", "min_severity": "high"},
     "alert[0].min_severity: Input should be 'info', 'warning' or 'critical'"),
    ({"type": "slack", "timeout_s": 0}, "alert[0].timeout_s: Input should be greater than 0"),
    ({"type": "desktop", "urgency_map": {"critical": 5}},
     "alert[0].urgency_map: critical: urgency is 0 (low), 1 (normal) or 2 (critical), got 5"),
    ({"type": "command", "argv": []}, "alert[0].argv: Tuple should have at least 1 item after validation, not 0"),
    ({"type": "command"}, "alert[0].argv: required"),
    ({"type": "slack", "credential": "../etc/x"},
     "alert[0].credential: a credential name, not a path (use url_file for a path)"),
])
def test_errors_name_file_table_and_key(table: dict, message: str) -> None:
    assert err(table) == f"f.toml: {message}"


def test_error_index_counts_tables() -> None:
    assert err([{"type": "desktop"}, {"type": "webhook", "url": 3}]).startswith("f.toml: alert[1].url: ")


def test_secrets_stay_out_of_repr_str_and_json() -> None:
    cfg = one({"type": "slack", "url": SECRET})
    w = one({"type": "webhook", "url": "https://example.com/hook?token=abcdef123456",
             "headers": {"Authorization": "Bearer s3cr3t-t0ken-value"}})
    for text in (repr(cfg), str(cfg), cfg.model_dump_json(), json.dumps(cfg.model_dump(mode="json")),
                 repr(w), w.model_dump_json()):
        assert "SecretSecretSecret42" not in text
        assert "s3cr3t-t0ken-value" not in text and "abcdef123456" not in text
    assert cfg.url.get_secret_value() == SECRET


def test_url_env(monkeypatch) -> None:
    cfg = one({"type": "slack", "url_env": "MY_HOOK"})
    monkeypatch.delenv("MY_HOOK", raising=False)
    with pytest.raises(SecretSourceError, match="url_env: environment variable MY_HOOK is not set"):
        cfg.resolve_url()
    monkeypatch.setenv("MY_HOOK", SECRET)
    assert cfg.resolve_url().get_secret_value() == SECRET
    assert redact(f"posting to {SECRET}/extra") == "posting to ***/extra"  # registered


def test_default_slack_env(monkeypatch) -> None:
    monkeypatch.setenv("SLACK_WEBHOOK_URL", SECRET)
    assert one({"type": "slack"}).resolve_url().get_secret_value() == SECRET


def test_systemd_credential(tmp_path: Path, monkeypatch) -> None:
    cfg = one({"type": "slack", "credential": "slack-webhook"})
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    with pytest.raises(SecretSourceError, match=r"\$CREDENTIALS_DIRECTORY is not set"):
        cfg.resolve_url()
    (tmp_path / "slack-webhook").write_text(SECRET + "\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    assert cfg.resolve_url().get_secret_value() == SECRET
    missing = one({"type": "slack", "credential": "other"})
    with pytest.raises(SecretSourceError) as e:
        missing.resolve_url()
    assert str(e.value) == "credential 'other': cannot read: No such file or directory"


def test_url_file_must_hold_a_url(tmp_path: Path) -> None:
    f = tmp_path / "hook"
    f.write_text("not a url\n")
    with pytest.raises(SecretSourceError) as e:
        one({"type": "webhook", "url_file": str(f)}).resolve_url()
    assert str(e.value) == f"url_file {f}: expected an http(s):// URL"
    assert "not a url" not in str(e.value)


def test_load_alerts_file_and_the_daemon_config(tmp_path: Path) -> None:
    p = tmp_path / "stallwatch.toml"
    p.write_text(textwrap.dedent("""
        [daemon]
        state_dir = "state"

        [[alert]]
        type = "slack"
        credential = "slack-webhook"
        min_severity = "warning"
        renotify_every_s = 3600

        [[alert]]
        type = "command"
        argv = ["logger", "-t", "stallwatch"]
    """))
    cfgs = load_alerts_file(p)
    assert [c.name for c in cfgs] == ["slack", "command"]
    try:
        from stallwatch.daemon.config import load_config
    except ImportError:
        return
    cfg = load_config(p)
    assert [c.name for c in cfg.alerts] == ["slack", "command"]
    assert isinstance(cfg.alerts[0], SlackConfig) and cfg.alerts[0].renotify_every_s == 3600
    p.write_text('[[alert]]\ntype = "slack"\nurl = "nope"\n')
    with pytest.raises(UsageError, match=r"stallwatch.toml(:\d+)?: alert\[0\].url: expected an http\(s\):// URL"):
        load_config(p)
    os.chmod(p, 0o644)


def test_alert_durations_take_the_config_duration_strings():
    from stallwatch.alerts.config import parse_alerts
    from stallwatch.errors import UsageError

    cfg, = parse_alerts([{"type": "webhook", "url": "http://127.0.0.1:9/x", "renotify_every_s": "1h",
                          "timeout_s": "5s", "retry_max_s": "2m"}], "sw.toml")
    assert (cfg.renotify_every_s, cfg.timeout_s, cfg.retry_max_s) == (3600.0, 5.0, 120.0)
    with pytest.raises(UsageError, match=r"alert\[0\]\.renotify_every_s: bad duration"):
        parse_alerts([{"type": "webhook", "url": "http://127.0.0.1:9/x", "renotify_every_s": "1 h"}], "sw.toml")
