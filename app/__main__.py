"""`python -m app`: run the gateway with uvicorn, configured by the environment."""

import copy
import logging
import re

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from app.main import create_app
from app.server import with_header_timeout
from app.settings import GatewaySettings


SHUTDOWN_S = 3  # on SIGTERM, open streams (Server-Sent Events, sockets) are closed after this


class RedactTokens(logging.Filter):
    """Session tokens sent as `?token=` (browsers' WebSockets cannot send headers) never reach a log."""

    PATTERN = re.compile(r"((?:^|[?&])token=)[^&\s\"']+")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = self.PATTERN.sub(r"\1[redacted]", record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self.PATTERN.sub(r"\1[redacted]", a) if isinstance(a, str) else a for a in record.args)
        return True


class QuietPolling(logging.Filter):
    """Drops the access-log lines of successful GETs that clients repeat every second or so (the
    dashboard polls a session and its memory; probes poll health and metrics)."""

    PATH = re.compile(r"/(healthz|readyz|metrics|models|sessions)|/sessions/[^/]+(/memory|/answers(/[^/]+)?)?")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) == 5):  # uvicorn's (client, method, path, version, status)
            return True
        _, method, path, _, status = args
        polled = method == "GET" and isinstance(status, int) and status < 400
        return not (polled and self.PATH.fullmatch(str(path).split("?", 1)[0]))


class NotReadyYet(logging.Filter):
    """uvicorn's "Uvicorn running on <url>" comes as soon as the port is open, long before a worker
    has loaded its model: say what the address is for, and when it answers."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Uvicorn running on"):
            record.msg = record.msg.replace("Uvicorn running on", "gateway listening on").replace(
                "(Press CTRL+C to quit)", "(questions are answered once a worker serves the model: GET /readyz)"
            )
            record.color_message = record.msg
        return True


def log_config(access_log_polling: bool = False) -> dict:
    config = copy.deepcopy(LOGGING_CONFIG)
    filters = config.setdefault("filters", {})
    filters["redact_tokens"] = {"()": RedactTokens}
    filters["not_ready_yet"] = {"()": NotReadyYet}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("redact_tokens")
    config["handlers"]["default"]["filters"].append("not_ready_yet")
    if not access_log_polling:
        filters["quiet_polling"] = {"()": QuietPolling}
        config["handlers"]["access"]["filters"].append("quiet_polling")
    return config


def main() -> None:
    settings = GatewaySettings()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=log_config(settings.access_log_polling),
        http=with_header_timeout(settings.header_timeout_s),
        proxy_headers=bool(settings.forwarded_allow_ips),
        forwarded_allow_ips=settings.forwarded_allow_ips or None,
        timeout_graceful_shutdown=SHUTDOWN_S,
        ws_max_size=settings.ws_max_message_bytes,
        ws_per_message_deflate=settings.ws_per_message_deflate,
    )


if __name__ == "__main__":
    main()
