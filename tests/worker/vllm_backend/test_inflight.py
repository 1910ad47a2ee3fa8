"""What a job's vLLM server's guard does with generation requests around a version's load
(vllm_backend/inflight.py), driven as vLLM's API server drives the middleware, without vLLM: every
request's cache salt is set server-side, keyed by the version held and the update epoch, a
client's own salt combined, never replaced; new requests are held from an update's pause until
its resume; a server that keeps requests across loads serves only the route that names each
token's version. (Against vLLM's own prefix cache and pause: test_vllm_inflight.py.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from support.guarded import JOIN, asked

from weightsync.vllm_backend import admission, inflight
from weightsync.vllm_backend.control import ABORT_PAUSE, FINISH_PAUSE, KEEP_PAUSE
from weightsync.vllm_backend.guard import ControlGuard

GENERATE = "/inference/v1/generate"


@pytest.fixture()
def guard() -> ControlGuard:
    """The guard of a server that serves version 1, the fleet's, for ever."""
    guard = ControlGuard(None, JOIN)
    guard.admission.told(current=1, lag=0, lease=None, now=0.0)
    guard.admission.labelled(1, now=0.0)
    return guard


def salt_of(answer) -> str:
    assert answer.reached, answer.body
    return json.loads(answer.passed)[inflight.SALT]


def run(*steps):
    """The steps (coroutines) on one event loop, one after the other; their answers."""
    async def all_of():
        return [await step for step in steps]
    return asyncio.run(all_of())


def test_every_generation_request_is_salted_with_the_version_and_a_clients_salt_is_combined_not_replaced(guard):
    plain, again, alice, bob, alice_again = run(
        asked(guard, GENERATE, body={"token_ids": [1, 2]}), asked(guard, "/v1/completions", body={"prompt": [3]}),
        asked(guard, GENERATE, body={"token_ids": [1], "cache_salt": "alice"}),
        asked(guard, GENERATE, body={"token_ids": [1], "cache_salt": "bob"}),
        asked(guard, "/v1/chat/completions", body={"messages": [], "cache_salt": "alice"}))
    assert salt_of(plain) == salt_of(again) == inflight.salt(1, 0)  # one version, one epoch: one cache
    assert plain.status == 200, "the server got the request's body twice (its disconnect listener would spin)"
    assert salt_of(plain).startswith("weightsync-v1-")
    assert json.loads(plain.passed)["token_ids"] == [1, 2]  # the rest of the request as the client sent it
    assert salt_of(alice) == salt_of(alice_again) == inflight.salt(1, 0, "alice")
    assert salt_of(alice).startswith(salt_of(plain)) and "alice" not in salt_of(alice)
    assert len({salt_of(plain), salt_of(alice), salt_of(bob)}) == 3  # clients that keep apart stay apart
    assert len(inflight.salt(10 ** 6, 10 ** 9, "x" * 128)) <= 128  # within vLLM's limit, whatever the client's


def test_a_load_starts_a_new_cache_epoch_even_under_the_same_label(guard):
    (before,) = run(asked(guard, GENERATE, body={"cache_salt": "alice"}))
    run(asked(guard, "/collective_rpc", body={"method": "reload_weights"}, signed=True))  # vLLM's own reload
    after, read = run(asked(guard, GENERATE, body={"cache_salt": "alice"}),
                      asked(guard, "/weight_info", method="GET"))
    assert guard.admission.held == 1 and salt_of(after) != salt_of(before)
    assert read.reached and json.loads(read.passed or b"{}") == {}  # a client's other routes pass as they are


@pytest.mark.parametrize("body, line", [(b"not json", "this one is not JSON"), ([1, 2], "not list"),
                                        ({"cache_salt": 7}, "cache_salt, where a request names one, is a non-empty"),
                                        ({"cache_salt": ""}, "is a non-empty string")])
def test_a_request_the_guard_cannot_salt_is_refused_on_one_line(guard, body, line):
    (said,) = run(asked(guard, GENERATE, body=body if isinstance(body, bytes) else json.dumps(body).encode()))
    assert (said.status, said.reached) == (400, False)
    assert said.body["error"]["message"].startswith(f"{GENERATE}: ") and line in said.body["error"]["message"]


