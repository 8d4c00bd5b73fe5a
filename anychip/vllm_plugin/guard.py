"""The API key on every route of an `anychip serve` server, not only vLLM's guarded prefixes.

vLLM 0.32 checks `--api-key` / VLLM_API_KEY only for paths under /v1, /v2, /inference and /cohere; SageMaker's
/invocations runs completions and chat without a key, and /tokenize, /detokenize and /metrics answer anyone. When a
key is set, `anychip serve` adds this middleware (vLLM's `--middleware`), which asks every HTTP or WebSocket request
for it except the health probes a load balancer sends without credentials (OPEN) and CORS preflights.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from typing import Any

#: Paths served without the key: liveness and readiness probes.
OPEN = ("/health", "/ping")
KEY_ENV = "VLLM_API_KEY"  # what `anychip serve` passes the key in (never on the command line)


class KeyOnEveryRoute:
    """ASGI middleware: 401 for a request without `Authorization: Bearer <key>` on any path but OPEN. The key is
    read from $VLLM_API_KEY when the server builds its app; without one it passes everything through."""

    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (self._digest is None or scope.get("type") not in ("http", "websocket")
                or scope.get("method") == "OPTIONS"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if path.rstrip("/") in OPEN or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error":"Unauthorized"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
