"""Fuzzing the parsers of everything stallwatch reads from outside (hypothesis).

Config and rule files (written by the admin: a mistake must be one clear error with a
location), the job's log, the server's /metrics, /proc and the kernel log (written by the job or
the kernel: anything must be survivable). Property: no exception but the documented ones
(UsageError / RuleLoadError / ValueError), each with a location where one is documented, and
bounded time (hypothesis' deadline per example).
"""

from __future__ import annotations

import math
import re
import string
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stallwatch.kernel import procfs
from stallwatch.clock import FakeClock
from stallwatch.daemon.config import parse_config
from stallwatch.engine import load_rules
from stallwatch.engine.rulefile import RuleLoadError
from stallwatch.errors import UsageError
from stallwatch.kernel.kmsgparse import parse_event, parse_record
from stallwatch.probes.log import LogProbe
from stallwatch.probes.server import parse_metrics
from stallwatch.probes.text.progress import parse_progress

ROOT = Path(__file__).resolve().parents[1]
FAST = settings(max_examples=1000, deadline=1000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# ---------------------------------------------------------------------------- TOML pieces

toml_chars = st.sampled_from(list('[]{}=".,#\n\' \t') + list("abcdefgijklmnoprstuvwxyz_0123456789-+:")
                             + ["daemon", "job", "alert", "rule", "name", "command", "\\", "é",
                                "\x00", '"""', "true", "inf", "nan"])
tomlish = st.lists(toml_chars, max_size=200).map("".join)

scalar = st.one_of(
    st.integers(min_value=-2**63, max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=40),
    st.sampled_from(["1s", "5 m", "-3s", "2h", "0", "1e9", "/tmp", "127.0.0.1:9835", "0.0.0.0:1",
                     "(?P<done>\\d+)", "(?P<done", "[", "http://127.0.0.1:30000", "ftp://x",
                     "on-failure", "no", "always", "webhook", "slack", "command", "desktop"]),
)
value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.sampled_from(["a", "b", "url", "name"]), inner, max_size=3),
                     max_leaves=6)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return '"' + "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}"
                             for c in v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


DAEMON_KEYS = ["interval_s", "state_dir", "metrics_listen", "metrics_textfile", "rules", "dry_run",
               "log_level", "probe_deadline_s", "tick_deadline_s", "evidence", "systemd_run",
               "bogus_key"]
JOB_KEYS = ["name", "command", "pid_file", "match", "cwd", "log", "progress_regex", "outputs",
            "server", "restart", "max_restarts", "restart_backoff_s", "kill_grace_s", "env",
            "startup_grace_s", "dry_run", "rules", "typo_key"]
ALERT_KEYS = ["type", "url", "url_env", "name", "argv", "timeout_s", "min_severity", "kinds"]


@st.composite
def structured_config(draw) -> str:
    parts = []
    if draw(st.booleans()):
        keys = draw(st.lists(st.sampled_from(DAEMON_KEYS), unique=True, max_size=5))
        parts.append("[daemon]\n" + "".join(f"{k} = {toml_value(draw(value))}\n" for k in keys))
    for _ in range(draw(st.integers(0, 3))):
        keys = draw(st.lists(st.sampled_from(JOB_KEYS), unique=True, max_size=7))
        body = "".join(f"{k} = {toml_value(draw(value))}\n" for k in keys)
        if draw(st.booleans()):
            body = 'name = "j"\ncommand = ["true"]\n' + "".join(
                line + "\n" for line in body.splitlines() if not line.startswith(("name ", "command ")))
        parts.append("[[job]]\n" + body)
    for _ in range(draw(st.integers(0, 2))):
        keys = draw(st.lists(st.sampled_from(ALERT_KEYS), unique=True, max_size=4))
        parts.append("[[alert]]\n" + "".join(f"{k} = {toml_value(draw(value))}\n" for k in keys))
    return "\n".join(parts)


