from pathlib import Path

from pydantic import Field

from streamvqa.settings import CommonSettings

FRONTEND_DIR = Path(__file__).resolve().parent.parent / "frontend"


class GatewaySettings(CommonSettings):
    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port the gateway listens on.")
    ask_timeout_s: float = Field(300.0, gt=0, description="How long `ask` waits for an answer.")
    upload_stall_s: float = Field(60.0, gt=0, description="How long an upload waits for a stalled worker.")
    ws_max_message_bytes: int = Field(
        4 * 1024 * 1024, ge=64 * 1024, description="Largest WebSocket message; larger ones close the socket with 1009."
    )
    max_stream_sockets: int = Field(
        128, ge=1, description="Stream sockets one gateway serves at once (each holds a Redis connection)."
    )
    redis_max_connections: int = Field(256, ge=4, description="Redis connections per gateway process.")
    frontend_dir: Path = Field(FRONTEND_DIR, description="Static files served at `/`.")
