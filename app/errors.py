"""Errors as JSON: `{"code": <stable identifier>, "message": <for humans>}`; on the
OpenAI-compatible routes (`/v1/...`) in OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`, with the same codes."""

import logging
from collections.abc import Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute

from streamvqa.redis_client import UNAVAILABLE

log = logging.getLogger(__name__)

REDIS_UNREACHABLE = "Redis is unreachable (the gateway's log has the cause)"
INVALID_BODY = "the body is not valid JSON (UTF-8)"


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
    408: {"model": ErrorBody, "description": "A body not in within HEADER_TIMEOUT_S (`body_timeout`)."},
    413: {"model": ErrorBody, "description": "A body over the limit."},
    422: {"model": ValidationErrorBody, "description": "Invalid fields, each named."},
    429: {"model": ErrorBody, "description": "Over a rate or count limit; see Retry-After."},
    500: {"model": ErrorBody, "description": "A bug (`internal_error`); the gateway's log has the details."},
    503: {"model": ErrorBody, "description": "Redis or the workers are unavailable; see Retry-After."},
}


class OpenAIError(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, rate_limit_error, "
                      "server_error.")
    param: str | None = Field(description="The request field at fault, if one is.")
    code: str = Field(description="The same stable identifier as the rest of the API's `code`.")


class OpenAIErrorBody(BaseModel):
    error: OpenAIError


OPENAI_PREFIX = "/v1/"
OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 408: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
    422: "invalid_request_error", 429: "rate_limit_error",
}  # any other status: server_error


def openai_responses(descriptions: dict[int, str]) -> dict[int | str, dict]:
    """The OpenAPI entries of errors in OpenAI's shape."""
    return {status: {"model": OpenAIErrorBody, "description": text} for status, text in descriptions.items()}


class ApiError(Exception):
    """An error reply. On `/v1`, `param` names the request field at fault and `type` (OpenAI's
    error type) replaces the one its status has by default."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None, param: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers, self.param = status, code, message, headers, param
        self.type = type


# The headers of an answer given before the request's body was read whole: the connection closes
# after it, so that the rest of the body (a byte arriving after the answer) cannot hold it open.
CLOSE = {"Connection": "close"}


def openai_error(status: int, code: str, message: str, param: str | None = None, type: str | None = None) -> dict:
    """An error body in OpenAI's shape."""
    return {"error": {"message": message, "type": type or OPENAI_TYPES.get(status, "server_error"), "param": param, "code": code}}


def _json(
    request: Request, status: int, code: str, message: str, headers: dict[str, str] | None = None,
    param: str | None = None, type: str | None = None, **extra,
) -> JSONResponse:
    if request.url.path.startswith(OPENAI_PREFIX):
        status = 400 if status == 422 else status  # OpenAI answers a request it cannot take with 400
        return JSONResponse(openai_error(status, code, message, param, type), status_code=status, headers=headers)
    return JSONResponse({"code": code, "message": message, **extra}, status_code=status, headers=headers)


async def _api_error(request: Request, err: ApiError) -> JSONResponse:
    return _json(request, err.status, err.code, err.message, err.headers, err.param, err.type)


async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    if any(_undecodable(e) for e in err.errors()):
        return _json(request, 400, "invalid_body", INVALID_BODY)
    named = {(".".join(str(part) for part in e["loc"]), e["msg"]): None for e in err.errors()}  # each once
    fields = [{"field": field, "message": message} for field, message in named]
    message = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    if request.url.path.startswith(OPENAI_PREFIX):  # OpenAI answers a bad field with 400, naming it
        loc = [str(part) for part in err.errors()[0]["loc"]] if err.errors() else []
        param = ".".join(loc[1:]) if loc[:1] == ["body"] else None
        return _json(request, 400, "invalid_request", message, param=param or None)
    return _json(request, 422, "invalid_request", message, fields=fields)


def _undecodable(error: dict) -> bool:
    """A body that is not JSON at all: not UTF-8 JSON text, or sent as another content type."""
    return error["type"] == "json_invalid" or (tuple(error["loc"]) == ("body",) and isinstance(error.get("input"), bytes))


def _http_error(openai_routes: Sequence[BaseRoute]) -> Callable[[Request, HTTPException], Awaitable[JSONResponse]]:
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        if request.url.path.startswith(OPENAI_PREFIX) and err.status_code in (404, 405):
            return _openai_no_route(request, openai_routes)
        code = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        message = INVALID_BODY if err.status_code == 400 else str(err.detail)
        return _json(request, err.status_code, code, message, err.headers)

    return http_error


def _openai_no_route(request: Request, routes: Sequence[BaseRoute]) -> JSONResponse:
    """A path under /v1 that none of `routes` serves (404), or one they serve with other methods
    (405, with `Allow`), in OpenAI's shape. The dashboard's static files, mounted at `/`, would
    answer either for any path; the API's own routes decide here."""
    path, method = request.url.path, request.method
    served = [route for route in routes if isinstance(route, APIRoute)]
    allowed = sorted({name for route in served if route.path_regex.fullmatch(path) for name in route.methods})
    if not allowed:
        listed = ", ".join(sorted(f"{min(route.methods)} {route.path_format}" for route in served))
        return _json(request, 404, "unknown_url", f"no route {method} {path}; the routes under /v1 are: {listed}",
                     type="invalid_request_error")
    return _json(request, 405, "method_not_allowed", f"{method} is not allowed on {path}; use {', '.join(allowed)}",
                 {"Allow": ", ".join(allowed)})


async def _redis_unreachable(request: Request, err: Exception) -> JSONResponse:
    log.warning("Redis is unreachable: %s", err)
    return _json(request, 503, "redis_unreachable", REDIS_UNREACHABLE, {"Retry-After": "5"})


async def _client_left(request: Request, err: ClientDisconnect) -> JSONResponse:
    return _json(request, 400, "client_disconnected", "the client left before sending its whole request")


async def _unexpected(request: Request, err: Exception) -> JSONResponse:
    log.exception("%s %s failed", request.method, request.url.path, exc_info=err)
    return _json(request, 500, "internal_error", "the gateway failed; the error is in its log")


def install(app: FastAPI, openai_routes: Sequence[BaseRoute] = ()) -> None:
    """The error handlers; `openai_routes` are the routes under /v1 (for its 404 and 405)."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error(openai_routes))
    for unavailable in UNAVAILABLE:  # Redis down, or a cluster's master before its replica takes over
        app.add_exception_handler(unavailable, _redis_unreachable)
    app.add_exception_handler(ClientDisconnect, _client_left)
    app.add_exception_handler(Exception, _unexpected)
