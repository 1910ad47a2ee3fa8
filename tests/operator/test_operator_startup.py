"""An operator started before its CRD exists: it serves once the CRD is applied, and its liveness
probe fails while it cannot serve. Runs its own operator, and leaves the CRD applied."""

import uuid
from pathlib import Path

import pytest
from controlplane import probe, wait_for
from support.operator_harness import CRD, Namespace, Operator

from weightsync.job import GROUP, PLURAL

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CRD_NAME = f"{PLURAL}.{GROUP}"


def apply_crd(cluster):
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.wait_served(CRD_NAME)


def delete_crd(cluster):
    cluster.kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=true", "--timeout=120s")


def test_an_operator_started_before_its_crd_serves_once_it_is_applied(cluster, crd_applied, tmp_path):
    delete_crd(cluster)
    op = Operator(cluster.kubeconfig, tmp_path / "operator.log")
    name = f"t-{uuid.uuid4().hex[:8]}"
    try:
        op.start(wait=False)
        wait_for("the operator waiting for its CRD", lambda: "waiting for the CustomResourceDefinition" in op.log(), 60)
        assert op.proc.poll() is None
        assert not probe(f"http://127.0.0.1:{op.port}/healthz")  # not alive: a kubelet would restart it

        apply_crd(cluster)
        wait_for("liveness once the CRD is served", op.healthy, 60)
        cluster.kubectl("create", "namespace", name)
        ns = Namespace(cluster, name)
        ns.apply_job("first", {"network": {"mode": "tcp"}})
        ns.wait_children("first")

        # The CRD gone: the probe fails, so that a restart waits for it again.
        delete_crd(cluster)
        wait_for("liveness failing without the CRD", lambda: not probe(f"http://127.0.0.1:{op.port}/healthz"), 60)
        assert op.proc.poll() is None
    finally:
        op.stop()
        apply_crd(cluster)
        cluster.delete_namespaces(name)


def test_an_operator_started_before_kueue_asks_to_be_restarted_once_kueue_is_served(cluster, crd_applied, tmp_path):
    """kopf resolves what it watches when it starts: an operator started before Kueue's CRDs would
    never see the Workloads of queued jobs, so its liveness probe fails once they are served (a
    kubelet restarts it, and the new one watches them). Leaves Kueue's Workload CRD applied."""
    workloads = Path(cluster.binaries, "kueue").resolve().parent / "kueue-crds" / "kueue.x-k8s.io_workloads.yaml"
    cluster.kubectl("delete", "crd", "workloads.kueue.x-k8s.io", "--ignore-not-found", "--wait=true", "--timeout=120s")
    op = Operator(cluster.kubeconfig, tmp_path / "operator.log")
    try:
        op.start()  # alive as soon as it serves the CRD: kopf says what it cannot watch just after
        wait_for("the operator to say it cannot watch Kueue's Workloads",
                 lambda: "Unresolved resources cannot be served" in op.log(), 30)
        assert "workloads" in op.log()
        cluster.kubectl("apply", "--server-side", "-f", str(workloads))
        cluster.wait_served("workloads.kueue.x-k8s.io")
        wait_for("liveness failing once Kueue is served", lambda: not probe(f"http://127.0.0.1:{op.port}/healthz"), 60)
        assert op.proc.poll() is None
        op.restart()  # as a kubelet would: the new operator watches the Workloads, and is alive
        assert op.healthy()
        assert "Unresolved resources" not in op.log_since_start()
    finally:
        op.stop()
        cluster.kubectl("apply", "--server-side", "-f", str(workloads))
