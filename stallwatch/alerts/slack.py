"""Slack through an incoming webhook, with the official `slack_sdk.webhook.WebhookClient`.

A firing event becomes a Block Kit message: a header with the verdict and job, a section with
the summary and fields (job, host, verdict, since), the three strongest evidence lines, progress
and ETA, the advice, and a context line (incident, episode, time, evidence bundle). A resolved
event is one short section in a green attachment. `text` is always set: it is what phone
notifications and screen readers show.

The SDK's own retry handlers are switched off (the dispatcher retries, honouring Retry-After),
and its logger carries the redacting filter: at DEBUG it would print the webhook URL.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from stallwatch import __version__
from stallwatch.alerts.events import AlertEvent

from .base import (REPEAT_ICON, RESOLVED_ICON, SEVERITY_ICONS, TEST_ICON, PermanentError, Sink,
                   fmt_duration, fmt_progress, fmt_time, http_error, incident_age, kind_title,
                   network_error, strongest_evidence, title)
from .config import SlackConfig
from .redact import get_logger, redact

if TYPE_CHECKING:
    from slack_sdk.webhook import WebhookClient

RESOLVED_COLOR = "#2EB67D"  # Slack's green
HEADER_MAX = 150
SECTION_MAX = 3000
FIELD_MAX = 2000

_SDK_LOG = get_logger("stallwatch.alerts.slack_sdk")
# The SDK logs every failure at ERROR and, at DEBUG, each request with its URL; the dispatcher
# reports failures itself (redacted), so only the SDK's critical messages pass.
_SDK_LOG.setLevel(logging.CRITICAL)


def esc(text: str) -> str:
    """Escape text for Slack (&, <, > are its control characters: `<!channel>`, `<url|label>`).

    Everything in a message but the admin's `mention` goes through this, the top-level `text`
    and the plain_text header included: a job's user names its processes, files and log lines,
    and with them could page a whole channel or plant a link (issue 22 #11)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _mrkdwn(text: str) -> dict[str, Any]:
    return {"type": "mrkdwn", "text": _cut(text, SECTION_MAX)}


def _icon(event: AlertEvent) -> str:
    if event.test:
        return TEST_ICON
    if event.state == "resolved":
        return RESOLVED_ICON
    if event.renotify:
        return REPEAT_ICON
    return SEVERITY_ICONS.get(event.severity, SEVERITY_ICONS["critical"])


def fallback_text(event: AlertEvent, mention: str | None = None) -> str:
    host = f" on {event.host}" if event.host else ""
    if event.state == "resolved":
        age = incident_age(event)
        after = f" after {fmt_duration(age)}" if age is not None else ""
        return f"{RESOLVED_ICON} {esc(title(event))}{esc(host)}{after}"
    lead = f"{mention} " if mention else ""
    return f"{lead}{_icon(event)} {esc(title(event))}{esc(host)}: {esc(event.summary)}"


def _context(event: AlertEvent) -> dict[str, Any]:
    bits = []
    if event.incident_id is not None:
        bits.append(f"incident {event.incident_id}")
    bits.append(f"episode {event.episode}")
    if event.state == "resolved":
        bits.append(f"resolved {fmt_time(event.resolved_at or event.at)}")
    else:
        bits.append(f"fired {fmt_time(event.started_at or event.at)}")
    if event.renotify:
        bits.append(f"reminder {event.renotify}")
    if event.cause:
        bits.append(f"cause `{esc(event.cause)}`")
    if event.evidence_bundle:
        bits.append(f"evidence `{esc(event.evidence_bundle)}`")
    if event.test:
        bits.append("sent by `stallwatch alert test`")
    bits.append(f"stallwatch {__version__}")
    return {"type": "context", "elements": [_mrkdwn(" · ".join(bits))]}


def firing_blocks(event: AlertEvent, mention: str | None = None) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{
        "type": "header",
        "text": {"type": "plain_text", "text": _cut(f"{_icon(event)} {esc(title(event))}",
                                                     HEADER_MAX),
                 "emoji": True},
    }]
    age = incident_age(event)
    since = fmt_time(event.started_at or event.at)
    if event.at and fmt_time(event.at)[:10] == since[:10]:
        since = since[11:]  # the same day: the time is enough
    since_txt = f"{since} ({fmt_duration(age)})" if age is not None else since
    summary = esc(event.summary)
    if mention:
        summary = f"{mention} {summary}"
    blocks.append({
        "type": "section",
        "text": _mrkdwn(summary),
        "fields": [
            _mrkdwn(_cut(f"*Job*\n`{esc(event.job)}`", FIELD_MAX)),
            _mrkdwn(_cut(f"*Host*\n`{esc(event.host or '?')}`", FIELD_MAX)),
            _mrkdwn(f"*Verdict*\n`{esc(event.kind)}` · {esc(event.severity)}"),
            _mrkdwn(f"*Since*\n{since_txt}"),
        ],
    })
    ev = strongest_evidence(event, 3)
    if ev:
        lines = "\n".join(f"• *{esc(e.signal)}*: {esc(e.detail)}" for e in ev)
        more = len(event.evidence) - len(ev)
        if more > 0:
            lines += f"\n_…and {more} more in the evidence bundle_"
        blocks.append({"type": "section", "text": _mrkdwn(f"*Evidence*\n{lines}")})
    prog = fmt_progress(event.progress)
    if prog:
        blocks.append({"type": "section", "text": _mrkdwn(f"*Progress*\n{esc(prog)}")})
    if event.sparklines:  # a code block keeps the columns aligned
        blocks.append({"type": "section", "text": _mrkdwn(
            _cut(f"*Last minutes*\n```{esc(event.sparklines)}```", SECTION_MAX))})
    if event.advice:
        blocks.append({"type": "section",
                       "text": _mrkdwn("*Advice*\n" + "\n".join(f"• {esc(a)}" for a in event.advice[:5]))})
    if event.actions:
        blocks.append({"type": "section",
                       "text": _mrkdwn("*Done so far*\n" + "\n".join(f"• {esc(a)}" for a in event.actions[:5]))})
    blocks.append(_context(event))
    return blocks


