"""What a job's vLLM server answers to whom: its clients generate, only the job's controller
changes what it holds or how it labels a version.

vLLM serves its control routes (pause, load, label, /weight_checker, /collective_rpc, /sleep, ...)
only with VLLM_SERVER_DEV_MODE=1, which weightsync needs, and on the port its clients use, to
anyone who reaches it: a client could relabel a request in flight or zero the weights of a
verified version. ControlGuard, an ASGI middleware that vLLM's API server installs from its own
`--middleware` argument (the pod's server command has it; a server the user starts is told to
add it), answers every route that is not a client's only to a request that carries the job's
control key (rendezvous/protocol.control_key: an HMAC of the job's token) as its bearer; others
get 401 (no key) or 403 (another key) and reach nothing. The clients' routes are named here
(CLIENT_ROUTES), and everything else is a control route: a route a newer vLLM adds is closed
until it is named.

Plain ASGI, standard library only: the API server is vLLM's, and the tests drive the middleware
without it.
"""

from __future__ import annotations

import json
import os
from typing import Awaitable, Callable, Mapping

from weightsync.job import Env, WorkerContext
from weightsync.job.join import Join
from weightsync.job.token import same
from weightsync.rendezvous.protocol import control_key

MIDDLEWARE = "weightsync.vllm_backend.guard.ControlGuard"  # vLLM's --middleware takes its import path

# What a client of the job's server may call (the server is a causal LM with --enable-scale-out):
# generation, its OpenAI- and Anthropic-style routes and their renderings, tokenization, the
# served model, version and weight version, health, load and metrics, and the API's own docs
CLIENT_ROUTES = frozenset({
    "/v1/completions", "/v1/completions/render", "/v1/completions/derender",
    "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/chat/completions/render",
    "/v1/chat/completions/derender", "/v1/responses", "/v1/responses/render", "/v1/messages",
    "/v1/messages/count_tokens", "/v1/messages/render", "/v1/systemone", "/v1/models",
    "/inference/v1/generate", "/inference/v1/abort_requests", "/generative_scoring", "/invocations",
    "/tokenize", "/detokenize",
    "/health", "/ping", "/load", "/metrics", "/version", "/weight_info", "/is_paused", "/is_sleeping",
    "/kv_event_sources",
    "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc",
})
CLIENT_PREFIXES = ("/v1/responses/",)  # /v1/responses/{id} and its /cancel

Scope = dict
App = Callable[[Scope, Callable, Callable], Awaitable[None]]


def route_path(scope: Scope) -> str:
    """The path the API server routes by: the request's, less the server's root path (as
    Starlette's routing takes it)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (path == root or path[len(root)] == "/"):
        return path[len(root):]
    return path


def resolved(path: str) -> str:
    """`path` with its empty, `.` and `..` segments resolved, as a server or a proxy that
    normalizes paths would route it: /v1/responses/../../pause is /pause, whatever route's prefix
    it starts with."""
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/" + "/".join(parts) + ("/" if path.endswith("/") and parts else "")


def is_client_route(path: str) -> bool:
    """Whether a client may call `path`, judged by the path it resolves to."""
    path = resolved(path)
    return path in CLIENT_ROUTES or path.startswith(CLIENT_PREFIXES)


def job_key(environ: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """(the job's identity, its control key) for the server this process runs: a server the user
    started has the join variables (job/join.py), a pod's server the pod's contract; None for a
    server of no job."""
    join = Join.from_environ(environ)
    if join is not None:
        return join.job_id, control_key(join.token, join.job_id)
    if not environ.get(Env.SPEC_FILE):
        return None
    ctx = WorkerContext.from_environ(environ)
    return ctx.job.identity, control_key(ctx.token, ctx.job.identity)


class ControlGuard:
    """The API server's outermost middleware: a request for a route that is not a client's passes
    only with `Authorization: Bearer <the job's control key>`."""

    def __init__(self, app: App, environ: Mapping[str, str] = os.environ) -> None:
        self.app = app
        found = job_key(environ)
        self.job, self.key = found if found is not None else (None, None)

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or is_client_route(route_path(scope)):
            return await self.app(scope, receive, send)
        given = _bearer(scope)
        if given is not None and self.key is not None and same(given.encode(), self.key.encode()):
            return await self.app(scope, receive, send)
        await self._refuse(scope, send, 401 if given is None else 403)

    async def _refuse(self, scope: Scope, send: Callable, status: int) -> None:
        route = f"{scope.get('method', 'WEBSOCKET')} {route_path(scope)}"
        owner = f"job {self.job}'s controller" if self.job else "no one (this server belongs to no weightsync job)"
        why = "no control key" if status == 401 else "a control key that is not this job's"
        message = (f"{route} is a control route of this vLLM server, answered only to {owner}, and the request "
                   f"carried {why}; clients keep the generation routes (/v1/completions, /v1/chat/completions, "
                   "/inference/v1/generate, ...), /v1/models, /health, /metrics, /version and /weight_info")
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": {"message": message, "code": status}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            return key.strip() if scheme.lower() == "bearer" else ""
    return None
