"""OpenAI-style error bodies, {"error": {"message", "type", "param", "code"}}, for every failure.

Clients see a status and a message that names the bad field; never a traceback or a file path.
"""

import json
import logging
import re
import uuid
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import Send

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "service_unavailable_error"}
# How long a client turned away (503: a full queue, no free connection, a dead engine) should wait before it
# retries: the Retry-After header every 503 carries.
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error to report to the client as is."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def queue_full(message: str) -> APIError:
    return APIError(503, message, code="queue_full")


def internal_error(context: str, error: BaseException) -> APIError:
    """A 500 that tells the client nothing of the internals, only an id to find the traceback in the log."""
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    logger.error("%s (error id %s)", context, error_id, exc_info=error)
    return APIError(500, f"internal server error (error id {error_id}; the server log has the details)",
                    code="internal_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _headers(status: int, headers: dict[str, str] | None) -> dict[str, str]:
    retry = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == 503 else {}
    return {**retry, **(headers or {})}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=_headers(status, headers))


def bad_request(error: ValueError, prompt_field: str = "prompt") -> APIError:
    """A ValueError from SamplingParams or the engine; its message starts with the field it is about. The engine
    calls every request's text its prompt: `prompt_field` names the request field that text came from (a chat's
    messages, an embedding's input); its beam_width is a request's n."""
    message = re.sub(r"^beam_width\b", "n", re.sub(r"^prompt\b", prompt_field, str(error)))
    match = re.match(r"([a-z_]+)", message)
    return APIError(400, message, match.group(1) if match else None)


async def send_error(send: Send, status: int, message: str, code: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    """Answer with an error body straight from an ASGI middleware, before any route runs."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(name.lower().encode(), value.encode()) for name, value in _headers(status, headers).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of a body that does not fit its pydantic model (pydantic's ValidationError too)."""
    details = error.errors()
    if not details:
        return "invalid request body", None
    first = details[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = where[0] if where else None
    location = ".".join(where) or "body"
    return f"{location}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.code, error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(400, *validation_message(error))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        phrase = HTTPStatus(error.status_code).phrase if error.status_code in HTTPStatus._value2member_map_ else ""
        message = str(error.detail or phrase)
        if isinstance(error.__cause__, RecursionError):  # FastAPI's JSON parse of the body
            message = "the request body nests too deep to parse"
        return error_response(error.status_code, message, headers=error.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        failure = internal_error(f"{request.method} {request.url.path} failed", error)
        return error_response(failure.status, failure.message, code=failure.code)
