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
rendezvous is up) and the pod is alive. /metrics answers the pod's metrics for Prometheus
(metrics.py), from the same thread: a scrape is one more short request.

The endpoint tells nothing secret (which ranks are late, by name), writes no file (the slots live
in shared memory that multiprocessing maps, under /dev/shm or the temporary directory), and answers
from one thread whatever unauthenticated clients do: no connection holds a thread or a slot that
the kubelet's probe needs (_Server says how).
"""

from __future__ import annotations

import collections
import errno
import http
import http.client
import multiprocessing
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from weightsync.job import LIVENESS, READINESS, Probe
from weightsync.runtime.metrics import exposition

BEAT = 1.0  # seconds between a rank's stamps
# A rank whose stamp is older has stopped, or its thread has not run for that long. Ten beats: a
# thread can wait seconds for the interpreter's lock while the rank's main thread is in a long call
# that holds it (importing torch on a loaded 2-core machine held it for up to 4.8 s), never ten.
STALE_AFTER = 10.0
# Connections whose request is incomplete, at most; one more closes the oldest. The kubelet sends
# one probe at a time (two with readiness), each answered as soon as its request is in.
MAX_PENDING = 64
REQUEST_TIMEOUT = 1.0  # seconds from a connection's accept to its whole request: a prober sends it at once
# seconds from a whole request to its answer's last byte sent: a scrape's answer may take a while to
# make on busy cores and to go as the client reads, and its time is not the request's
ANSWER_TIMEOUT = 10.0
MAX_REQUEST = 4096  # bytes of a request; a longer one is no probe
METRICS_PATH = "/metrics"  # where Prometheus scrapes the pod
# Connections accepted at a time before the requests already in are read: fewer than MAX_PENDING,
# so that a probe accepted amid a flood is read before the flood could make it the oldest.
ACCEPT_BATCH = 16

STARTING, READY, DONE = 0, 1, 2  # a rank's state, next to its stamp


class Scrapes:
    """When this process last answered /metrics. A pod that a Prometheus scrapes waits, as it stops
    after its job's end, until its final figures were read once (rank.linger): otherwise the last
    version's counts would go with the pod whenever it stopped between two scrapes."""

    def __init__(self):
        self.cond = threading.Condition()
        self.count, self.last = 0, 0.0

    def read(self) -> None:
        with self.cond:
            self.count, self.last = self.count + 1, time.monotonic()
            self.cond.notify_all()

    def since(self, moment: float, timeout: float) -> bool:
        """Whether /metrics was answered after `moment` (time.monotonic()), waiting `timeout` at most."""
        with self.cond:
            return self.cond.wait_for(lambda: self.last > moment, timeout)


SCRAPES = Scrapes()
FINAL_SCRAPE = 20.0  # seconds a stopping pod waits for a scrape of its final metrics (its grace is 30 s)


def final_scrape(since: float, say) -> None:
    """A pod that a Prometheus scrapes, stopping after its job's end: wait (FINAL_SCRAPE at most)
    until a scrape after `since` (time.monotonic()) read its final figures; `say` tells of the
    wait. A pod nobody scrapes, or one scraped since, goes at once."""
    if not SCRAPES.count or SCRAPES.since(since, 0):
        return
    say(f"waiting (at most {FINAL_SCRAPE:.0f}s) for a scrape of this pod's final metrics")
    if not SCRAPES.since(since, FINAL_SCRAPE):
        say(f"stopping: no scrape read this pod's final metrics within {FINAL_SCRAPE:.0f}s")


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
        self.stamp()
        threading.Thread(target=self._beat, name="health-beat", daemon=True).start()

    def stamp(self) -> None:
        """A sign of life now."""
        self._stamps[self.index] = time.monotonic()  # CLOCK_MONOTONIC: one clock for all processes

    def _beat(self) -> None:
        while True:
            self.stamp()
            time.sleep(BEAT)

    def ready(self, ready: bool = True) -> None:
        self._states[self.index] = READY if ready else STARTING


_mine: RankHealth | None = None  # this process's rank, once it started


def ready(ready: bool = True) -> None:
    """Tell the pod's readiness probe that this process's rank is ready: for an inference rank,
    once it runs on a verified version (a vLLM server's: while it is admitted to the job's fleet,
    vllm_backend/admission.py); for a trainer, once it joined the job; for the controller, once its
    rendezvous is up. `ready` False takes it back. In a process that is no rank of a worker pod (a
    test that drives a role directly) there is no endpoint to tell, and nothing happens."""
    if _mine is not None:
        _mine.ready(ready)


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

    def serve(self, host: str, port: int, registry: CollectorRegistry | None = None) -> None:
        """Answer /healthz and /readyz on host:port from a thread of this process, and /metrics
        from `registry` (metrics.py) where given."""
        try:
            self.server = _Server((host, port), self, registry)
        except OSError as e:
            raise OSError(e.errno, f"the health and metrics endpoint cannot listen on {host}:{port}: {e.strerror}"
                                   + (" (another process holds the port)" if e.errno == errno.EADDRINUSE else "")) from None
        threading.Thread(target=self.server.serve_forever, name="health-server", daemon=True).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@dataclass
