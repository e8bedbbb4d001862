"""`[[alert]]` tables: one pydantic model per sink type, a discriminated union on `type`.

    [[alert]]
    type = "slack"                  # "webhook" | "slack" | "desktop" | "command"
    credential = "slack-webhook"    # or url_env = "SLACK_WEBHOOK_URL" (the default), url, url_file
    min_severity = "warning"
    renotify_every_s = 3600

`parse_alerts(tables, file)` validates every table and raises one UsageError naming the first
problem as `file: alert[N].key: problem` (N counts the [[alert]] tables from 0, as
`job[N]` does in the daemon's config errors). Secret values
(URLs, header values) are `SecretStr`: never in repr, str or JSON; `resolve_url()` reads the
real value only when a sink is built, and registers it with the redactor.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal
from collections.abc import Mapping

from pydantic import (BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, ValidationError,
                      field_validator, model_validator)

from stallwatch.engine.duration import parse_duration
from stallwatch.errors import UsageError
from stallwatch.vocab import SEVERITIES, SEVERITY_RANK, VERDICT_KINDS

from .redact import register_secret

# The contract's verdict vocabulary (docs/contract.md), spelled once in stallwatch.vocab.
KINDS = VERDICT_KINDS
SINK_TYPES = ("webhook", "slack", "desktop", "command")

Severity = Literal["info", "warning", "critical"]


class SecretSourceError(Exception):
    """A secret could not be read (variable unset, file missing). The message holds no secret."""


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, description="Label in status and logs; default: the type "
                             "(type-2, type-3 ... when several sinks share a type).")
    min_severity: Severity = "info"
    kinds: tuple[str, ...] | None = Field(None, description="Only these verdict kinds (default: all).")
    send_resolved: bool = True
    renotify_every_s: float | None = Field(None, ge=0, description="Re-send a still-firing incident "
                                           "this often (None or 0: never).")
    rate_limit_per_min: float = Field(20.0, gt=0, description="Token bucket: burst and refill per minute.")
    timeout_s: float = Field(10.0, gt=0, le=600)
    max_attempts: int = Field(6, ge=1, le=100, description="Tries per event, the first included.")
    retry_initial_s: float = Field(1.0, gt=0, le=3600, description="First backoff; doubles each retry.")
    retry_max_s: float = Field(120.0, gt=0, le=3600)
    give_up_after_s: float = Field(900.0, gt=0, description="Stop retrying one event after this long.")

    @field_validator("renotify_every_s", "timeout_s", "retry_initial_s", "retry_max_s",
                     "give_up_after_s", mode="before")
    @classmethod
    def _durations(cls, v: Any) -> Any:
        # The same durations as the rest of the config: seconds, or "30s", "5m", "1h30m".
        return v if v is None else parse_duration(v)
    queue_size: int = Field(1000, ge=1, le=1_000_000)

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return v
        for k in v:
            if k not in KINDS:
                near = difflib.get_close_matches(k, KINDS, n=1)
                hint = f" (did you mean '{near[0]}'?)" if near else f" (known: {', '.join(KINDS)})"
                raise ValueError(f"unknown verdict kind '{k}'{hint}")
        return tuple(v)

    def wants(self, severity: str, kind: str) -> bool:
        """Whether this sink's filters let an event of this severity and kind through."""
        if self.kinds is not None and kind not in self.kinds:
            return False
        return SEVERITY_RANK.get(severity, len(SEVERITIES)) >= SEVERITY_RANK[self.min_severity]


def _check_url(url: str, where: str) -> str:
    u = url.strip()
    if not (u.startswith("https://") or u.startswith("http://")):
        raise SecretSourceError(f"{where}: expected an http(s):// URL")
    return u


