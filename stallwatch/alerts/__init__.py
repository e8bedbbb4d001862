"""Alerts people act on: Slack, webhook, desktop and command sinks behind one dispatcher.

The daemon builds `AlertDispatcher(parse_alerts(tables, file), clock=clock)` once, calls
`submit(event)` on every incident transition, `status()` for `stallwatch status`, and
`close(timeout_s)` on exit. See docs/alerts.md.
"""

from __future__ import annotations

from .base import DeliveryError, PermanentError, RetryableError, sample_event, webhook_payload
from .config import (AlertConfig, CommandConfig, DesktopConfig, SlackConfig, WebhookConfig,
                     load_alerts_file, parse_alerts)
from .dispatcher import AlertDispatcher, build_sink, incident_key
from .redact import RedactingFilter, redact, register_secret

__all__ = [
    "AlertConfig", "AlertDispatcher", "CommandConfig", "DeliveryError", "DesktopConfig",
    "PermanentError", "RedactingFilter", "RetryableError", "SlackConfig", "WebhookConfig",
    "build_sink", "incident_key", "load_alerts_file", "parse_alerts", "redact",
    "register_secret", "sample_event", "webhook_payload",
]
