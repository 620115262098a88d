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


def log_config() -> dict:
    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_tokens"] = {"()": RedactTokens}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("redact_tokens")
    return config


def main() -> None:
    settings = GatewaySettings()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=log_config(),
        http=with_header_timeout(settings.header_timeout_s),
        proxy_headers=bool(settings.forwarded_allow_ips),
        forwarded_allow_ips=settings.forwarded_allow_ips or None,
        timeout_graceful_shutdown=SHUTDOWN_S,
        ws_max_size=settings.ws_max_message_bytes,
        ws_per_message_deflate=settings.ws_per_message_deflate,
    )


if __name__ == "__main__":
    main()
