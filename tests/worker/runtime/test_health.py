"""A worker pod's probes (weightsync.runtime.health): /healthz fails while any of the pod's rank processes
is stopped and does not answer while the pod's own process is stopped; /readyz waits for every
rank. Real processes: the pod's health in this process with its ranks spawned as a pod spawns
them, and a real `weightsync worker` pod process."""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.health import DEADLINE, answer, until, worker_env

from weightsync.job import LIVENESS, READINESS, Env, Probe
from weightsync.runtime import health


def rank_process(slot: health.RankHealth, go_ready) -> None:
    """A rank's process, as roles.supervise starts one: stamps from its own thread, then says it
    is ready when told."""
    slot.start()
    go_ready.wait()
    health.ready()
    time.sleep(DEADLINE * 5)


@pytest.fixture
def pod():
    """A pod's health with two ranks, served on a free loopback port, and its two rank processes."""
    pod = health.PodHealth(["trainer rank 0", "trainer rank 1"])
    pod.serve("127.0.0.1", 0)
    spawn = multiprocessing.get_context("spawn")
    events = [spawn.Event(), spawn.Event()]
    procs = [spawn.Process(target=rank_process, args=(pod.rank(i), events[i]), daemon=True) for i in range(2)]
    yield pod, pod.server.server_address[1], procs, events
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.join(DEADLINE)
    pod.close()


@pytest.mark.slow  # waits out the probes' deadlines: not in `make unit`
def test_readyz_waits_for_every_rank_and_healthz_fails_while_one_is_stopped(pod):
    pod, port, procs, events = pod
    assert answer(port) == (True, "HTTP 200: alive: trainer rank 0, trainer rank 1")
    assert answer(port, READINESS) == (False, "HTTP 503: not ready yet: trainer rank 0, trainer rank 1")
    for p in procs:
        p.start()
    events[0].set()
    until("trainer rank 0 ready", lambda: answer(port, READINESS)[1] == "HTTP 503: not ready yet: trainer rank 1")
    events[1].set()
    until("the pod ready", lambda: answer(port, READINESS) == (True, "HTTP 200: ready: trainer rank 0, trainer rank 1"))

    os.kill(procs[1].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    ok, text = until("/healthz failing", lambda: failing(port))
    assert time.monotonic() - stopped >= health.STALE_AFTER - health.BEAT  # its last stamp was fresh
    assert text.startswith("HTTP 503: trainer rank 1: no sign of life for ") and "rank 0" not in text
    assert not answer(port, READINESS)[0]
    os.kill(procs[1].pid, signal.SIGCONT)
    until("/healthz passing again", lambda: answer(port)[0])

    # A rank whose process ended cleanly (its job is over) no longer has to stamp.
    procs[0].kill()
    procs[0].join(DEADLINE)
    pod.finished(0)
    time.sleep(health.STALE_AFTER + health.BEAT)  # past the time its stamp would have gone stale
    assert answer(port)[0] and answer(port, READINESS)[0]


def test_only_the_two_paths_are_served(pod):
    _, port, _, _ = pod
    other = Probe("/metrics", 5, 2, 1)
    assert answer(port, other) == (False, "HTTP 404: no such endpoint; this serves /healthz and /readyz")


def test_idle_connections_are_closed_at_their_deadline_and_the_oldest_make_room(pod):
    """A client that connects and sends nothing holds nothing for long: each connection is closed
    REQUEST_TIMEOUT after its accept, and one beyond MAX_PENDING closes the oldest at once."""
    _, port, _, _ = pod
    idle = [socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) for _ in range(health.MAX_PENDING + 1)]
    try:
        assert idle[0].recv(1) == b""  # the oldest, closed to make room for the last
        for s in idle[1:]:
            start = time.monotonic()
            while s.recv(4096):
                pass
            assert time.monotonic() - start < DEADLINE
        assert answer(port)[0]
    finally:
        for s in idle:
            s.close()


