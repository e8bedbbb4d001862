"""The generic webhook: POST one JSON object per event (docs/contract.md).

Body: `AlertEvent.model_dump(mode="json")` plus `"stallwatch_version"`. 2xx is success; 408, 425,
429 (Retry-After honoured) and 5xx are retried by the dispatcher, other 4xx are not. urllib with
a timeout; proxies from the environment as urllib does.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from stallwatch import __version__
from stallwatch.alerts.events import AlertEvent

from .base import PermanentError, Sink, http_error, network_error, webhook_payload
from .config import WebhookConfig
from .redact import redact


def safe_origin(url: str) -> str:
    """scheme://host[:port]/*** — enough to recognise a target, nothing secret."""
    try:
        u = urlsplit(url)
        host = u.hostname or "?"
        port = f":{u.port}" if u.port else ""
        tail = "/***" if (u.path not in ("", "/") or u.query) else ""
        return redact(f"{u.scheme}://{host}{port}{tail}")
    except ValueError:
        return "(unparseable URL)"


def post_json(url: str, body: bytes, headers: dict[str, str], timeout_s: float, what: str) -> tuple[int, str]:
    """POST; (status, body) for 2xx, DeliveryError otherwise. Never lets the URL into a message."""
    # Imported at the first delivery, not with the sink: urllib.request brings http.client and
    # ssl (1.2 MiB of RSS) into a daemon that may never alert (issue 17's RSS bound).
    import urllib.error
    import urllib.request

    h = {"Content-Type": "application/json", "User-Agent": f"stallwatch/{__version__}", **headers}
    req = urllib.request.Request(url, data=body, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            text = resp.read(65536).decode("utf-8", "replace")
            return resp.status, text
    except urllib.error.HTTPError as e:
        try:
            text = e.read(4096).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - the body of an error reply is a nicety
            text = ""
        err = http_error(e.code, text, dict(e.headers.items()) if e.headers else None, what)
    except (urllib.error.URLError, OSError, ValueError) as e:
        if isinstance(e, ValueError) and not isinstance(e, urllib.error.URLError):
            err = PermanentError(f"{what}: invalid request: {e}")
        else:
            err = network_error(e, what, timeout_s)
    raise err from None


class WebhookSink(Sink):
    type = "webhook"

    def __init__(self, config: WebhookConfig) -> None:
        super().__init__(config)
        self._url = config.resolve_url()
        self._headers = config.header_values()

    def describe(self) -> str:
        return f"POST {safe_origin(self._url.get_secret_value())}"

    def deliver(self, event: AlertEvent) -> None:
        body = json.dumps(webhook_payload(event), ensure_ascii=False).encode("utf-8")
        post_json(self._url.get_secret_value(), body, self._headers, self.config.timeout_s,
                  f"webhook {safe_origin(self._url.get_secret_value())}")
