"""The controller's reports: JSON lines on stdout, and the job's status.transfer and
status.completion written through a real Kubernetes API server."""
import io
import json
import uuid
from pathlib import Path

import pytest

from weightsync.job import API_VERSION, KIND, load_job
from weightsync.roles.controller.records import Reporter

ROOT = Path(__file__).resolve().parents[3]


def job(name="reported", namespace="default"):
    return load_job({"apiVersion": API_VERSION, "kind": KIND,
                              "metadata": {"name": name, "namespace": namespace},
                              "spec": {"model": {"config": {"model_type": "gpt2"}}}})


def test_json_lines_on_stdout():
    out = io.StringIO()
    reporter = Reporter(job(), to_kubernetes=False, out=out)
    reporter.transfer(3, 30, 2_000_000, 0.004, "tcp", 4.25, version_bytes=1_000_000)
    reporter.transfer(0, 0, 2_000_000, 0.0, "tcp", None)
    reporter.transfer(4, 40, 2_000_000, 0.002, "tcp", 4.0, wire_bytes=60_000, delta_ranks=2, changed=0.02)
    reporter.completion("Succeeded", "4 versions delivered", 4, failed_verifications=0)
    first, second, delta, end = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["event"] == "transfer" and first["version"] == 3 and first["step"] == 30
    assert first["gbps"] == 0.5 and first["loss"] == 4.25 and first["version_bytes"] == 1_000_000
    assert first["time"].endswith("Z") and first["transport"] == "tcp"
    assert first["wireBytes"] == 2_000_000 and first["deltaRanks"] == 0  # a whole version
    assert "loss" not in second and second["gbps"] == 0.0
    assert delta["wireBytes"] == 60_000 and delta["deltaRanks"] == 2 and delta["changed"] == 0.02
    assert end == {**end, "event": "completion", "state": "Succeeded", "versions": 4, "failed_verifications": 0}


def test_reporting_to_kubernetes_needs_a_cluster(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with pytest.raises(RuntimeError, match="neither in a pod"):
        Reporter(job(), to_kubernetes=True)


@pytest.mark.cluster
def test_status_is_written_through_the_api_server(cluster, monkeypatch, capsys):
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "weightsync.io_weighttransferjobs.yaml"))
    cluster.wait_served("weighttransferjobs.weightsync.io")
    namespace = f"report-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        the_job = job("reported", namespace)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(the_job.to_object()))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        reporter = Reporter(the_job, to_kubernetes=True, out=io.StringIO())
        reporter.transfer(1, 10, 3_000_000, 0.01, "tcp", 5.5)
        reporter.transfer(2, 20, 3_000_000, 0.02, "tcp", 5.0, wire_bytes=90_000, delta_ranks=2)
        reporter.completion("Failed", "inference rank 1 failed: gone", 2)
        status = json.loads(cluster.kubectl("get", "wtj", "reported", "-n", namespace, "-o", "json").stdout)["status"]
        assert status["transfer"] == {**status["transfer"], "version": 2, "step": 20, "bytes": 3_000_000,
                                      "seconds": 0.02, "gbps": 0.15, "transport": "tcp", "loss": 5.0,
                                      "wireBytes": 90_000, "deltaRanks": 2}
        assert status["completion"] == {**status["completion"], "state": "Failed", "versions": 2,
                                        "message": "inference rank 1 failed: gone"}
        # a job that is gone: said on stderr, the controller goes on
        Reporter(job("absent", namespace), to_kubernetes=True, out=io.StringIO()).transfer(1, 1, 1, 1.0, "tcp", None)
        assert "could not write status to WeightTransferJob" in capsys.readouterr().err
    finally:
        cluster.delete_namespaces(namespace)