def resolved_attachment(event: AlertEvent) -> dict[str, Any]:
    age = incident_age(event)
    after = f" after {fmt_duration(age)}" if age is not None else ""
    host = f" on `{esc(event.host)}`" if event.host else ""
    test = "[TEST] " if event.test else ""
    text = f"{RESOLVED_ICON} {test}*Resolved:* {esc(kind_title(event.kind))} — *{esc(event.job)}*{host}{after}"
    if event.summary:
        text += f"\n{esc(event.summary)}"
    return {"color": RESOLVED_COLOR,
            "blocks": [{"type": "section", "text": _mrkdwn(text)}, _context(event)]}


def slack_message(event: AlertEvent, mention: str | None = None) -> dict[str, Any]:
    """The body posted to the incoming webhook: {"text", "blocks"} or {"text", "attachments"}."""
    if event.state == "resolved":
        return {"text": fallback_text(event), "attachments": [resolved_attachment(event)]}
    return {"text": fallback_text(event, mention), "blocks": firing_blocks(event, mention)}


class SlackSink(Sink):
    type = "slack"

    def __init__(self, config: SlackConfig) -> None:
        super().__init__(config)
        self._url = config.resolve_url()  # a missing secret is a broken sink from start-up

    @functools.cached_property
    def _client(self) -> WebhookClient:
        """Built at the first delivery, not with the sink: slack_sdk brings urllib.request,
        http.client and ssl (4.5 MiB of RSS) into a daemon that may never alert (issue 17)."""
        from slack_sdk.webhook import WebhookClient

        # timeout: seconds; slack_sdk says int, urllib takes a float
        return WebhookClient(self._url.get_secret_value(), timeout=self.config.timeout_s,
                             logger=_SDK_LOG, retry_handlers=[])

    def describe(self) -> str:
        return "Slack incoming webhook " + redact(self._url.get_secret_value())

    def deliver(self, event: AlertEvent) -> None:
        msg = slack_message(event, self.config.mention)
        try:
            resp = self._client.send(**msg)
        except Exception as e:  # noqa: BLE001 - urllib / socket / SlackRequestError
            if type(e).__name__ == "SlackRequestError":
                raise PermanentError(f"Slack: {e}") from None
            raise network_error(e, "Slack", self.config.timeout_s) from None
        if 200 <= resp.status_code < 300:
            return
        raise http_error(resp.status_code, resp.body, resp.headers, "Slack")
