"""`python -m app`: run the gateway with uvicorn, configured by the environment."""

import uvicorn

from app.main import create_app
from app.settings import GatewaySettings


def main() -> None:
    settings = GatewaySettings()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        proxy_headers=True,
        ws_max_size=settings.ws_max_message_bytes,
    )


if __name__ == "__main__":
    main()