class _Request:
    """A connection whose request is not complete yet."""

    sock: socket.socket
    fd: int  # the key it is pending under (a closed socket's fileno() is -1)
    deadline: float  # REQUEST_TIMEOUT after it was accepted, however slowly it trickles in
    data: bytearray = field(default_factory=bytearray)
    left: bool = False
    out: bytes = b""  # the answer's bytes that the socket's buffer did not take at once


class _Server:
    """Answers the probes from one thread, with a selector: a connection costs no thread, has
    REQUEST_TIMEOUT seconds from its accept to send its whole request (a byte now and then does not
    extend it), and its answer ANSWER_TIMEOUT seconds more to go, and at most MAX_PENDING are
    pending at once, one more closing the oldest. The
    prober sends its request as soon as it connects and is answered at once, so it never is the
    oldest for long; a client that holds connections open, idle or trickling, gains nothing."""

    def __init__(self, address: tuple[str, int], health: PodHealth, registry: CollectorRegistry | None = None):
        self.health, self.registry = health, registry
        self.listener = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind(address)
            self.listener.listen(128)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.server_address = self.listener.getsockname()
        self.pending: collections.OrderedDict[int, _Request] = collections.OrderedDict()  # by deadline, soonest first
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.wake_r, self.wake_w = socket.socketpair()
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.stopped = threading.Event()
        self.done = threading.Event()

    def serve_forever(self) -> None:
        try:
            while not self.stopped.is_set():
                timeout = None
                if self.pending:
                    timeout = max(0.0, next(iter(self.pending.values())).deadline - time.monotonic())
                for key, _ in self.selector.select(timeout):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj is not self.wake_r and not key.data.left:
                        self._write(key.data) if key.data.out else self._read(key.data)
                now = time.monotonic()
                while self.pending and next(iter(self.pending.values())).deadline <= now:
                    self._close(next(iter(self.pending.values())))
        finally:
            for request in list(self.pending.values()):
                self._close(request)
            self.done.set()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):  # then the requests and deadlines again, even under a flood
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError:  # out of descriptors: the oldest pending makes room at its deadline
                return
            while len(self.pending) >= MAX_PENDING:
                self._close(next(iter(self.pending.values())))
            sock.setblocking(False)
            request = _Request(sock, sock.fileno(), time.monotonic() + REQUEST_TIMEOUT)
            self.pending[request.fd] = request
            self.selector.register(sock, selectors.EVENT_READ, request)

    def _read(self, request: _Request) -> None:
        try:
            got = request.sock.recv(MAX_REQUEST - len(request.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(request)
            return
        request.data += got
        if not got or len(request.data) >= MAX_REQUEST:
            self._close(request)  # closed early, or not a probe
        elif b"\r\n\r\n" in request.data or b"\n\n" in request.data:
            self._answer(request)

    def _answer(self, request: _Request) -> None:
        line = bytes(request.data).split(b"\n", 1)[0].decode("latin-1").split()
        checks = {LIVENESS.path: self.health.liveness, READINESS.path: self.health.readiness}
        path = line[1].split("?", 1)[0] if len(line) >= 2 and line[0] in ("GET", "HEAD") else None
        check = checks.get(path) if path is not None else None
        kind = "text/plain; charset=utf-8"
        if path == METRICS_PATH and self.registry is not None:
            code, (body, kind) = 200, exposition(self.registry)
            SCRAPES.read()
        elif check is None:
            served = f"{LIVENESS.path}, {READINESS.path} and {METRICS_PATH}" if self.registry is not None else \
                f"{LIVENESS.path} and {READINESS.path}"
            code, body = 404, f"no such endpoint; this serves {served}\n".encode()
        else:
            ok, text = check()
            code, body = 200 if ok else 503, (text + "\n").encode()
        head = (f"HTTP/1.1 {code} {http.HTTPStatus(code).phrase}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        request.out = head + (b"" if line and line[0] == "HEAD" else body)
        request.deadline = time.monotonic() + ANSWER_TIMEOUT  # the latest of all: pending stays in deadline order
        self.pending.move_to_end(request.fd)
        self.selector.modify(request.fd, selectors.EVENT_WRITE, request)
        self._write(request)

    def _write(self, request: _Request) -> None:
        """Send what is left of the answer; a probe's fits the socket's buffer at once, a scrape's
        (a few kilobytes) almost always; the rest goes as the client reads, within ANSWER_TIMEOUT."""
        try:
            request.out = request.out[request.sock.send(request.out):]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            request.out = b""
        if not request.out:
            self._close(request)

    def _close(self, request: _Request) -> None:
        if request.left:
            return
        request.left = True
        self.pending.pop(request.fd, None)
        self.selector.unregister(request.fd)
        request.sock.close()

    def shutdown(self) -> None:
        self.stopped.set()
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass
        self.done.wait(10)

    def server_close(self) -> None:
        self.selector.close()
        self.listener.close()
        self.wake_r.close()
        self.wake_w.close()


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
