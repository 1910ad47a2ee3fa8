"""What a job's vLLM server answers to whom: its clients generate, only the job's controller
changes what it holds or how it labels a version.

vLLM serves its control routes (pause, load, label, /weight_checker, /collective_rpc, /sleep, ...)
only with VLLM_SERVER_DEV_MODE=1, which weightsync needs, and on the port its clients use, to
anyone who reaches it: a client could relabel a request in flight or zero the weights of a
verified version. ControlGuard, an ASGI middleware that vLLM's API server installs from its own
`--middleware` argument (the pod's server command has it; a server the user starts is told to
add it), answers every route that is not a client's only to a request signed with the job's control key
(rendezvous/proofs.control_key: an HMAC of the job's token); others get 401 (no bearer) or 403
(another key, an old or replayed request) and reach nothing. The clients' routes are named here
(CLIENT_ROUTES), and everything else is a control route: a route a newer vLLM adds is closed
until it is named. A path is judged by the route it resolves to (resolved): dot segments do not
smuggle a control route behind a client's prefix.

The key itself never crosses the wire, which is plain HTTP inside the cluster: each request's
bearer is an HMAC of its method, its path and query, its time and a nonce (sign). The guard takes
it within WINDOW seconds of its own clock and once, so a captured request opens nothing later:
replayed, it is refused as answered before; held back and sent in the original's place within the
window, it does what the original would have done, on the route the original named, and nothing
else (its body is not signed: a load still needs the version's proof, which the worker checks).
A server of several API processes (--api-server-count) keeps a nonce cache in each.

A server started for a trainer that runs its job's controller itself (vLLM's trainer-side engine
with no job file: integrations/vllm.py) has no job yet, only the secret it shares with that trainer
(WEIGHTSYNC_TOKEN, or the file WEIGHTSYNC_TOKEN_FILE names). vLLM's HTTP client sends the trainer's
init with no header, so the init carries its proof in its body (sign_init: a bearer signed with the
job's control key over the job's controller and this server's URL); the guard passes an init whose
proof holds, within its window and once, and refuses any other (401 where the server has no
secret, 403 where the proof is not its secret's). Once the server's workers took it, the guard
answers the control routes to that job's controller, as a job's server does from its start.

The guard also keeps the server out of its job's fleet while it holds no version the fleet accepts
(admission.py): its generation routes answer 503 (or 409, to a client that asks for a newer
version) until it does. And it sets every generation request's cache salt, keyed by the version
the server holds, holding new requests back while an update is under way (inflight.py).

Plain ASGI, standard library only: the API server is vLLM's, and the tests drive the middleware
without it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from typing import Awaitable, Callable, Mapping

from weightsync.job import Env, SpecError, WorkerContext
from weightsync.job.join import Join, JoinEnv, shared_token
from weightsync.job.token import same
from weightsync.rendezvous.proofs import control_key
from weightsync.vllm_backend import admission, inflight
from weightsync.vllm_backend.admission import Admission

MIDDLEWARE = "weightsync.vllm_backend.guard.ControlGuard"  # vLLM's --middleware takes its import path
INIT_ROUTE = "/init_weight_transfer_engine"
INIT_FIELDS = ("job_id", "controller", "server", "proof")  # what a trainer's init tells a server of no job yet

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

# the signed calls whose outcome the guard follows (_watched)
WATCHED = frozenset({*admission.LABEL_ROUTES, admission.LOAD_ROUTE, inflight.PAUSE_ROUTE, inflight.RESUME_ROUTE})

SCHEME = "ws1"  # a signed bearer: ws1.<unix seconds>.<nonce>.<HMAC-SHA256 hex>
WINDOW = 120.0  # seconds either side of the server's clock within which a signed request is taken

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


def _mac(key: str, stamp: str, nonce: str, method: str, target: str) -> str:
    return hmac.new(key.encode(), f"{stamp}.{nonce}.{method.upper()} {target}".encode(), hashlib.sha256).hexdigest()


def sign(key: str, method: str, target: str, now: float | None = None, nonce: str | None = None) -> str:
    """The bearer of one control request to `target` (its path and query, as sent) with `method`,
    signed with the job's control key at `now` (the time, by default)."""
    stamp = str(int(time.time() if now is None else now))
    nonce = nonce or secrets.token_hex(12)
    return f"{SCHEME}.{stamp}.{nonce}.{_mac(key, stamp, nonce, method, target)}"


