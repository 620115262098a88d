"""Settings every process reads from its environment (documented in the README)."""

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "streamvqa-demo"  # a real vision-language model from PyPI packages (docs/demo-model.md)


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", extra="ignore", frozen=True)

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="The Redis every process shares.")
    redis_cluster: bool = Field(
        False, description="REDIS_URL names a node of a Redis Cluster: talk to the cluster (every process must agree)."
    )
    redis_prefix: str = Field("svqa:", description="Prefix of every Redis key (no `{` or `}`).")
    model: str = Field(DEFAULT_MODEL, description="Gateway: default model of new sessions. Worker: the model it serves.")
    session_ttl_s: int = Field(6 * 3600, ge=60, description="A session idle this long expires with its data.")
    max_upload_bytes: int = Field(2 * 1024**3, ge=1024, description="Largest accepted upload.")
    log_level: str = Field("INFO", description="Python logging level.")

    @field_validator("redis_prefix")
    @classmethod
    def _no_hash_tag(cls, prefix: str) -> str:
        if "{" in prefix or "}" in prefix:
            raise ValueError("may not hold { or }: a session's keys take their hash tag from its id")
        return prefix
