"""The middleware a job's vLLM server runs its requests through (vllm_backend/guard.py), driven as
vLLM's API server drives it, without vLLM: a client's route passes with no key, a control route
only with the job's control key (401 without one, 403 with another), and nothing of a refused
request reaches the server. (Against a real server: test_vllm_engine.py.)"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from weightsync.job.join import JoinEnv
from weightsync.rendezvous.proofs import control_key
from weightsync.vllm_backend.guard import CLIENT_ROUTES, WINDOW, ControlGuard, job_key, sign

TOKEN = b"t" * 32
JOB = "default/demo"
KEY = control_key(TOKEN, JOB)
JOIN = {JoinEnv.CONTROLLER: "127.0.0.1:29700", JoinEnv.JOB_ID: JOB, JoinEnv.TOKEN: TOKEN.decode()}


def ask(guard: ControlGuard, path: str, key: str | None = None, root: str = "", kind: str = "http",
        bearer: str | None = None) -> tuple[dict, bool]:
    """(what the guard answered, or {} where it passed the request on; whether the server got it).
    `key` signs the request (guard.sign); `bearer` is sent as it is instead."""
    reached, sent = [], []

    async def server(scope, receive, send):
        reached.append(scope["path"])

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    guard.app = server
    bearer = sign(key, "POST", root + path) if key else bearer
    headers = [(b"content-type", b"application/json")] + ([(b"authorization", f"Bearer {bearer}".encode())]
                                                          if bearer else [])
    where, _, query = (root + path).partition("?")
    scope = {"type": kind, "method": "POST", "path": where, "query_string": query.encode(), "root_path": root,
             "headers": headers}
    asyncio.run(guard(scope, receive, send))
    if not sent:
        return {}, bool(reached)
    if kind == "websocket":
        return sent[0], bool(reached)
    return {"status": sent[0]["status"], **json.loads(sent[1]["body"])["error"]}, bool(reached)


@pytest.fixture()
def guard() -> ControlGuard:
    """The guard of a server that holds the fleet's version, whose generation routes are open
    (test_admission.py: those of a server behind it are not)."""
    guard = ControlGuard(None, JOIN)
    guard.admission.told(current=0, lag=0, lease=None, now=0.0)
    guard.admission.labelled(0, now=0.0)
    return guard


@pytest.mark.parametrize("path", ["/update_weight_version", "/weight_checker", "/collective_rpc", "/pause", "/resume",
                                  "/sleep", "/update_weights", "/init_weight_transfer_engine", "/reset_prefix_cache",
                                  "/scale_elastic_ep", "/v1/load_lora_adapter", "/pause/", "//pause", "/nowhere",
                                  # dot segments resolve to the route they name, whatever prefix they start with
                                  "/v1/responses/../../pause", "/v1/responses/x/../../../update_weights",
                                  "/v1/responses/./../../v1/load_lora_adapter", "/health/../collective_rpc"])
def test_a_control_route_answers_only_the_jobs_control_key(guard, path):
    said, reached = ask(guard, path)
    assert (said["status"], reached) == (401, False)
    assert said["message"].startswith(f"POST {path} is a control route of this vLLM server, answered only to job "
                                      f"{JOB}'s controller, and the request carried no control key")
    said, reached = ask(guard, path, key=control_key(b"o" * 32, JOB))
    assert (said["status"], reached) == (403, False)
    assert "carried a control key that is not this job's" in said["message"]
    assert ask(guard, path, key=KEY) == ({}, True)


@pytest.mark.parametrize("path", sorted(CLIENT_ROUTES) + ["/v1/responses/resp-1", "/v1/responses/resp-1/cancel"])
def test_clients_keep_their_routes_without_a_key(guard, path):
    assert ask(guard, path) == ({}, True)


def test_the_route_is_the_one_the_server_routes_by(guard):
    # behind a root path (vLLM's --root-path) the route is what follows it
    assert ask(guard, "/v1/completions", root="/api") == ({}, True)
    assert ask(guard, "/pause", root="/api")[0]["status"] == 401
    assert ask(guard, "/pause", key=KEY, root="/api") == ({}, True)
    # a websocket to a control route is closed before the server sees it
    assert ask(guard, "/pause", kind="websocket") == ({"type": "websocket.close", "code": 1008}, False)


def test_a_server_of_no_job_answers_its_control_routes_to_no_one():
    guard = ControlGuard(None, {})
    said, reached = ask(guard, "/pause", key=KEY)
    assert (said["status"], reached) == (403, False)
    assert "answered only to no one (this server belongs to no weightsync job)" in said["message"]
    assert ask(guard, "/v1/completions") == ({}, True)
    assert job_key(JOIN) == (JOB, KEY) and job_key({}) is None


def test_a_signed_request_opens_its_own_route_once_within_its_window(guard):
    """The control key never crosses the wire: a captured request is good for nothing later."""
    bearer = sign(KEY, "POST", "/pause")
    assert ask(guard, "/pause", bearer=bearer) == ({}, True)
    said, reached = ask(guard, "/pause", bearer=bearer)
    assert (said["status"], reached) == (403, False) and "carried a request answered before (a replay)" in said["message"]
    said, _ = ask(guard, "/collective_rpc", bearer=sign(KEY, "POST", "/pause"))  # another route's signature
    assert said["status"] == 403 and "a signature of another request" in said["message"]
    said, _ = ask(guard, "/pause", bearer=sign(KEY, "POST", "/pause", now=time.time() - WINDOW - 5))
    assert said["status"] == 403 and "from this server's clock (more than 120s" in said["message"]
    said, _ = ask(guard, "/pause", bearer=KEY)  # the key itself, as a bearer
    assert said["status"] == 403 and "a bearer that is not a signed control request" in said["message"]
    assert ask(guard, "/pause?mode=wait", bearer=sign(KEY, "POST", "/pause"))[0]["status"] == 403  # the query is signed
