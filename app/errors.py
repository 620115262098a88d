"""Errors as JSON: `{"code": <stable identifier>, "message": <for humans>}`."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)


class ErrorBody(BaseModel):
    code: str = Field(description="A stable identifier of the error (README, 'Errors').")
    message: str = Field(description="What went wrong, for a person.")


class FieldError(BaseModel):
    field: str = Field(description="Where, like body.policy_options.beta or query.since.")
    message: str


class ValidationErrorBody(ErrorBody):
    fields: list[FieldError]


# The error replies every API route may give, for the OpenAPI schema.
ERROR_RESPONSES: dict[int | str, dict] = {
    400: {"model": ErrorBody, "description": "A malformed body or header."},
    401: {"model": ErrorBody, "description": "No session token (or no API key where one is needed)."},
    403: {"model": ErrorBody, "description": "Not this session's token (or an unknown API key)."},
    404: {"model": ErrorBody, "description": "No such session (or answer)."},
    413: {"model": ErrorBody, "description": "A body over the limit."},
    422: {"model": ValidationErrorBody, "description": "Invalid fields, each named."},
    429: {"model": ErrorBody, "description": "Over a rate or count limit; see Retry-After."},
    503: {"model": ErrorBody, "description": "Redis or the workers are unavailable; see Retry-After."},
}


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


def _json(status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra) -> JSONResponse:
    return JSONResponse({"code": code, "message": message, **extra}, status_code=status, headers=headers)


async def _api_error(_: Request, err: ApiError) -> JSONResponse:
    return _json(err.status, err.code, err.message, err.headers)


async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
    fields = [
        {"field": ".".join(str(part) for part in e["loc"]), "message": e["msg"]} for e in err.errors()
    ]
    message = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return _json(422, "invalid_request", message, fields=fields)


async def _http_error(_: Request, err: HTTPException) -> JSONResponse:
    code = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
    message = "the body is not valid JSON (UTF-8)" if err.status_code == 400 else str(err.detail)
    return _json(err.status_code, code, message, err.headers)


async def _redis_unreachable(_: Request, err: Exception) -> JSONResponse:
    return _json(503, "redis_unreachable", f"Redis is unreachable: {err}", {"Retry-After": "5"})


async def _client_left(_: Request, err: ClientDisconnect) -> JSONResponse:
    return _json(400, "client_disconnected", "the client left before sending its whole request")


async def _unexpected(request: Request, err: Exception) -> JSONResponse:
    log.exception("%s %s failed", request.method, request.url.path, exc_info=err)
    return _json(500, "internal_error", "the gateway failed; the error is in its log")


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RedisConnectionError, _redis_unreachable)
    app.add_exception_handler(RedisTimeoutError, _redis_unreachable)
    app.add_exception_handler(ClientDisconnect, _client_left)
    app.add_exception_handler(Exception, _unexpected)
