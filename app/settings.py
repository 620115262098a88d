from pathlib import Path

from pydantic import Field

from streamvqa.settings import CommonSettings

FRONTEND_DIR = Path(__file__).resolve().parent.parent / "frontend"


def _items(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


class GatewaySettings(CommonSettings):
    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port the gateway listens on.")
    access_log_polling: bool = Field(
        False, description="Log the successful GETs clients repeat (session status and memory, health, metrics) too.",
    )
    ask_timeout_s: float = Field(300.0, gt=0, description="How long `ask` waits for an answer.")
    upload_stall_s: float = Field(60.0, gt=0, description="How long an upload waits for a stalled worker.")
    upload_min_bytes_per_s: int = Field(
        8192, ge=0, description="An upload that sends less than this on average over 10 s of waiting for the client is "
        "refused (408 upload_too_slow); 0 turns the check off.",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="A connection that has not sent a whole request's headers within this is closed "
        "(and a request's body, uploads excepted, must arrive within it too).",
    )
    forwarded_allow_ips: str = Field(
        "", description="Comma-separated addresses of reverse proxies whose X-Forwarded-For and X-Forwarded-Proto are "
        "trusted (`*` for any); empty trusts none, and each caller is its own address.",
    )
    ws_max_message_bytes: int = Field(
        4 * 1024 * 1024, ge=64 * 1024, description="Largest WebSocket message; larger ones close the socket with 1009."
    )
    ws_messages_per_s: float = Field(
        200.0, gt=0, description="Messages per second a socket may send (bursts of twice that); more close it with 4429."
    )
    ws_per_message_deflate: bool = Field(
        True, description="Accept WebSocket compression (browsers ask for it); false saves CPU, as video does not compress."
    )
    max_stream_sockets: int = Field(
        128, ge=1, description="Stream sockets one gateway serves at once (each holds a Redis connection)."
    )
    max_sockets_per_session: int = Field(
        4, ge=1, le=64, description="Sockets open on one session at once, over all gateways (one of them may stream media)."
    )
    redis_max_connections: int = Field(256, ge=4, description="Redis connections per gateway process.")
    frontend_dir: Path = Field(FRONTEND_DIR, description="Static files served at `/`.")
    api_keys: str = Field(
        "", description="Comma-separated API keys; when set, creating and listing sessions needs one (`X-API-Key`)."
    )
    address_owns_sessions: bool = Field(
        False, description="Without API_KEYS, let a client's address list the sessions created from it (their records, "
        "system prompts among them) and end them without their tokens: only where one address is one person (never "
        "behind a reverse proxy or NAT that users share). False: an address lists and ends only the sessions whose "
        "tokens it presents.",
    )
    allowed_hosts: str = Field(
        "", description="Comma-separated names the gateway answers to, as the Host header gives them (without the port): "
        "`*.example.com` for its subdomains, `*` for any. Empty: localhost, 127.0.0.1 and [::1], and HOST when it names "
        "one address. Any other Host is refused (400; a socket is refused), so that a page whose name was rebound to "
        "this machine's address cannot call it. /healthz and /readyz answer any Host.",
    )
    max_sessions_per_key: int = Field(
        8, ge=1, description="Live sessions one API key (or, without keys, one client address) may hold."
    )
    max_watches_per_session: int = Field(
        8, ge=1, le=256, description="Watches one session may have (POST /sessions/{id}/watches); each is checked every few seconds of video."
    )
    rate_limit_per_s: float = Field(
        50.0, ge=0, description="REST requests per second per API key (or client address); 0 turns the limit off."
    )
    rate_limit_burst: int = Field(200, ge=1, description="Requests a caller may make at once before the rate applies.")
    max_body_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest request body, uploads excepted (those have MAX_UPLOAD_BYTES)."
    )
    max_chat_media_bytes: int = Field(
        64 * 1024**2, ge=1024, description="Largest video in a `/v1/chat/completions` request's messages (decoded; "
        "MAX_UPLOAD_BYTES if that is less); its body may be 4/3 of it (base64) plus MAX_BODY_BYTES. An image there has "
        "the stream socket's message limit, WS_MAX_MESSAGE_BYTES.",
    )
    max_chat_media_requests: int = Field(
        2, ge=1, description="`/v1/chat/completions` requests that may hold media in one gateway's memory at once (each "
        "up to about 2.7 times MAX_CHAT_MEDIA_BYTES while its data URL is read, until the media is sent on); another "
        "waits up to 30 s for its turn (its body unread), then is refused (503 `media_busy`, Retry-After).",
    )
    media_fetch_timeout_s: float = Field(
        30.0, gt=0, description="How long fetching an http(s) `video_url` or `image_url` of a chat completion may take.",
    )
    media_fetch_urls: bool = Field(
        True, description="Fetch http(s) URLs of media in `/v1/chat/completions` messages; false accepts data URLs "
        "only.",
    )
    media_fetch_private: bool = Field(
        False, description="Also fetch media URLs whose host resolves to a loopback, private, link-local, multicast, "
        "reserved or unspecified address (refused by default: callers must not reach the gateway's own network "
        "through it).",
    )
    cors_origins: str = Field(
        "", description="Comma-separated origins allowed to call the API from a browser (`*` for any); none by default. "
        "A browser's socket is refused (close 4403) unless its Origin is the gateway's own or one of these.",
    )
    metrics_public: bool = Field(
        False, description="With API_KEYS set, `/metrics` needs a key (X-API-Key, or as a bearer token) unless this is "
        "true; without API_KEYS it is public.",
    )

    @property
    def api_key_list(self) -> tuple[str, ...]:
        return _items(self.api_keys)

    @property
    def chat_media_bytes(self) -> int:
        """The largest video a chat completion's messages may carry."""
        return min(self.max_chat_media_bytes, self.max_upload_bytes)

    @property
    def chat_body_bytes(self) -> int:
        """The largest body of a chat completion: its media in base64, and the rest of the JSON."""
        return -(-self.chat_media_bytes * 4 // 3) + self.max_body_bytes

    @property
    def cors_origin_list(self) -> tuple[str, ...]:
        return _items(self.cors_origins)

    @property
    def allowed_host_list(self) -> tuple[str, ...]:
        return _items(self.allowed_hosts)
