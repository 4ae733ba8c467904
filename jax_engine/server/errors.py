"""OpenAI-style error bodies, {"error": {"message", "type", "param", "code"}}, for every failure.

Clients see a status and a message that names the bad field; never a traceback or a file path.
"""

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    """An error to report to the client as is."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def bad_request(error: ValueError) -> APIError:
    """A ValueError from SamplingParams or the engine; its message starts with the field it is about."""
    message = str(error)
    match = re.match(r"([a-z_]+)", message)
    return APIError(400, message, match.group(1) if match else None)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
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
        return error_response(error.status, error.message, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(400, *_validation_message(error))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        phrase = HTTPStatus(error.status_code).phrase if error.status_code in HTTPStatus._value2member_map_ else ""
        return error_response(error.status_code, str(error.detail or phrase))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("request failed")  # the traceback goes to the server log, not to the client
        return error_response(500, "internal server error")
