"""Bearer-token authentication for every route but /health (vLLM's --api-key), one key or several.

A plain ASGI middleware, so it sees each request before routing and never buffers a streamed response.
The decision rests on the exact path alone (no Host header, no trailing-slash or case variants of
"/health"), and every key is compared in constant time. The request's `state.tenant` names the key it
used (see ServerConfig.prefix_cache_isolation). A 401 closes the connection: a client without a key holds
none (see connections.py).
"""

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from jax_engine.server.errors import send_error
from jax_engine.server.state import api_key_tenant

UNPROTECTED_PATHS = frozenset({"/health"})


class APIKeys:
    """The server's keys, each with its tenant name; no keys: every request is let in."""

    def __init__(self, api_keys: tuple[str, ...]) -> None:
        self.expected = {f"Bearer {key}".encode(): api_key_tenant(key.encode()) for key in api_keys}

    def tenant(self, scope: Scope) -> str | None:
        """The tenant of the request's key, or None if it has no valid key."""
        given = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(given) != 1:
            return None
        matches = [tenant for key, tenant in self.expected.items() if hmac.compare_digest(given[0], key)]
        return matches[0] if matches else None

    def admits(self, scope: Scope) -> bool:
        """Whether the request proves its client is one of the server's: a protected path with a valid key, or
        with any request when there are no keys."""
        return scope["path"] not in UNPROTECTED_PATHS and (not self.expected or self.tenant(scope) is not None)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app, self.keys = app, APIKeys(api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNPROTECTED_PATHS:
            await self.app(scope, receive, send)
            return
        tenant = self.keys.tenant(scope)
        if tenant is None:
            await send_error(send, 401, "missing or invalid API key", code="invalid_api_key",
                             headers={"www-authenticate": "Bearer", "connection": "close"})
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
