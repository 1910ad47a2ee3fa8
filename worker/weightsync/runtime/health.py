"""A worker pod's liveness and readiness, over HTTP for the kubelet's probes (and for the local
runner's, which probes its pods as the kubelet does).

A pod runs one process per rank (roles.supervise) and answers the probes from its first process.
Each rank's process proves that it runs: a thread of its own stamps the time into the rank's slot
of shared memory every BEAT seconds, and /healthz answers 200 only while every rank's stamp is
fresh. So a rank process that is stopped (SIGSTOP) or starved fails the probe, and a stopped pod
process answers nothing (the probe times out). A thread stamps, not the rank's own loop: a rank
may wait for minutes for good reasons (a slow peer, a long step, a model loading), which liveness
must not punish; whether the ranks make progress is the rendezvous' business, with the job's
deadlines.

/readyz answers 200 once every rank of the pod said it is ready (ready(): an inference rank once
it runs on a verified version, a trainer once it joined the job, the controller once its
rendezvous is up) and the pod is alive.

The endpoint tells nothing secret (which ranks are late, by name), writes no file (the slots live
in shared memory that multiprocessing maps, under /dev/shm or the temporary directory), and holds
at most MAX_CONNECTIONS connections at once, each for at most REQUEST_TIMEOUT seconds: idle
connections cannot pile up threads.
"""

from __future__ import annotations

import http.client
import multiprocessing
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from weightsync.job import LIVENESS, READINESS, Probe

BEAT = 1.0  # seconds between a rank's stamps
# A rank whose stamp is older has stopped, or its thread has not run for that long. Ten beats: a
# thread can wait seconds for the interpreter's lock while the rank's main thread is in a long call
# that holds it (importing torch on a loaded 2-core machine held it for up to 4.8 s), never ten.
STALE_AFTER = 10.0
MAX_CONNECTIONS = 8  # the kubelet sends one probe at a time, two with readiness
REQUEST_TIMEOUT = 1.0  # seconds a connection may take to send its request: an answer is immediate

STARTING, READY, DONE = 0, 1, 2  # a rank's state, next to its stamp


class RankHealth:
    """One rank's slot in its pod's health. It is handed to the rank's process (it pickles into a
    spawned process with the shared memory it points at)."""

    def __init__(self, stamps, states, index: int):
        self._stamps, self._states, self.index = stamps, states, index

    def start(self) -> None:
        """In the rank's own process, first thing: stamp now and every BEAT seconds from a thread
        of this process; ready() from now on marks this rank ready."""
        global _mine
        _mine = self
        self._stamps[self.index] = time.monotonic()
        threading.Thread(target=self._beat, name="health-beat", daemon=True).start()

    def _beat(self) -> None:
        while True:
            self._stamps[self.index] = time.monotonic()  # CLOCK_MONOTONIC: one clock for all processes
            time.sleep(BEAT)

    def ready(self) -> None:
        self._states[self.index] = READY


_mine: RankHealth | None = None  # this process's rank, once it started


def ready() -> None:
    """Tell the pod's readiness probe that this process's rank is ready: for an inference rank,
    once it runs on a verified version; for a trainer, once it joined the job; for the controller,
    once its rendezvous is up. In a process that is no rank of a worker pod (a test that drives a
    role directly) there is no endpoint to tell, and nothing happens."""
    if _mine is not None:
        _mine.ready()


class PodHealth:
    """The pod's side: a slot for each of its ranks (named as the answers name them, e.g.
    "trainer rank 3"), and the HTTP server that answers the probes from them."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self._stamps = multiprocessing.RawArray("d", len(self.names))
        self._states = multiprocessing.RawArray("b", len(self.names))
        for index in range(len(self.names)):
            self.starting(index)
        self.server: _Server | None = None

    def rank(self, index: int) -> RankHealth:
        return RankHealth(self._stamps, self._states, index)

    def starting(self, index: int) -> None:
        """The rank's process is starting: it has STALE_AFTER seconds to stamp."""
        self._stamps[index] = time.monotonic()
        self._states[index] = STARTING

    def finished(self, index: int) -> None:
        """The rank's process ended cleanly (its job is over): it no longer needs to stamp."""
        self._states[index] = DONE

    def liveness(self) -> tuple[bool, str]:
        now = time.monotonic()
        stale = [f"{name}: no sign of life for {now - self._stamps[i]:.1f}s"
                 for i, name in enumerate(self.names) if self._states[i] != DONE and now - self._stamps[i] > STALE_AFTER]
        if stale:
            return False, "; ".join(stale) + " (its process is stopped or gets no CPU time)"
        return True, "alive: " + ", ".join(self.names)

    def readiness(self) -> tuple[bool, str]:
        alive, why = self.liveness()
        if not alive:
            return False, why
        waiting = [name for i, name in enumerate(self.names) if self._states[i] == STARTING]
        if waiting:
            return False, "not ready yet: " + ", ".join(waiting)
        return True, "ready: " + ", ".join(self.names)

    def serve(self, host: str, port: int) -> None:
        """Answer /healthz and /readyz on host:port from a thread of this process."""
        try:
            self.server = _Server((host, port), self)
        except OSError as e:
            raise OSError(e.errno, f"the health endpoint cannot listen on {host}:{port}: {e.strerror}") from None
        threading.Thread(target=self.server.serve_forever, name="health-server", daemon=True).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    timeout = REQUEST_TIMEOUT  # a socket timeout for the whole exchange
    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        checks = {LIVENESS.path: self.server.health.liveness, READINESS.path: self.server.health.readiness}
        check = checks.get(self.path.split("?", 1)[0])
        if check is None:
            code, text = 404, f"no such endpoint; this serves {LIVENESS.path} and {READINESS.path}"
        else:
            ok, text = check()
            code = 200 if ok else 503
        body = (text + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002
        pass  # a probe every few seconds would fill the pod's log; the prober reports failures


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], health: PodHealth):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.health = health
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own looks up the host's name (DNS): nothing here needs it.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a prober that gave up and left is no error here
            super().handle_error(request, client_address)

    def verify_request(self, request, client_address) -> bool:
        return self._slots.acquire(blocking=False)  # refused (closed) beyond MAX_CONNECTIONS

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def probe(host: str, port: int, spec: Probe) -> tuple[bool, str]:
    """One probe as the kubelet makes it: an HTTP GET of spec.path, answered within
    spec.timeout_seconds with a status from 200 to 399. Returns (success, what happened)."""
    connection = http.client.HTTPConnection(host, port, timeout=spec.timeout_seconds)
    try:
        connection.request("GET", spec.path)
        response = connection.getresponse()
        body = response.read(2048).decode(errors="replace").strip()
    except TimeoutError:
        return False, f"no answer within {spec.timeout_seconds}s"
    except OSError as e:
        return False, e.strerror or str(e)
    except http.client.HTTPException as e:
        return False, f"not an HTTP answer: {type(e).__name__} {e}"
    finally:
        connection.close()
    return 200 <= response.status < 400, f"HTTP {response.status}: {body}"