def test_a_request_that_arrives_during_an_update_waits_for_its_resume_and_runs_salted_with_the_new_version(guard):
    async def update():
        await asked(guard, KEEP_PAUSE, signed=True)
        waiting = asyncio.ensure_future(asked(guard, GENERATE, body={"token_ids": [1]}))
        await asyncio.sleep(0.2)
        held = not waiting.done()
        await asked(guard, "/update_weights", body={"update_info": {"version": 2}}, signed=True)
        await asked(guard, "/update_weight_version", body={"new_version": "2"}, signed=True)
        still = not waiting.done()
        await asked(guard, "/resume", signed=True)
        return held, still, await waiting

    held, still, answer = asyncio.run(update())
    assert held and still, "a request reached the server during an update"
    assert salt_of(answer).startswith("weightsync-v2-")


def test_a_request_held_while_the_load_fails_is_refused_at_once_and_a_failed_pause_holds_nothing(guard):
    async def failing():
        await asked(guard, FINISH_PAUSE, signed=True)
        waiting = asyncio.ensure_future(asked(guard, GENERATE, body={}))
        await asyncio.sleep(0.1)
        await asked(guard, "/update_weights", body={"update_info": {"version": 2}}, signed=True, server_answers=500)
        return await asyncio.wait_for(waiting, 5)  # not held until the resume

    refused = asyncio.run(failing())
    assert (refused.status, refused.reached) == (503, False)
    assert "its last load failed part-way" in refused.body["error"]["message"]
    run(asked(guard, "/resume", signed=True), asked(guard, "/update_weights", body={}, signed=True),
        asked(guard, "/finish_weight_update", body={"weight_version": "3"}, signed=True))
    (paused,) = run(asked(guard, FINISH_PAUSE, signed=True, server_answers=500))  # the server did not pause
    assert paused.status == 500 and not guard.updates.under_way
    (served,) = run(asked(guard, GENERATE, body={}))
    assert salt_of(served).startswith("weightsync-v3-")


def test_a_held_request_is_refused_once_the_server_stops_hearing_its_controller(guard, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(admission, "now", lambda: now[0])
    guard.admission.told(current=1, lag=0, lease=admission.LEASE, now=now[0])

    async def frozen_controller():
        await asked(guard, KEEP_PAUSE, signed=True)
        waiting = asyncio.ensure_future(asked(guard, GENERATE, body={}))
        await asyncio.sleep(0.1)
        now[0] += admission.LEASE + 1  # the controller paused the server and said nothing more
        return await asyncio.wait_for(waiting, 5)

    refused = asyncio.run(frozen_controller())
    assert refused.status == 503 and "has not heard from the job's controller" in refused.body["error"]["message"]


def test_a_server_that_keeps_requests_across_loads_serves_only_the_route_that_names_each_tokens_version(guard):
    run(asked(guard, KEEP_PAUSE, signed=True), asked(guard, "/resume", signed=True))
    assert guard.updates.keep
    for route in sorted(admission.GENERATION_ROUTES - inflight.SPAN_ROUTES):
        (said,) = run(asked(guard, route, body={}))
        assert (said.status, said.reached) == (400, False), route
        assert said.body["error"]["message"].startswith(
            f"{route}: this vLLM server keeps requests in flight across versions (spec.inference.vllm.inflight "
            "keep), so an answer must say which version produced which token, and only /inference/v1/generate")
    (said,) = run(asked(guard, GENERATE, body={}))
    assert said.reached
    # a failed update's abort says nothing of the mode; a pause that waits for the requests does
    run(asked(guard, ABORT_PAUSE, signed=True), asked(guard, "/resume", signed=True))
    assert guard.updates.keep
    run(asked(guard, FINISH_PAUSE, signed=True), asked(guard, "/resume", signed=True))
    assert not guard.updates.keep and run(asked(guard, "/v1/completions", body={}))[0].reached


def test_a_server_of_several_api_processes_refuses_to_keep_requests_on_one_line(guard):
    def app(processes: int) -> SimpleNamespace:  # vLLM's API server app, as a request's scope holds it
        return SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(
            parallel_config=SimpleNamespace(_api_process_count=processes))))

    refused, waited = run(asked(guard, KEEP_PAUSE, signed=True, app=app(2)),
                          asked(guard, FINISH_PAUSE, signed=True, app=app(2)))
    assert (refused.status, refused.reached) == (409, False)
    assert refused.body["error"]["message"].startswith(
        "/pause?mode=keep: this vLLM server runs 2 API processes (--api-server-count), and the guard of each sees "
        "only the updates sent to it")
    assert waited.reached  # finish clears the cache in every process's engine: nothing to keep
    (kept,) = run(asked(guard, KEEP_PAUSE, signed=True, app=app(1)))
    assert kept.reached and guard.updates.keep
