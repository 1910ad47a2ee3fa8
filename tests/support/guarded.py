"""Requests through the guard of a job's vLLM server (vllm_backend/guard.py), driven as vLLM's API
server drives the middleware, without vLLM: what the guard answered, and what of the request, if
anything, reached the server behind it."""

from __future__ import annotations

import asyncio
import json

from weightsync.job.join import JoinEnv
from weightsync.rendezvous.proofs import control_key
from weightsync.vllm_backend.guard import ControlGuard, sign

TOKEN = b"t" * 32
JOB = "default/demo"
KEY = control_key(TOKEN, JOB)
PASSED, ANSWERS = "test.passed", "test.answers"  # the request's own, in its scope, which the guard passes on
JOIN = {JoinEnv.CONTROLLER: "127.0.0.1:29700", JoinEnv.JOB_ID: JOB, JoinEnv.TOKEN: TOKEN.decode()}


class Answer:
    """`passed`: the body the server behind the guard got (None where nothing reached it)."""

    def __init__(self, status: int, headers: dict, body: dict, passed: bytes | None):
        self.status, self.headers, self.body, self.passed = status, headers, body, passed
        self.reached = passed is not None


async def asked(guard: ControlGuard, path: str, *, method: str = "POST", body: dict | bytes | None = None,
                signed: bool = False, headers: dict | None = None, server_answers: int = 200, app=None) -> Answer:
    """One request through the guard to a server that answers `server_answers` to whatever reaches it;
    `app`: what vLLM's API server puts in the request's scope (its FastAPI app, whose state holds
    vLLM's configuration)."""
    passed, sent = [], []

    read = []

    async def receive():  # the body, then the client's disconnect, as a connection says them
        if read:
            return {"type": "http.disconnect"}
        read.append(True)
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if body else b""
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message):
        sent.append(message)

    given = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if signed:
        given.append((b"authorization", f"Bearer {sign(KEY, method, path)}".encode()))
    where, _, query = path.partition("?")
    scope = {"type": "http", "method": method, "path": where, "query_string": query.encode(), "root_path": "",
             "headers": given, PASSED: passed, ANSWERS: server_answers, **({"app": app} if app else {})}
    guard.app = _server
    await guard(scope, receive, send)
    start = sent[0]
    return Answer(start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(sent[1]["body"]),
                  passed[0] if passed else None)


def ask(guard: ControlGuard, path: str, **how) -> Answer:
    """asked, on an event loop of its own."""
    return asyncio.run(asked(guard, path, **how))


async def _server(scope, receive, send) -> None:
    """The server behind the guard: it notes the body it got in the request's own list (the
    requests of one event loop reach it at once), then listens for the client's disconnect as
    vLLM's generation routes do (a body given again would spin that listener: it answers 500), and
    answers as the request says."""
    got = await receive()
    scope[PASSED].append(got["body"])
    after = await receive()
    status = scope[ANSWERS] if after["type"] == "http.disconnect" else 500
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})