class _UrlSink(_Base):
    """A sink that posts to a URL, read from exactly one of url, url_env, url_file, credential."""

    url: SecretStr | None = None
    url_env: str | None = None
    url_file: str | None = None
    credential: str | None = Field(None, description="Name of a systemd credential "
                                   "(LoadCredential=NAME:PATH): read from $CREDENTIALS_DIRECTORY/NAME.")

    def _sources(self) -> list[str]:
        return [k for k in ("url", "url_env", "url_file", "credential") if getattr(self, k) is not None]

    @model_validator(mode="after")
    def _one_source(self):
        given = self._sources()
        if len(given) > 1:
            raise ValueError(f"give only one of url, url_env, url_file, credential (got {', '.join(given)})")
        return self

    @field_validator("url")
    @classmethod
    def _url(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            try:
                _check_url(v.get_secret_value(), "url")
            except SecretSourceError:
                raise ValueError("expected an http(s):// URL") from None
        return v

    @field_validator("credential")
    @classmethod
    def _credential(cls, v: str | None) -> str | None:
        if v is not None and ("/" in v or v in ("", ".", "..")):
            raise ValueError("a credential name, not a path (use url_file for a path)")
        return v

    def resolve_url(self, environ: Mapping[str, str] | None = None) -> SecretStr:
        """The real URL, read now from where the config says; registered with the redactor."""
        env = os.environ if environ is None else environ
        if self.url is not None:
            value, where = self.url.get_secret_value(), "url"
        elif self.url_env is not None:
            value = env.get(self.url_env, "")
            where = f"url_env: environment variable {self.url_env}"
            if not value.strip():
                raise SecretSourceError(f"{where} is not set")
        elif self.credential is not None:
            cdir = env.get("CREDENTIALS_DIRECTORY")
            if not cdir:
                raise SecretSourceError(
                    f"credential '{self.credential}': $CREDENTIALS_DIRECTORY is not set "
                    f"(run under systemd with LoadCredential={self.credential}:/path/to/file)")
            where = f"credential '{self.credential}'"
            value = _read_secret(Path(cdir) / self.credential, where)
        elif self.url_file is not None:
            path = Path(self.url_file).expanduser()
            where = f"url_file {path}"
            value = _read_secret(path, where)
        else:
            value, where = self._default_url(env)
        value = _check_url(value, where)
        register_secret(value)
        return SecretStr(value)

    def _default_url(self, env: Mapping[str, str]) -> tuple[str, str]:
        raise SecretSourceError("no URL: give url, url_env, url_file or credential")


class WebhookConfig(_UrlSink):
    type: Literal["webhook"]
    headers: dict[str, SecretStr] = Field(default_factory=dict, description="Extra HTTP headers; "
                                          "values are secret (an Authorization header is common).")

    @model_validator(mode="after")
    def _need_source(self):
        if not self._sources():
            raise ValueError("give one of url, url_env, url_file, credential")
        return self

    def header_values(self) -> dict[str, str]:
        out = {k: v.get_secret_value() for k, v in self.headers.items()}
        register_secret(*out.values())
        return out


class SlackConfig(_UrlSink):
    type: Literal["slack"]
    mention: str | None = Field(None, description="Prepended to firing messages, e.g. '<!here>' "
                                "or '<@U0123ABCD>'.")

    def _default_url(self, env: Mapping[str, str]) -> tuple[str, str]:
        value = env.get("SLACK_WEBHOOK_URL", "")
        where = "url_env: environment variable SLACK_WEBHOOK_URL (the default)"
        if not value.strip():
            raise SecretSourceError(f"{where} is not set")
        return value, where


DEFAULT_URGENCY = {"info": 0, "warning": 1, "critical": 2, "resolved": 0}


class DesktopConfig(_Base):
    type: Literal["desktop"]
    user: str | None = Field(None, description="Whose desktop: the per-user agent of this user "
                             "delivers (needed when the daemon runs as root).")
    urgency_map: dict[str, int] = Field(default_factory=dict, description="Severity (or "
                                        "'resolved') → freedesktop urgency 0 low, 1 normal, 2 critical.")
    mode: Literal["auto", "direct", "spool"] = Field("auto", description="direct: Notify on this "
                                                     "process's session bus; spool: via the agent; auto: "
                                                     "direct when DBUS_SESSION_BUS_ADDRESS is set and no "
                                                     "other user is named, else spool.")
    spool_dir: str | None = Field(None, description="Default <state_dir>/desktop/<user>.")
    app_name: str = "stallwatch"
    expire_timeout_ms: int = Field(-1, ge=-1, description="-1: the server decides; 0: never expires.")
    max_age_s: float = Field(3600.0, gt=0, description="The agent drops spooled events older than this.")

    @field_validator("urgency_map")
    @classmethod
    def _urgency(cls, v: dict[str, int]) -> dict[str, int]:
        for k, u in v.items():
            if k not in (*SEVERITIES, "resolved"):
                raise ValueError(f"unknown key '{k}': use {', '.join(SEVERITIES)} or resolved")
            if u not in (0, 1, 2):
                raise ValueError(f"{k}: urgency is 0 (low), 1 (normal) or 2 (critical), got {u}")
        return {**DEFAULT_URGENCY, **v}

    def urgency(self, severity: str, state: str) -> int:
        m = self.urgency_map or DEFAULT_URGENCY
        if state == "resolved":
            return m["resolved"]
        return m.get(severity, 2)


class CommandConfig(_Base):
    type: Literal["command"]
    argv: tuple[str, ...] = Field(..., min_length=1, description="Program and arguments; no shell.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables.")
    cwd: str | None = None

    @field_validator("argv")
    @classmethod
    def _argv(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v[0].strip():
            raise ValueError("argv[0] (the program) is empty")
        return v


AlertConfig = Annotated[WebhookConfig | SlackConfig | DesktopConfig | CommandConfig,
                        Field(discriminator="type")]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(AlertConfig)
_MODELS: dict[str, type[BaseModel]] = {"webhook": WebhookConfig, "slack": SlackConfig, "desktop": DesktopConfig,
           "command": CommandConfig}


def _read_secret(path: Path, where: str) -> str:
    try:
        value = path.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise SecretSourceError(f"{where}: cannot read: {e.strerror or type(e).__name__}") from None
    if not value:
        raise SecretSourceError(f"{where}: the file is empty")
    return value


def _problem(err: Mapping[str, Any], table: Mapping[str, Any]) -> tuple[str, str]:
    """(dotted location, message) for one pydantic error, phrased for a TOML user."""
    loc = list(err.get("loc", ()))
    if loc and loc[0] in _MODELS:  # the discriminator's tag
        loc = loc[1:]
    where = ".".join(str(p) for p in loc if not (isinstance(p, str) and p.startswith("function-")))
    typ, msg = err.get("type", ""), err.get("msg", "invalid")
    if typ == "union_tag_not_found":
        return "type", f"required: one of {', '.join(SINK_TYPES)}"
    if typ == "union_tag_invalid":
        return "type", f"unknown sink type {table.get('type')!r}: use one of {', '.join(SINK_TYPES)}"
    if typ == "extra_forbidden":
        model = _MODELS.get(str(table.get("type")))
        near = difflib.get_close_matches(str(loc[-1]), list(model.model_fields) if model else [], n=1)
        return where, "unknown key" + (f" (did you mean '{near[0]}'?)" if near else "")
    if typ == "missing":
        return where, "required"
    msg = msg.removeprefix("Value error, ")
    return where, msg


def parse_alerts(tables: list[dict[str, Any]] | None, file: str) -> list[Any]:
    """Validate the `[[alert]]` tables of one config file; UsageError `file: alert[N].key: problem`.

    Returns WebhookConfig | SlackConfig | DesktopConfig | CommandConfig objects in file order,
    each with a unique `name` (the given one, else the type, numbered from the second on).
    """
    if tables is None:
        return []
    if not isinstance(tables, list):
        raise UsageError(f"{file}: alert: expected [[alert]] tables (an array of tables)")
    out: list[Any] = []
    for i, table in enumerate(tables):
        if not isinstance(table, dict):
            raise UsageError(f"{file}: alert[{i}]: expected a table")
        try:
            cfg = _ADAPTER.validate_python(table)
        except ValidationError as e:
            where, msg = _problem(e.errors(include_url=False, include_input=False)[0], table)
            raise UsageError(f"{file}: alert[{i}]{'.' + where if where else ''}: {msg}") from None
        out.append(cfg)
    # unique names
    seen: set[str] = set()
    named: list[Any] = []
    counts: dict[str, int] = {}
    for i, cfg in enumerate(out):
        if cfg.name is not None:
            if cfg.name in seen:
                raise UsageError(f"{file}: alert[{i}].name: '{cfg.name}' is used by another [[alert]]")
            seen.add(cfg.name)
    for cfg in out:
        if cfg.name is None:
            counts[cfg.type] = counts.get(cfg.type, 0) + 1
            n = counts[cfg.type]
            name = cfg.type if n == 1 else f"{cfg.type}-{n}"
            while name in seen:
                n += 1
                name = f"{cfg.type}-{n}"
            seen.add(name)
            cfg = cfg.model_copy(update={"name": name})
        named.append(cfg)
    return named


def load_alerts_file(path: str | os.PathLike[str]) -> list[Any]:
    """The `[[alert]]` tables of a TOML config file, parsed (for `stallwatch alert test`)."""
    import tomllib

    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{p}: no such config file") from None
    except OSError as e:
        raise UsageError(f"{p}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{p}: not valid TOML: {e}") from None
    return parse_alerts(data.get("alert"), str(p))