def _config_ok_or_located(src: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        try:
            parse_config(src, "fuzz.toml", base=Path(d))
        except UsageError as e:
            msg = str(e)
            assert msg.startswith("fuzz.toml"), msg  # names the file (and line where it can)
            assert "\n" not in msg.strip() or len(msg) < 4000


@FAST
@given(tomlish)
def test_config_loader_on_random_text(src: str) -> None:
    _config_ok_or_located(src)


@FAST
@given(structured_config())
def test_config_loader_on_valid_toml_with_random_values(src: str) -> None:
    _config_ok_or_located(src)


# ---------------------------------------------------------------------------------- rules

RULE_KEYS = ["name", "kind", "severity", "priority", "condition", "for", "keep_firing_for",
             "summary", "advice", "evidence", "cause", "warning", "labels", "oops"]
cel_bits = st.sampled_from(
    ["log.idle_s", ">", "30", "&&", "||", "!", "(", ")", "size(", "gpu.lost", "job.exited",
     "proc.d_quiet_s", "==", "'x'", '"y"', "1.5", "true", "null", "[1,2]", "{'a': 1}", ".", ",",
     "__import__('os')", "exec", "open('/etc/passwd')", "x.__class__", "?", ":", "in", "has(",
     "int(", "string(", "matches(", "'(' ", "\\", "9" * 30, "-", "+", "*", "/", "%"])
cel = st.lists(cel_bits, max_size=12).map(" ".join)


@st.composite
def structured_rules(draw) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        keys = draw(st.lists(st.sampled_from(RULE_KEYS), unique=True, max_size=9))
        lines = []
        for k in keys:
            if k in ("condition", "summary"):
                lines.append(f"{k} = {toml_value(draw(cel))}")
            elif k == "evidence":
                lines.append(f"evidence = [{{signal = {toml_value(draw(st.text(max_size=5)))}, "
                             f"detail = {toml_value('{' + draw(cel) + '}')}}}]")
            else:
                lines.append(f"{k} = {toml_value(draw(value))}")
        parts.append("[[rule]]\n" + "\n".join(lines) + "\n")
    return "\n".join(parts)


def _rules_ok_or_located(src: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "fuzz.toml"
        p.write_text(src, encoding="utf-8", errors="surrogatepass")
        try:
            load_rules([p])
        except RuleLoadError as e:
            assert e.errors and all(str(p) in str(x) for x in e.errors), str(e)


@FAST
@given(tomlish)
def test_rule_loader_on_random_files(src: str) -> None:
    _rules_ok_or_located(src)


@FAST
@given(structured_rules())
def test_rule_loader_on_rule_tables_with_random_fields_and_expressions(src: str) -> None:
    _rules_ok_or_located(src)


# ------------------------------------------------------------------------------ progress

log_chars = st.sampled_from(list("0123456789/%|#█▏▎▍▌ \r\n\t:[],.itsamplerocedGH") +
                            ["it/s", "s/it", " 12/100 ", "100%|", "\x1b[A", "\x00", "\ufffd",
                             "?it/s", "inf", "nan", "-5/3", "1e308/1e308", "99999999999999999999/1"])
log_line = st.one_of(st.text(max_size=200), st.lists(log_chars, max_size=60).map("".join))
REGEXES = [None, r"(?P<done>\d+)/(?P<total>\d+)", r"step (?P<done>\d+)", r"(?P<done>[\d.e+-]+)",
           r"(?P<done>.*)/(?P<total>.*)"]


@FAST
@given(log_line, st.sampled_from(REGEXES))
def test_progress_parser_on_random_lines(line: str, regex: str | None) -> None:
    ev = parse_progress(line, regex)
    if ev is not None:
        assert math.isfinite(ev.done)
        assert ev.total is None or math.isfinite(ev.total)


@settings(max_examples=200, deadline=2000,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(max_size=5000), min_size=1, max_size=6), st.sampled_from(REGEXES))
def test_log_probe_over_random_bytes(chunks: list[bytes], regex: str | None) -> None:
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "job.log"
        clock = FakeClock()
        probe = LogProbe(log, regex, clock=clock)
        for c in chunks:
            with open(log, "ab") as f:
                f.write(c)
            o = probe.collect()
            assert o.status == "ok"
            clock.advance(1)
            type(o).model_validate_json(o.model_dump_json())  # a trace can always be written


# ------------------------------------------------------------------------------- metrics

metric_chars = st.sampled_from(list('{}="\n ,#_:.') + list(string.ascii_letters[:12]) + list("0123456789")
                               + ["# TYPE ", "# HELP ", " counter", " gauge", " histogram",
                                  "_total", "_bucket", "le=", "+Inf", "NaN", "1e999", "sglang:"])
metrics_text = st.one_of(st.text(max_size=300), st.lists(metric_chars, max_size=80).map("".join))


@FAST
@given(metrics_text)
def test_metrics_parser_on_random_text(text: str) -> None:
    try:
        counters, gauges, families = parse_metrics(text)
    except ValueError:
        return  # the documented failure: the probe reports it as a scrape error
    assert all(math.isfinite(v) for v in (*counters.values(), *gauges.values()))
    assert families >= 0


# ---------------------------------------------------------------------------------- /proc

PROC_PARSERS = [procfs.parse_stat, procfs.parse_status, procfs.parse_io, procfs.parse_syscall,
                procfs.parse_wchan, procfs.parse_stack, procfs.parse_btime,
                procfs.parse_sched_exec_start_s, procfs.parse_sched_last_run,
                procfs.parse_uptime_s, procfs.parse_fdinfo, procfs.parse_net_tcp]
proc_chars = st.sampled_from(list("0123456789 ()\n\t:-xabcdefABCDEF") +
                             ["State:", "voluntary_ctxt_switches:", "rchar:", "btime ", "pos:",
                              "flags:", "sl", "se.exec_start", "se.sum_exec_runtime", "-" * 20,
                              "running", "[<0>]", "0x", "kB"])
proc_text = st.one_of(st.text(max_size=300), st.lists(proc_chars, max_size=80).map("".join))


@FAST
@given(st.sampled_from(PROC_PARSERS), proc_text)
def test_proc_parsers_on_random_text(parser, text: str) -> None:
    try:
        parser(text)
    except ValueError:
        pass  # documented: the probe turns it into a per-field "unreadable"


@FAST
@given(st.binary(max_size=400))
def test_cmdline_parser_on_random_bytes(data: bytes) -> None:
    assert all(isinstance(a, str) for a in procfs.parse_cmdline(data))


@FAST
@given(st.one_of(st.text(max_size=300),
                 st.lists(st.sampled_from(list("0123456789,;-\n ") + ["NVRM: Xid", "Out of memory",
                          "Killed process", "blocked for more than", "SUBSYSTEM=", "\\x0a"]),
                          max_size=60).map("".join)))
def test_kernel_log_parser_on_random_records(raw: str) -> None:
    rec = parse_record(raw)
    if rec is not None:
        parse_event(rec, boot_wall_time=1.7e9)


# ------------------------------------------------------------------------ the real inputs

@pytest.mark.parametrize("path", sorted((ROOT / "rules").glob("*.toml")), ids=lambda p: p.name)
@settings(max_examples=100, deadline=2000,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_rule_loader_on_mutated_builtin_rules(path: Path, data) -> None:
    """The shipped rule files with random bytes flipped, cut or inserted."""
    src = path.read_text()
    i = data.draw(st.integers(0, len(src)))
    j = data.draw(st.integers(i, min(len(src), i + 40)))
    mutated = src[:i] + data.draw(st.text(max_size=20)) + src[j:]
    _rules_ok_or_located(mutated)


def test_config_error_names_the_line() -> None:
    with pytest.raises(UsageError, match=r"^fuzz\.toml:3:"):
        parse_config('[daemon]\ninterval_s = 1\ninterval_s = "x"\n', "fuzz.toml")
    with pytest.raises(UsageError, match=re.escape("fuzz.toml")):
        parse_config("[[job]]\nname = 3\n", "fuzz.toml")
