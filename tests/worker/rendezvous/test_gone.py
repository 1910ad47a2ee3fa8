"""A vLLM server that stopped answering in the middle of a round, in one process: the controller
asks the roster whether the server's ranks went with it. They did once the roster counts them
away, which takes silent_limit without a beat from the roster's first look at them, however late
that look comes; they did not while they beat on, which the roster tells at their second beat,
without waiting out its bound. (With a real vLLM server killed while it loads a version:
tests/worker/vllm_backend/test_external_vllm.py.)"""
import socket
import threading
import time

import pytest
from support import roster
from support.roster import join, make_host

from weightsync.job import Layout
from weightsync.rendezvous.messages import Ready
from weightsync.rendezvous.protocol import Keys
from weightsync.roles.controller.loads import calls
from weightsync.vllm_backend.control import ControlError, Server, Unreachable

JOB = "default/gone"
ONE = Layout(trainers=1, trainer_procs=1, inferences=1, inference_procs=1)
SILENT = 1.0


@pytest.fixture()
def said():
    return []


@pytest.fixture()
def host(said):
    host = make_host(ONE, JOB, said, silent_limit=SILENT, away_limit=60.0)
    members = {role: roster.member(host, role, 0, job=JOB) for role in ("trainer", "inference")}
    for m in members.values():
        join(m, f"127.0.0.1:{1000 + len(m.role)}")
    admitted = host.admit(timeout=10)
    host.publish_plan("{}", {0: admitted[("inference", 0)].endpoint})
    members["trainer"].set(Keys.ready(1, 0), Ready(10))
    assert host.next_version(1)
    host.start_round(1)
    yield host
    host.store.close()


def beat(host, times: int, every: float) -> None:
    for _ in range(times):
        host.store.add(Keys.beat("inference", 0), 1)
        time.sleep(every)


def test_a_server_whose_ranks_stopped_beating_is_gone_once_they_are_counted_away(host, said):
    beat(host, 3, 0.05)  # beats the roster has not looked at: its first look counts from then
    began = time.monotonic()
    assert host.gone([0], within=20 * SILENT)
    assert SILENT <= time.monotonic() - began < 10 * SILENT
    assert any(line.startswith("inference rank 0 is away: no heartbeat for") for line in said), said


def test_a_server_whose_ranks_beat_on_is_alive_at_their_second_beat(host, said):
    answered = threading.Event()  # the ranks beat until the roster answered, however long it takes

    def beat_on() -> None:
        while not answered.is_set():
            beat(host, 1, 0.05)

    beating = threading.Thread(target=beat_on, daemon=True)
    beating.start()
    began = time.monotonic()
    try:
        assert not host.gone([0], within=60.0)
    finally:
        answered.set()
    assert time.monotonic() - began < 10, "waited out the bound for a rank that beats on"
    assert not any("is away" in line for line in said), said
    beating.join()


def test_a_servers_load_call_is_not_waited_for_once_its_ranks_went_away(host, said):
    """A server whose engine died mid-load: its API process holds the controller's call open (here
    a port that accepts and never answers) while its workers, dead with the engine, beat no more.
    The call is given up once the roster counts them away, long before its own deadline."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = "http://127.0.0.1:%d" % silent.getsockname()[1]

        def load(u: str):  # as the controller's own: an error is returned, to be judged
            try:
                return Server(u).update(1, "proof", 120.0)
            except ControlError as e:
                return e

        beat(host, 3, 0.05)  # its workers beat, then die with the engine
        began = time.monotonic()
        loads = calls(host, {url: [0]}, load, "version 1")
        took = time.monotonic() - began
    assert isinstance(loads[url], Unreachable) and "its workers went away while it loaded version 1" in str(loads[url])
    assert SILENT <= took < 30, f"the call was given up {took:.1f}s after it began"
    assert any(line.startswith("inference rank 0 is away: no heartbeat for") for line in said), said
    assert host.gone([0], within=0.0)  # as the load's judge then finds it


def test_a_servers_load_that_answers_is_its_answer(host):
    answered = ControlError("http://server/update_weights answered 500: no", 500)
    assert calls(host, {"http://server": [0]}, lambda u: answered, "version 1") == {"http://server": answered}
