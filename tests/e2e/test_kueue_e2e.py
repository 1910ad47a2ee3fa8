"""Kueue in real pods: the chart's operator (in its pod, with the chart's RBAC) and the real Kueue
controller admit two tcp jobs (the tcp example with one pod of each role and a small model) whose
CPU exceeds the ClusterQueue's quota one after the other, each whole and never half-started, and
both train, transfer and end Succeeded on the real node."""

from __future__ import annotations

import json
import uuid

import pytest
from controlplane import wait_for
from e2e_harness import (
    LogFollower,
    apply,
    assert_succeeded,
    example,
    finished,
    following,
    get_job,
    job_pods,
    show_logs,
    small,
)
from support.kueue_harness import running

from weightsync.job import load_job

pytestmark = pytest.mark.cluster

QUEUE = "kueue.x-k8s.io/queue-name"


@pytest.fixture(scope="module")
def kueue(cluster, tmp_path_factory):
    """Started before the chart's operator, so that it watches Kueue's Workloads from its start."""
    with running(cluster, tmp_path_factory.mktemp("kueue")) as k:
        yield k


def quota_for_one_job(cluster, namespace: str) -> str:
    """A ClusterQueue whose CPU holds one queued job (a 300m trainer and a 300m inference rank) but
    not two, and the LocalQueue `lq` in the job's namespace."""
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    for obj in (
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name}, "spec": {}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
         "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                  "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
                      {"name": name, "resources": [{"name": "cpu", "nominalQuota": "1"},
                                                   {"name": "memory", "nominalQuota": "16Gi"}]}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "lq", "namespace": namespace},
         "spec": {"clusterQueue": name}},
    ):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    return name


def test_two_jobs_beyond_the_quota_run_one_after_the_other_in_real_pods(cluster, real_node, kueue, helm, namespace,
                                                                      chart, operator_from_chart, tmp_path):
    queue = quota_for_one_job(cluster, namespace)
    jobs = []
    for name in ("first", "second"):
        # What is queued is what counts, not the model, the steps nor how many pods: one of each role.
        job = small(example("tcp-job.yaml"))
        for role in ("trainer", "inference"):
            job["spec"][role]["replicas"] = 1
            job["spec"][role]["resources"]["requests"]["cpu"] = "300m"
        job["metadata"]["name"] = name
        job["metadata"]["labels"] = {QUEUE: "lq"}
        jobs.append(job)
    logs = LogFollower(cluster, namespace, tmp_path / "logs")
    try:
        with operator_from_chart(chart[1], chart[0]) as operator:
            progress = following(cluster, namespace, "first", operator, logs)
            apply(cluster, namespace, jobs[0])
            pods = load_job(jobs[0], namespace).layout.pods
            wait_for("the first job's pods", lambda: len(job_pods(cluster, namespace, "first")) == pods, 120,
                     failed=progress)
            apply(cluster, namespace, jobs[1])

            held = []  # the second job's Admitted conditions while it waited

            def first_ended_with_the_second_held():
                """While the first runs, the second has no pod; once it ended, its Workload's quota is free.
                (The second's pods are read before the first's phase: pods seen while the first still
                ran, read after them, ran beside it; pods made once the first ended are its turn.)"""
                second_pods = job_pods(cluster, namespace, "second")
                progress()
                second = get_job(cluster, namespace, "second").get("status", {})
                if second.get("phase") == "Queued":
                    held.extend(c for c in second.get("conditions", []) if c["type"] == "Admitted")
                if get_job(cluster, namespace, "first").get("status", {}).get("phase") in ("Succeeded", "Failed"):
                    return True
                assert not second_pods, "the second job started beside the first"
                return False

            wait_for("the first job ended, the second held", first_ended_with_the_second_held, 600, interval=1)
            assert held and held[-1]["reason"] == "Queued" and "quota" in held[-1]["message"], held[-1:]
            done = finished(cluster, namespace, "second", following(cluster, namespace, "second", operator, logs))
            first = get_job(cluster, namespace, "first")
    finally:
        show_logs(logs)
        cluster.kubectl("delete", "wtj", "first", "second", "-n", namespace, "--ignore-not-found", "--wait=true",
                        "--timeout=60s", check=False)
        cluster.kubectl("delete", "clusterqueue,resourceflavor", queue, "--ignore-not-found", "--wait=false", check=False)
    assert_succeeded(cluster, namespace, first, logs)
    assert_succeeded(cluster, namespace, done, logs)
    # Admitted once, each job kept its pods from start to end: none was deleted and made again.
    replaced = {pod: uids for pod, uids in logs.lives.items() if len(uids) > 1}
    assert not replaced, f"pods deleted and made again while their job ran (their uids): {replaced}"
    for status in (first["status"], done["status"]):
        admitted = {c["type"]: c for c in status["conditions"]}
        assert "Admitted" not in admitted or admitted["Admitted"]["status"] == "True", status["conditions"]