def test_probes_are_answered_while_clients_trickle_bytes_into_every_connection(pod):
    """Slow clients that each send one byte now and then, as many as the server holds, cannot keep
    the kubelet's probes from their answers: no connection outlives REQUEST_TIMEOUT, however it
    trickles, and a probe is answered as soon as its request is in."""
    _, port, _, _ = pod
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:
                    while not stop.is_set():
                        s.sendall(b"G")
                        time.sleep(0.2)
            except OSError:
                continue  # closed by the server: connect again at once, as an attacker would

    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(health.MAX_PENDING)]
    for t in threads:
        t.start()
    try:
        time.sleep(2 * health.REQUEST_TIMEOUT)
        for _ in range(10):  # the kubelet's probes, each given LIVENESS's timeout
            assert answer(port) == (True, "HTTP 200: alive: trainer rank 0, trainer rank 1")
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(DEADLINE)


# ---------------------------------------------------------------- a real worker pod process

def start_worker(tmp_path: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "weightsync.cli", "worker"], env=env, stdin=subprocess.DEVNULL,
                            stdout=open(tmp_path / "out.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def end(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGCONT)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(DEADLINE)


@pytest.mark.slow  # a worker pod as a process, stopped: not in `make unit`
def test_a_stopped_controller_pod_answers_no_probe(tmp_path):
    """The controller pod: ready once its rendezvous is up; while its process is stopped, a probe
    gets no answer within its timeout, as the kubelet's would not; continued, it answers again.
    (Each answer is waited for: on a busy machine one probe may time out, as the kubelet allows.)"""
    env = worker_env(tmp_path, ordinal=0)
    port = int(env[Env.HEALTH_PORT])
    proc = start_worker(tmp_path, env)

    def ready_or_exited():
        got = answer(port, READINESS)
        return got if got[0] else proc.poll() is not None

    try:
        got = until("the controller pod ready", ready_or_exited)
        assert proc.poll() is None, (tmp_path / "out.log").read_text()
        assert got == (True, "HTTP 200: ready: controller")
        os.killpg(proc.pid, signal.SIGSTOP)  # the whole pod, as a frozen container
        # a stop is delivered, not done, when kill returns: a thread running on another core
        # answers on until the kernel stops it
        until("the pod's processes stopped", lambda: group_stopped(proc.pid))
        start = time.monotonic()
        assert answer(port) == (False, f"no answer within {LIVENESS.timeout_seconds}s")
        assert time.monotonic() - start >= LIVENESS.timeout_seconds
        os.killpg(proc.pid, signal.SIGCONT)
        assert until("an answer once continued", lambda: (got := answer(port))[0] and got)[1].startswith("HTTP 200")
    finally:
        end(proc)


def group_stopped(pgid: int) -> bool:
    """Whether every process of the process group is stopped (state T in /proc/PID/stat)."""
    states = []
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split() if proc.name.isdigit() else None
        except OSError:
            continue
        if fields and int(fields[2]) == pgid:
            states.append(fields[0])
    return bool(states) and all(state == "T" for state in states)


def rank_processes(pid: int) -> list[int]:
    """The pod process's children that run ranks (not multiprocessing's resource tracker)."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            found.append(int(child))
    return found


def failing(port: int):
    got = answer(port)
    return None if got[0] else got


@pytest.mark.slow  # waits out the liveness deadline: not in `make unit`
def test_a_stopped_rank_process_fails_its_pods_liveness(tmp_path):
    """A trainer pod with two rank processes (no controller to join, so they wait, alive): either
    of them stopped fails the pod's /healthz, naming that rank; the pod's own process still answers."""
    env = worker_env(tmp_path, ordinal=1, procs=2)
    port = int(env[Env.HEALTH_PORT])
    proc = start_worker(tmp_path, env)
    try:
        ranks = until("two rank processes", lambda: (lambda c: c if len(c) == 2 else None)(rank_processes(proc.pid)))
        until("both ranks stamping", lambda: answer(port) == (True, "HTTP 200: alive: trainer rank 0, trainer rank 1"))
        assert answer(port, READINESS) == (False, "HTTP 503: not ready yet: trainer rank 0, trainer rank 1")
        named = []
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
            _, text = until("/healthz failing", lambda: failing(port))
            assert text.startswith("HTTP 503: trainer rank ") and ": no sign of life for " in text, text
            named.append(text.split()[4].rstrip(":"))
            assert text.count("no sign of life") == 1
            os.kill(pid, signal.SIGCONT)
            until("/healthz passing again", lambda: answer(port)[0])
        assert sorted(named) == ["0", "1"]
        assert proc.poll() is None
    finally:
        end(proc)
