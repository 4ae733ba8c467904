"""Bearer-token authentication for every route but /health (vLLM's --api-key).

A plain ASGI middleware, so it sees each request before routing and never buffers a streamed response.
The decision rests on the exact path alone (no Host header, no trailing-slash or case variants of
"/health"), and the key is compared in constant time.
"""

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from jax_engine.server.errors import error_body

UNPROTECTED_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNPROTECTED_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, "missing or invalid API key", code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        given = [value for name, value in scope["headers"] if name == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0], self.expected)
