"""A job's vLLM server answers its clients' generation routes only while it holds a version the
job's fleet accepts (vllm_backend/admission.py, enforced by guard.py), driven as vLLM's API server
drives the middleware, without vLLM. (Against real servers, a restarted one among them:
test_vllm_engine.py.)"""

from __future__ import annotations

import pytest
from support.guarded import JOIN, Answer, ask

from weightsync.vllm_backend import admission
from weightsync.vllm_backend.guard import ControlGuard


@pytest.fixture()
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(admission, "now", lambda: now[0])
    return now


def label(guard: ControlGuard, version: int, route: str = "/finish_weight_update") -> None:
    field = admission.LABEL_ROUTES[route]
    assert ask(guard, route, body={field: str(version)}, signed=True).reached


def tell(guard: ControlGuard, current: int, lag: int = 0, lease: float | None = admission.LEASE) -> Answer:
    return ask(guard, admission.word(current, lag, lease), signed=True)


def test_a_server_that_holds_no_version_of_the_job_answers_503_with_retry_after_until_it_is_labelled(clock):
    guard = ControlGuard(None, JOIN)
    refused = ask(guard, "/v1/completions", body={"prompt": "hi"})
    assert (refused.status, refused.reached) == (503, False)
    assert refused.headers["retry-after"] == str(admission.RETRY_AFTER)
    assert refused.headers[admission.VERSION_HEADER] == "none"
    assert "holds no version of the job yet (it started, restarted or joined late)" in refused.body["error"]["message"]
    for open_route in ("/health", "/v1/models", "/weight_info", "/metrics", "/tokenize"):  # not generation
        assert ask(guard, open_route, method="GET").reached
    said = ask(guard, admission.ROUTE, method="GET")  # the readiness a load balancer may follow
    assert (said.status, said.body["admitted"], said.body["held"]) == (503, False, None)

    label(guard, 3)  # the controller labels what it loaded, before it resumes the server
    assert ask(guard, "/v1/completions", body={"prompt": "hi"}).reached
    assert ask(guard, "/inference/v1/generate", body={"token_ids": [1]}).reached
    said = ask(guard, admission.ROUTE, method="GET")
    assert (said.status, said.body) == (200, {"admitted": True, "held": 3, "current": 3, "lag": 0})


def test_a_server_behind_the_fleet_by_more_than_the_lag_is_out_and_one_within_it_serves(clock):
    guard = ControlGuard(None, JOIN)
    label(guard, 4, "/update_weight_version")
    assert tell(guard, current=6).status == 503  # the word itself is answered with the admission
    refused = ask(guard, "/v1/chat/completions", body={"messages": []})
    assert refused.status == 503 and refused.headers[admission.VERSION_HEADER] == "4"
    assert "holds version 4, 2 behind the fleet's 6 (spec.inference.maxVersionLag 0)" in refused.body["error"]["message"]
    assert tell(guard, current=6, lag=2).status == 200
    assert ask(guard, "/v1/chat/completions", body={"messages": []}).reached
    label(guard, 7)  # a label past the fleet's version makes it the fleet's
    assert guard.admission.current == 7


def test_a_client_that_asks_for_a_newer_version_gets_409_and_never_older_tokens(clock):
    guard = ControlGuard(None, JOIN)
    label(guard, 3)
    refused = ask(guard, "/v1/completions", headers={admission.MIN_VERSION_HEADER: "4"})
    assert (refused.status, refused.reached, refused.headers[admission.VERSION_HEADER]) == (409, False, "3")
    assert "holds version 3, older than the 4" in refused.body["error"]["message"]
    assert ask(guard, "/v1/completions", headers={admission.MIN_VERSION_HEADER: "3"}).reached
    bad = ask(guard, "/v1/completions", headers={admission.MIN_VERSION_HEADER: "latest"})
    assert (bad.status, bad.reached) == (400, False) and "'latest' is not a version number" in bad.body["error"]["message"]


def test_a_server_that_stops_hearing_the_controller_stops_serving_and_the_jobs_last_word_lasts(clock):
    guard = ControlGuard(None, JOIN)
    label(guard, 2)
    tell(guard, current=2)
    clock[0] += admission.LEASE - 0.1
    assert ask(guard, "/v1/completions").reached
    clock[0] += 1.0  # frozen, cut off, or its controller gone: the fleet may have moved on
    refused = ask(guard, "/v1/completions")
    assert refused.status == 503 and "has not heard from the job's controller for 7s" in refused.body["error"]["message"]
    tell(guard, current=2, lease=None)  # the job ended: its final version, for ever
    clock[0] += 10_000
    assert ask(guard, "/v1/completions").reached


def test_a_load_that_fails_part_way_keeps_the_server_out_until_a_version_loads_whole(clock):
    guard = ControlGuard(None, JOIN)
    label(guard, 1)
    assert ask(guard, "/update_weights", body={"update_info": {"version": 2}}, signed=True,
               server_answers=500).status == 500
    refused = ask(guard, "/v1/completions")
    assert refused.status == 503 and "its last load failed part-way" in refused.body["error"]["message"]
    ask(guard, "/update_weights", body={"update_info": {"version": 3}}, signed=True)
    assert ask(guard, "/v1/completions").status == 503  # loaded, not labelled yet: still out
    label(guard, 3)
    assert ask(guard, "/v1/completions").reached


def test_only_the_controller_moves_the_fleet_and_a_server_of_no_job_serves_every_client(clock):
    guard = ControlGuard(None, JOIN)
    label(guard, 5)
    assert ask(guard, admission.word(9, 0)).status == 401  # unsigned
    assert ask(guard, "/update_weight_version", body={"new_version": "1"}).status == 401
    assert guard.admission.held == 5 and guard.admission.current == 5
    bad = ask(guard, admission.ROUTE + "?current=x", signed=True)
    assert bad.status == 400 and "takes ?current=<version>" in bad.body["error"]["message"]
    plain = ControlGuard(None, {})
    assert ask(plain, "/v1/completions").reached
    assert ask(plain, admission.ROUTE, method="GET").body == {"admitted": True, "job": None}


def test_a_request_signed_with_the_jobs_key_reads_whatever_the_server_holds(clock):
    """The controller's key may load and reset the weights anyway: it may also read the start-up
    weights, as a test compares them with vLLM's own load of the checkpoint."""
    guard = ControlGuard(None, JOIN)
    assert ask(guard, "/v1/completions", body={"prompt": "hi"}, signed=True).reached
    assert ask(guard, "/v1/completions", body={"prompt": "hi"}).status == 503
