"""The controller's client of a vLLM server's control routes (control.py), against an HTTP server
in the test that answers as vLLM's routes do and writes down what it was asked: the calls of one
update in their order, the per-call timings it returns, a server resumed when the load fails, and
the slowest server's timings over several, and an update into a session its workers kept open from
the version before (no start, and the label set without closing it), the job's control key on
every call, and a server whose control routes answer anyone; under spec.inference.vllm.inflight
keep, the pause that freezes the requests in flight, and the abort of those a failed load froze.
No vLLM here: the tests in test_vllm_engine.py and test_vllm_inflight.py drive real servers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from weightsync.rendezvous.messages import Staged
from weightsync.vllm_backend.control import ControlError, Server, Session, Unreachable, UpdateTimes
from weightsync.vllm_backend.guard import sign


def signed_by(header: str | None, key: str, method: str, target: str) -> bool:
    """Whether an Authorization header is a request to `target` signed with `key` (guard.sign)."""
    if not header or header.count(".") != 3:
        return False
    _, stamp, nonce, _ = header.removeprefix("Bearer ").split(".")
    return header == "Bearer " + sign(key, method, target, now=int(stamp), nonce=nonce)


class Routes:
    """An HTTP server on a free port: every request's path and body, in order; `failing` answers
    500; `dropping` closes the connection without an answer, as a server killed mid-call does."""

    def __init__(self, failing: str | None = None, dropping: str | None = None, guarded: str | None = None,
                 unrouted: bool = False):
        self.calls: list[tuple[str, dict | None]] = []
        self.keys: list[str | None] = []  # each call's Authorization header
        routes = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - a control route that changes nothing, as guard.py answers it
                ok = guarded is None or signed_by(self.headers.get("Authorization"), guarded, "GET", self.path)
                self.send_response(401 if not ok else 404 if unrouted else 200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def do_POST(self):  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                routes.calls.append((self.path, body))
                routes.keys.append(self.headers.get("Authorization"))
                if dropping and self.path.startswith(dropping):
                    self.close_connection = True
                    return
                code = 500 if failing and self.path.startswith(failing) else 200
                payload = b'{"error": "the load failed"}' if code == 500 else b"{}"
                self.send_response(code)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def routes():
    made = []

    def make(failing: str | None = None, dropping: str | None = None, guarded: str | None = None,
             unrouted: bool = False) -> Routes:
        made.append(Routes(failing, dropping, guarded, unrouted))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_an_update_opens_the_session_as_it_pauses_then_loads_labels_and_resumes(routes):
    server = routes()
    times = Server(server.url).update(7, "proof", 30)
    paths = [path for path, _ in server.calls]
    assert set(paths[:2]) == {"/start_weight_update", "/pause?mode=wait&clear_cache=true"}  # at once
    assert paths[2:] == ["/update_weights", "/finish_weight_update", "/resume"]
    assert server.calls[2][1] == {"update_info": {"version": 7, "proof": "proof"}}
    assert server.calls[3][1] == {"weight_version": "7"}
    assert isinstance(times, UpdateTimes)
    calls = times.to_json()
    assert set(calls) == {"pause", "start", "update", "finish", "resume", "stall"}
    assert all(v >= 0 for v in calls.values())
    assert times.stall >= times.update + times.finish + times.resume  # the pause's answer to the resume's


def test_a_session_kept_open_takes_one_call_of_the_workers_and_the_label_from_the_engine_core(routes):
    server = routes()
    times = Server(server.url).update(8, "proof", 30, Session(open=True, keep=True))
    assert [path for path, _ in server.calls] == ["/pause?mode=wait&clear_cache=true", "/update_weights",
                                                  "/update_weight_version", "/resume"]
    assert server.calls[1][1] == {"update_info": {"version": 8, "proof": "proof"}}
    assert server.calls[2][1] == {"new_version": "8"}
    assert set(times.to_json()) == {"pause", "update", "version", "resume", "stall"}  # no start, no finish
    assert times.start is None and times.finish is None


def test_a_session_opened_to_be_kept_is_opened_as_the_server_pauses_and_left_open(routes):
    server = routes()
    Server(server.url).update(1, "proof", 30, Session(open=False, keep=True))
    paths = [path for path, _ in server.calls]
    assert set(paths[:2]) == {"/start_weight_update", "/pause?mode=wait&clear_cache=true"}
    assert paths[2:] == ["/update_weights", "/update_weight_version", "/resume"]


def test_keep_freezes_the_requests_in_flight_and_keeps_the_cache_instead_of_waiting_for_them(routes):
    server = routes()
    Server(server.url).update(4, "proof", 30, Session(open=True, keep=True), keep=True)
    assert [path for path, _ in server.calls] == ["/pause?mode=keep&clear_cache=false", "/update_weights",
                                                  "/update_weight_version", "/resume"]


@pytest.mark.parametrize("failing, aborted", [("/update_weights", True), ("/update_weight_version", True),
                                              ("/start_weight_update", False)])
def test_an_update_under_keep_that_fails_once_the_load_began_aborts_the_requests_it_froze(routes, failing, aborted):
    server = routes(failing=failing)
    with pytest.raises(ControlError, match=f"{failing} answered 500") as failed:
        Server(server.url).update(4, "proof", 30, Session(open=failing != "/start_weight_update", keep=True), keep=True)
    paths = [path for path, _ in server.calls]
    assert paths[-1] == "/resume" and ("/pause?mode=abort&clear_cache=true" in paths) == aborted, paths
    # (a session that would not open loaded nothing: the requests frozen resume on the version they ran on)
    assert ("the requests frozen in flight were aborted" in str(failed.value)) == aborted


def test_a_servers_session_is_open_and_kept_only_where_every_worker_says_so():
    def staged(opened: bool, keep: bool) -> Staged:
        return Staged("abc", session_open=opened, keep_session=keep)

    assert Session.of([staged(True, True), staged(True, True)]) == Session(open=True, keep=True)
    assert Session.of([staged(True, True), staged(False, True)]) == Session(open=False, keep=True)
    assert Session.of([staged(False, False)]) == Session()
    # a worker that says nothing of it: open one, close it
    assert Session.of([Staged.from_json('{"digest": "abc"}')]) == Session()
    assert Session.of([]) == Session()


def test_a_failed_load_still_resumes_the_server_and_names_the_route(routes):
    server = routes(failing="/update_weights")
    with pytest.raises(ControlError, match="/update_weights answered 500"):
        Server(server.url).update(3, "proof", 30)
    assert [path for path, _ in server.calls][-2:] == ["/update_weights", "/resume"]
    assert "/finish_weight_update" not in [path for path, _ in server.calls]


def test_a_session_that_would_not_open_resumes_the_paused_server_and_loads_nothing(routes):
    server = routes(failing="/start_weight_update")
    with pytest.raises(ControlError, match="/start_weight_update answered 500"):
        Server(server.url).update(3, "proof", 30)
    paths = [path for path, _ in server.calls]
    assert paths[-1] == "/resume" and "/pause?mode=wait&clear_cache=true" in paths
    assert "/update_weights" not in paths and "/finish_weight_update" not in paths


def test_a_server_that_answers_an_error_is_not_unreachable_one_that_gives_no_answer_is(routes):
    """The controller lets a round go on without a server only when it gave no answer (and its
    ranks went away): an error it answered is never taken for that."""
    with pytest.raises(ControlError, match="answered 500") as answered:
        Server(routes(failing="/update_weights").url).update(3, "proof", 30)
    assert not isinstance(answered.value, Unreachable)
    dropped = routes(dropping="/update_weights")
    with pytest.raises(Unreachable, match="/update_weights could not be reached"):
        Server(dropped.url).update(3, "proof", 30)
    gone = routes()
    gone.close()
    with pytest.raises(Unreachable, match=r"/(start_weight_update|pause\?mode=wait&clear_cache=true) could not be "
                                          r"reached: .*[Rr]efused"):
        Server(gone.url).update(3, "proof", 30)


def test_the_slowest_takes_each_calls_longest_over_the_servers_that_made_it():
    a = UpdateTimes(pause=0.1, start=0.01, update=0.5, finish=0.02, version=None, resume=0.001, stall=0.6)
    b = UpdateTimes(pause=0.3, start=None, update=0.2, finish=None, version=0.01, resume=0.004, stall=0.3)
    assert UpdateTimes.slowest([a, b]) == UpdateTimes(pause=0.3, start=0.01, update=0.5, finish=0.02, version=0.01,
                                                      resume=0.004, stall=0.6)
    assert UpdateTimes.slowest([b]).to_json() == {"pause": 0.3, "update": 0.2, "version": 0.01, "resume": 0.004,
                                                  "stall": 0.3}
    assert UpdateTimes.slowest([]) == UpdateTimes(0.0, None, 0.0, None, None, 0.0, 0.0)


def test_every_call_carries_the_jobs_control_key_and_a_server_open_to_clients_is_told(routes):
    server = routes()
    Server(server.url, key="k3y").update(3, "proof", 30)
    assert len(server.keys) == len(server.calls) == 5, server.keys
    assert all(signed_by(key, "k3y", "POST", path) for key, (path, _) in zip(server.keys, server.calls)), server.keys
    assert len(set(server.keys)) == 5, "a signed request is good once: each carries a nonce of its own"
    # a server the user started without weightsync's middleware answers a control route to anyone;
    # the probe asks without the key, whoever asks
    assert Server(server.url, key="k3y").open_to_clients()
    assert not Server(routes(guarded="k3y").url, key="k3y").open_to_clients()
    # a server without the probe's route (404) is no guarded one: the middleware answers any
    # keyless request for a route not a client's with 401, before vLLM routes it
    assert Server(routes(unrouted=True).url, key="k3y").open_to_clients()
    assert not Server(routes(guarded="k3y", unrouted=True).url, key="k3y").open_to_clients()
    gone = routes()
    gone.close()
    with pytest.raises(Unreachable):
        Server(gone.url).open_to_clients()
