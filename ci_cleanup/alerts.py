"""Where alerts go: the log always, and an HTTP webhook when CI_CLEANUP_ALERT_WEBHOOK_URL is set.

The payload is JSON with a Slack-compatible ``text`` field, so the URL can be a Slack or Mattermost
incoming webhook, or any receiver of your own.
"""

from __future__ import annotations

import json
import logging
import os

WEBHOOK_ENV = "CI_CLEANUP_ALERT_WEBHOOK_URL"

log = logging.getLogger("ci_cleanup.alerts")


def send_alert(alert: str, text: str, **details) -> None:
    log.warning("[%s] %s %s", alert, text, details)
    url = os.environ.get(WEBHOOK_ENV)
    if not url:
        return
    import urllib.request  # only where an alert is sent: a run's process does not import it

    body = json.dumps({"text": text, "alert": alert, **details}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
    except OSError as e:  # an unreachable sink must not hide the alert: it is in the log above
        log.error("Could not deliver alert %s to the webhook: %s", alert, e)
