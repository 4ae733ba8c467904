"""vLLM's --enable-request-id-headers: every answer carries an X-Request-Id header, the request's own when it sent
one (a load balancer's or a gateway's trace id), else a new random one."""

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class RequestIdHeaderMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(b"x-request-id")
        request_id = sent if sent is not None else uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
