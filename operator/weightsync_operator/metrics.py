"""The operator's figures for Prometheus: the jobs it sees by phase, its reconciles and those that
ended in an error (or a retry), and the children it put back after someone deleted or changed
them. Served on their own port (METRICS_PORT_ENV; the chart sets it) in the text exposition
format, beside kopf's liveness endpoint. Each connection is answered on a thread of its own,
which gives up on a client that sends nothing for READ_TIMEOUT seconds: idle connections
cannot pile up threads.

One registry for the operator's process, never prometheus_client's global default one (which
would also show what kopf's libraries register). Labels stay bounded: a phase, never a job.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from weightsync.job.states import PENDING, PHASES  # a job's status.phase (status.py)

METRICS_PORT_ENV = "WEIGHTSYNC_OPERATOR_METRICS_PORT"
METRICS_PORT = 8081  # the chart's metrics.port
READ_TIMEOUT = 10.0  # seconds a connection may send nothing before its thread closes it


class _Handler(WSGIRequestHandler):
    """One connection: closed once its client sends nothing for READ_TIMEOUT seconds; logs nothing."""

    timeout = READ_TIMEOUT

    def handle(self) -> None:
        try:
            super().handle()
        except TimeoutError:
            pass  # an idle client: its connection closes, its thread ends

    def log_message(self, format, *args) -> None:  # noqa: A002 - the signature of the method it overrides
        pass


class OperatorMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.reconciles = Counter("weightsync_operator_reconciles", "Times the operator brought a job's children to "
                                  "what the job wants", registry=r)
        self.reconcile_errors = Counter("weightsync_operator_reconcile_errors", "Reconciles that ended in an error "
                                        "or a retry (an invalid spec, a refusal, a missing pull secret, an API error)",
                                        registry=r)
        self.children_repaired = Counter("weightsync_operator_children_repaired", "Children of jobs put back after "
                                         "someone deleted or changed them", registry=r)
        self._phases: dict[str, str] = {}  # job uid -> its phase
        self._lock = threading.Lock()  # kopf's handlers run on threads of their own
        r.register(self)

    def job_seen(self, uid: str, phase: str | None, gone: bool = False) -> None:
        """A job as the API server last showed it (gone: deleted)."""
        with self._lock:
            if gone:
                self._phases.pop(uid, None)
            else:
                self._phases[uid] = phase if phase in PHASES else PENDING  # Pending until it has one

    def describe(self):
        return [GaugeMetricFamily("weightsync_operator_jobs", "")]

    def collect(self):
        """Jobs by phase, counted at each scrape (every phase shown, 0 where none is in it)."""
        with self._lock:
            phases = list(self._phases.values())
        family = GaugeMetricFamily("weightsync_operator_jobs", "WeightTransferJobs the operator watches, by phase",
                                   labels=["phase"])
        for phase in PHASES:
            family.add_metric([phase], phases.count(phase))
        yield family

    def serve(self, host: str, port: int):
        """Answer scrapes on host:port from a thread of this process; returns the server."""
        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            request_queue_size = 64  # connections the kernel holds until this server accepts them

        try:
            server = make_server(host, port, make_wsgi_app(self.registry), Server, handler_class=_Handler)
        except OSError as e:
            raise OSError(e.errno, f"the operator's metrics endpoint cannot listen on {host}:{port}: {e.strerror}"
                          + (f" (another process holds the port; set {METRICS_PORT_ENV} to another)"
                             if e.errno == errno.EADDRINUSE else "")) from None
        threading.Thread(target=server.serve_forever, name="operator-metrics", daemon=True).start()
        return server


def metrics_port(environ=os.environ) -> int:
    """The port to serve on, from METRICS_PORT_ENV (default METRICS_PORT)."""
    value = environ.get(METRICS_PORT_ENV) or str(METRICS_PORT)
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"{METRICS_PORT_ENV} must be a port number from 1 to 65535, not {value!r}")
    return int(value)


METRICS = OperatorMetrics()  # the operator's process's