def init_target(controller: str, server: str) -> str:
    """What an init's proof signs besides its method: the route, the job's controller (where the
    server's workers join) and the server's URL (where the controller drives its updates)."""
    return f"{INIT_ROUTE}?controller={controller}&server={server}"


def sign_init(token: bytes, job: str, controller: str, server: str, now: float | None = None) -> str:
    """The proof a trainer's init carries to a server of no job yet (its init_info's `proof`)."""
    return sign(control_key(token, job), "POST", init_target(controller, server), now)


def init_proven(token: bytes, job: str, controller: str, server: str, proof: str) -> bool:
    """Whether `proof` is sign_init's for these, made with `token` (a worker's own check: the
    guard in front of it also holds the proof to its window and to once)."""
    return unsigned(control_key(token, job), proof, "POST", init_target(controller, server)) is None


def unsigned(key: str, given: str, method: str, target: str) -> str | None:
    """Why `given` is not a bearer signed with `key` for `method` and `target`, whenever it was
    signed (None where it is one; the guard holds it to its window and to once besides)."""
    scheme, stamp, nonce, mac = (given.split(".") + ["", "", "", ""])[:4]
    if scheme != SCHEME or not stamp.isdigit() or not nonce or not mac:
        return "a bearer that is not a signed control request"
    if not same(mac.encode(), _mac(key, stamp, nonce, method, target).encode()):
        return "a control key that is not this job's, or a signature of another request"
    return None


