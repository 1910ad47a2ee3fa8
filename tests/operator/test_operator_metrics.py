"""The operator's metrics (weightsync_operator.metrics), scraped and parsed as Prometheus parses
them: every name and type pinned, jobs counted by phase; a taken port refused in one line; and
the operator running against the local control plane counts its reconciles and the children it
put back."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from controlplane import wait_for
from prometheus_client.parser import text_string_to_metric_families

import weightsync.job
from weightsync_operator import metrics

TYPES = {"weightsync_operator_reconciles": "counter", "weightsync_operator_reconcile_errors": "counter",
         "weightsync_operator_children_repaired": "counter", "weightsync_operator_jobs": "gauge",
         # each counter also as the gauge of when it was created (prometheus_client's <name>_created)
         "weightsync_operator_reconciles_created": "gauge", "weightsync_operator_reconcile_errors_created": "gauge",
         "weightsync_operator_children_repaired_created": "gauge"}


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return {f.name: f for f in text_string_to_metric_families(response.read().decode())}


def value(families: dict, name: str, **labels) -> float:
    (found,) = [s.value for s in families[name.removesuffix("_total")].samples
                if s.name == name and s.labels == labels]
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_metric_has_its_type_and_jobs_are_counted_by_phase():
    m = metrics.OperatorMetrics()
    m.job_seen("a", "Running")
    m.job_seen("b", None)  # a new job, no phase yet
    m.job_seen("c", "Failed")
    m.job_seen("c", None, gone=True)
    m.job_seen("d", "Suspended")  # counted as what it is, not as Pending
    m.job_seen("e", "Queued")
    m.reconciles.inc(3)
    m.reconcile_errors.inc()
    m.children_repaired.inc(2)
    port = free_port()
    server = m.serve("127.0.0.1", port)
    try:
        families = scrape(port)
    finally:
        server.shutdown()
        server.server_close()
    assert {name: f.type for name, f in families.items()} == TYPES
    assert {s.labels["phase"]: s.value for s in families["weightsync_operator_jobs"].samples} == \
        {"Pending": 1, "Queued": 1, "Running": 1, "Suspended": 1, "Succeeded": 0, "Failed": 0}
    assert value(families, "weightsync_operator_reconciles_total") == 3
    assert value(families, "weightsync_operator_reconcile_errors_total") == 1
    assert value(families, "weightsync_operator_children_repaired_total") == 2


def test_an_idle_connection_is_closed_after_the_read_timeout_and_scrapes_go_on(monkeypatch):
    monkeypatch.setattr(metrics._Handler, "timeout", 3.0)
    port = free_port()
    server = metrics.OperatorMetrics().serve("127.0.0.1", port)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(20)]  # they send nothing
    try:
        wait_for("a thread per idle connection", lambda: _handlers() >= 20, timeout=3, interval=0.05)
        for s in idle:
            assert s.recv(1) == b""  # the server closed it (within the socket's 30 s, or this raises)
        wait_for("the idle connections' threads to end", lambda: _handlers() == 0, timeout=30)
        assert "weightsync_operator_jobs" in scrape(port)
    finally:
        for s in idle:
            s.close()
        server.shutdown()
        server.server_close()


def _handlers() -> int:
    """Threads answering a connection to a metrics server (socketserver names them so)."""
    return sum(t.name.startswith("Thread-") and "process_request_thread" in t.name for t in threading.enumerate())


def test_the_phases_counted_are_the_crds():
    import yaml

    crd = yaml.safe_load((Path(weightsync.job.__file__).parent / "crd.yaml").read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert tuple(status["properties"]["phase"]["enum"]) == metrics.PHASES


def test_a_taken_port_and_a_wrong_one_are_refused_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as raised:
            metrics.OperatorMetrics().serve("127.0.0.1", port)
    assert str(raised.value) == (f"[Errno 98] the operator's metrics endpoint cannot listen on 127.0.0.1:{port}: Address "
                                 f"already in use (another process holds the port; set {metrics.METRICS_PORT_ENV} to "
                                 "another)")
    with pytest.raises(ValueError, match=f"^{metrics.METRICS_PORT_ENV} must be a port number from 1 to 65535, not 'x'$"):
        metrics.metrics_port({metrics.METRICS_PORT_ENV: "x"})
    assert metrics.metrics_port({}) == metrics.METRICS_PORT


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_running_operator_counts_reconciles_and_repairs(operator, ns):
    ns.apply_job("metered", {"trainer": {"replicas": 1}, "inference": {"replicas": 1}})
    ns.wait_children("metered")
    before = scrape(operator.metrics_port)
    ns.kubectl("delete", "configmap", "metered-spec")
    wait_for("ConfigMap put back", lambda: ns.get("configmap", "metered-spec"))
    after = wait_for("the repair counted", lambda: (f := scrape(operator.metrics_port)) and value(
        f, "weightsync_operator_children_repaired_total") > value(before, "weightsync_operator_children_repaired_total")
        and f)
    assert value(after, "weightsync_operator_reconciles_total") > value(before, "weightsync_operator_reconciles_total")
    # (read once, the phase may move on between the scrape and the read: wait for one that stays)
    ns.wait_phase("metered", "Running")
    wait_for("the running job counted by its phase",
             lambda: value(scrape(operator.metrics_port), "weightsync_operator_jobs", phase="Running") >= 1)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_an_operator_whose_metrics_port_is_taken_stops_saying_so(cluster, crd_applied, tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces",
                               "-m", "weightsync_operator"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
                                   metrics.METRICS_PORT_ENV: str(port)})
    assert done.returncode != 0
    assert f"the operator's metrics endpoint cannot listen on 0.0.0.0:{port}: Address already in use" in \
        done.stdout + done.stderr