def _target(scope: Scope) -> str:
    """The request's path and query as the client sent them (what it signed)."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    return (path + (b"?" + query if query else b"")).decode("latin-1")


class ControlGuard:
    """The API server's outermost middleware: a request for a route that is not a client's passes
    only with `Authorization: Bearer <sign(the job's control key, its method, its path)>`."""

    def __init__(self, app: App, environ: Mapping[str, str] = os.environ) -> None:
        self.app = app
        found = job_key(environ)
        self.job, self.key = found if found is not None else (None, None)
        self.token = None  # a server of no job yet: the secret its trainer's init proves
        if found is None:
            try:
                self.token = shared_token(environ)
            except SpecError as e:  # the server's start ends here, with the line alone
                raise SystemExit(f"weightsync: {e.problems[0]}") from None
        self._seen: dict[str, float] = {}  # nonce -> its stamp, for WINDOW seconds either side
        self.admission = Admission()
        self.updates = inflight.Updates()

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = resolved(route_path(scope))
        if path == admission.ROUTE and scope["type"] == "http":
            return await self._admission(scope, send)
        if path == INIT_ROUTE and self.token is not None and scope["type"] == "http":
            return await self._init(scope, receive, send)
        if is_client_route(path):
            if path in admission.GENERATION_ROUTES and scope["type"] == "http":
                return await self._generation(path, scope, receive, send)
            return await self.app(scope, receive, send)
        given = _bearer(scope)
        why = "no control key" if given is None else self._refusal(given, scope)
        if why is None:
            if scope.get("method", "GET") != "GET":  # it may change the weights (inflight.py)
                self.updates.changed()
            if scope["type"] == "http" and path in WATCHED:
                return await self._watched(path, scope, receive, send)
            return await self.app(scope, receive, send)
        await self._refuse(scope, send, 401 if given is None else 403, why)

    def _admits(self, scope: Scope, path: str) -> tuple[int, str, list] | None:
        """(status, message, headers) where a client's request must not reach a server out of its
        job's fleet (admission.py); None where it may, as any request to a server of no job, and
        one signed with the job's control key (which may load and reset the weights anyway: it
        reads what the server holds, whatever that is)."""
        if self.key is None or path not in admission.GENERATION_ROUTES or scope["type"] != "http":
            return None
        given = _bearer(scope)
        if given and self._refusal(given, scope) is None:
            return None
        try:
            floor = admission.min_version(scope.get("headers", ()))
        except ValueError as e:
            return 400, str(e), []
        refused = self.admission.refusal(admission.now(), floor)
        if refused is None:
            return None
        held = "none" if self.admission.held is None else str(self.admission.held)
        return (*refused, [(b"retry-after", str(admission.RETRY_AFTER).encode()),
                           (admission.VERSION_HEADER.encode(), held.encode())])

    async def _admission(self, scope: Scope, send: Callable) -> None:
        """GET: the server's admission, to anyone (200 admitted, 503 not); POST: the controller's
        word on the fleet's version (signed, as every control route)."""
        if scope.get("method", "GET") != "GET":
            given = _bearer(scope)
            why = "no control key" if given is None else self._refusal(given, scope)
            if why is not None:
                return await self._refuse(scope, send, 401 if given is None else 403, why)
            try:
                self.admission.told(*admission.told_by(scope.get("query_string") or b""), admission.now())
            except ValueError as e:
                return await self._answer(send, 400, str(e), [])
        said = self.admission.to_json(admission.now()) if self.key is not None else {"admitted": True, "job": None}
        await _json(send, 200 if said["admitted"] else 503, said)

    async def _init(self, scope: Scope, receive: Callable, send: Callable) -> None:
        """A trainer's init to a server of no job yet: passed on where its proof holds; the job it
        names is the server's once the server answered it 2xx."""
        body = await _body(receive)
        try:
            info = json.loads(body or b"{}").get("init_info") or {}
            job, controller, server, proof = (str(info[f]) for f in INIT_FIELDS)
        except (ValueError, AttributeError, KeyError):
            return await self._answer(send, 400, f"{INIT_ROUTE}: weightsync's init names its job, its controller, this "
                                                 f"server and a proof ({', '.join(INIT_FIELDS)}); this one does not", [])
        key = control_key(self.token, job)
        why = self._verify(key, proof, "POST", init_target(controller, server))
        if why is not None:
            return await self._answer(send, 403, f"{INIT_ROUTE}: this vLLM server refused the init of job {job}: it "
                                                 f"carried {why}; give the trainer and this server the same secret "
                                                 f"({JoinEnv.TOKEN} or {JoinEnv.TOKEN_FILE})", [])
        status: list[int] = []
        await self._passed(scope, body, receive, send, status)
        if status and 200 <= status[0] < 300:
            self.job, self.key = job, key

    async def _passed(self, scope: Scope, body: bytes, receive: Callable, send: Callable, status: list[int]) -> None:
        """Pass a request whose body was read on to the server, noting the status it answers in `status`.
        The server gets `body` once, then what the connection says next (the client's disconnect:
        vLLM's generation routes listen for it while they generate, and a body given again at once
        would spin that listener, holding the event loop for ever)."""
        given = []

        async def replay() -> dict:
            if given:
                return await receive()
            given.append(True)
            return {"type": "http.request", "body": body, "more_body": False}

        async def noted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, replay, noted)

    async def _generation(self, path: str, scope: Scope, receive: Callable, send: Callable) -> None:
        """A client's generation request: held while an update is under way, refused where the
        server must not serve it, passed on with its cache salt set (inflight.py)."""
        refused = await self.updates.hold(lambda: self._admits(scope, path)) or self._admits(scope, path)
        if refused is not None:
            return await self._answer(send, *refused)
        why = inflight.spanless(path, self.updates.keep)
        if why is not None:
            return await self._answer(send, 400, why, [])
        try:
            body = inflight.salted(await _body(receive), self.admission.held, self.updates.epoch)
        except ValueError as e:
            return await self._answer(send, 400, f"{path}: {e}", [])
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"]
        await self._passed({**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}, body,
                           receive, send, [])

    async def _watched(self, path: str, scope: Scope, receive: Callable, send: Callable) -> None:
        """A signed call the guard follows, passed on, and what it did: a label answered 2xx names
        the version the server holds; a load that fails leaves none whole; a pause starts an update
        (unless it failed: the server did not pause), a resume ends it."""
        body = await _body(receive)
        status: list[int] = []
        pause = inflight.Pause.of(scope.get("query_string") or b"") if path == inflight.PAUSE_ROUTE else None
        keep = pause is not None and pause.mode == "keep"
        if pause is not None:
            why = inflight.keep_problem(scope) if keep else None
            if why is not None:
                return await self._answer(send, 409, why, [])
            self.updates.pausing(pause)
        try:
            kept = await inflight.pause_kept(scope, pause) if keep else None  # (inflight.py)
            if kept is None:
                await self._passed(scope, body, receive, send, status)
            else:
                status.append(kept[0])
                await _json(send, *kept)
        finally:
            ok = bool(status) and 200 <= status[0] < 300
            version = admission.label_of(path, body)
            if ok and version is not None:
                self.admission.labelled(version, admission.now())
            elif path == admission.LOAD_ROUTE and not ok:
                self.admission.load_failed()
            if path == inflight.RESUME_ROUTE or (path == inflight.PAUSE_ROUTE and not ok):
                self.updates.resumed()
            self.updates.looked()  # the requests held see what the call did to the server's admission

    def _refusal(self, given: str, scope: Scope) -> str | None:
        """Why a signed bearer does not open this request (None where it does)."""
        if self.key is None:
            return "a control key, and this server has none"
        return self._verify(self.key, given, scope.get("method", "GET"), _target(scope))

    def _verify(self, key: str, given: str, method: str, target: str) -> str | None:
        """Why `given` is not a bearer signed with `key` for `method` and `target`, within the
        window and unseen (None where it is one)."""
        if (why := unsigned(key, given, method, target)) is not None:
            return why
        _, stamp, nonce = given.split(".", 3)[:3]
        now = time.time()
        if abs(now - int(stamp)) > WINDOW:
            return (f"a request signed {now - int(stamp):+.0f}s from this server's clock (more than {WINDOW:.0f}s: "
                    "an old request, or clocks apart)")
        if nonce in self._seen:
            return "a request answered before (a replay)"
        self._seen = {n: t for n, t in self._seen.items() if abs(now - t) <= WINDOW}
        self._seen[nonce] = int(stamp)
        return None

    async def _refuse(self, scope: Scope, send: Callable, status: int, why: str) -> None:
        route = f"{scope.get('method', 'WEBSOCKET')} {route_path(scope)}"
        if self.job is None and resolved(route_path(scope)) == INIT_ROUTE and self.token is None:
            return await self._answer(send, status, f"{route}: this vLLM server has no weightsync secret, so it takes "
                                                    f"no trainer's init: start it with {JoinEnv.TOKEN} (or "
                                                    f"{JoinEnv.TOKEN_FILE}) set to its trainer's secret", [])
        owner = f"job {self.job}'s controller" if self.job else "no one (this server belongs to no weightsync job)"
        message = (f"{route} is a control route of this vLLM server, answered only to {owner}, and the request "
                   f"carried {why}; clients keep the generation routes (/v1/completions, /v1/chat/completions, "
                   "/inference/v1/generate, ...), /v1/models, /health, /metrics, /version and /weight_info")
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await self._answer(send, status, message, [(b"www-authenticate", b"Bearer")] if status == 401 else [])

    @staticmethod
    async def _answer(send: Callable, status: int, message: str, headers: list) -> None:
        await _json(send, status, {"error": {"message": message, "code": status}}, headers)


async def _json(send: Callable, status: int, said: dict, headers: list = ()) -> None:
    body = json.dumps(said).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


async def _body(receive: Callable) -> bytes:
    chunks, more = [], True
    while more:  # the control requests' bodies are small JSON objects
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            return key.strip() if scheme.lower() == "bearer" else ""
    return None
