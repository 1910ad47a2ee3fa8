"""Jobs that Kueue admits, with the real Kueue (built from its Go module) against the local
cluster: a job labelled with a queue runs no pod until its Workload is admitted, then every role's
pods at once on the flavor's nodes; two jobs whose GPUs exceed the quota run one after the other;
a higher-priority job preempts a running one cleanly (its pods go, then its quota); a queue that
does not exist keeps the job waiting, saying so."""

import json
import time
import uuid

import pytest
from controlplane import wait_for
from support.kueue_harness import running
from support.operator_harness import running_operator

from weightsync.job import CONTROLLER, LABEL_ROLE, PLURAL, ROLES, reasons

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

QUEUE = "kueue.x-k8s.io/queue-name"
PRIORITY = "kueue.x-k8s.io/priority-class"
# 2 trainer pods and 1 inference pod of one GPU each (the controller asks for none): 3 GPUs.
SMALL = {"trainer": {"replicas": 2}, "inference": {"replicas": 1}, "network": {"mode": "tcp", "tcp": {"socketIfname": "eth0"}}}
GPU_LABEL = "nvidia.com/gpu.present"


@pytest.fixture(scope="module")
def kueue(cluster, crd_applied, tmp_path_factory):
    with running(cluster, tmp_path_factory.mktemp("kueue")) as k:
        yield k


@pytest.fixture(scope="module")
def operator(cluster, crd_applied, kueue, tmp_path_factory):
    """Started after Kueue's CRDs are served, so that it watches the Workloads."""
    yield from running_operator(cluster, tmp_path_factory)


@pytest.fixture
def quota(cluster, ns):
    """A ResourceFlavor on the GPU nodes, a ClusterQueue with 4 GPUs (one job's 3 fit, two jobs'
    do not) that preempts lower priorities, and a LocalQueue `lq` in the test's namespace."""
    name = f"q-{uuid.uuid4().hex[:6]}"
    objects = [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name},
         "spec": {"nodeLabels": {GPU_LABEL: "true"}}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
         "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns.name}},
                  "preemption": {"withinClusterQueue": "LowerPriority"},
                  "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
                      {"name": name, "resources": [{"name": "nvidia.com/gpu", "nominalQuota": 4}]}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass", "metadata": {"name": f"{name}-high"},
         "value": 1000},
    ]
    for obj in objects:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    ns.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "lq"},
        "spec": {"clusterQueue": name}}))
    try:
        yield name
    finally:
        ns.kubectl("delete", "localqueue", "lq", "--wait=false", check=False)
        cluster.kubectl("delete", "clusterqueue", name, "--wait=false", check=False)
        cluster.kubectl("delete", "resourceflavor", name, "--wait=false", check=False)
        cluster.kubectl("delete", "workloadpriorityclass", f"{name}-high", "--wait=false", check=False)


def workload(ns, job):
    return ns.get("workloads.kueue.x-k8s.io", f"{job}-wtj")


def replicas(ns, job):
    return {r: (ns.children(job).get(f"StatefulSet/{job}-{r}") or {}).get("spec", {}).get("replicas")
            for r in ROLES}


def finish(ns, job):
    completion = {"state": "Succeeded", "message": "done", "versions": 2, "time": "2026-01-01T00:00:00Z"}
    ns.kubectl("patch", PLURAL, job, "--subresource=status", "--type=merge", "-p",
               json.dumps({"status": {"completion": completion}}))


def test_two_jobs_beyond_the_quota_run_one_after_the_other_each_whole(ns, quota):
    ns.apply_job("first", SMALL, labels={QUEUE: "lq"})
    ns.wait_phase("first", "Running", timeout=90)
    pods = ns.wait_running_pods("first", 4)
    admitted = ns.condition("first", "Admitted")
    assert admitted["status"] == "True" and admitted["reason"] == reasons.ADMITTED and quota in admitted["message"]
    # the GPU pods run on the flavor's nodes
    for pod in pods:
        if pod["metadata"]["labels"][LABEL_ROLE] != CONTROLLER:
            assert pod["spec"]["nodeSelector"][GPU_LABEL] == "true", pod["metadata"]["name"]
    wl = workload(ns, "first")
    assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("controller", 1), ("trainer", 2), ("inference", 1)]
    assert wl["metadata"]["ownerReferences"][0]["name"] == "first"

    ns.apply_job("second", SMALL, labels={QUEUE: "lq"})
    status = ns.wait_phase("second", "Queued")
    # Queued from the start; Kueue's reason once it has looked at the Workload
    waiting = wait_for("the Admitted condition naming the quota", lambda: c if "quota" in (
        c := ns.condition("second", "Admitted")).get("message", "") else None, 30)
    assert waiting["status"] == "False" and waiting["reason"] == reasons.QUEUED, waiting
    assert {r: v["summary"] for r, v in status["replicas"].items()} == {r: "0/0" for r in ROLES}
    # never half-started: nothing of the second runs while the first holds the quota
    for _ in range(5):
        assert not ns.pods("second") and set(replicas(ns, "second").values()) == {0}
        time.sleep(1)
    assert ns.wait_event("second", reasons.QUEUED)["type"] == "Normal"

    finish(ns, "first")
    ns.wait_phase("first", "Succeeded")
    wait_for("the first job's Workload finished", lambda: any(
        c["type"] == "Finished" and c["status"] == "True" for c in workload(ns, "first")["status"]["conditions"]), 30)
    ns.wait_phase("second", "Running", timeout=90)
    ns.wait_running_pods("second", 4)
    assert replicas(ns, "second") == {"controller": 1, "trainer": 2, "inference": 1}


def test_a_higher_priority_job_preempts_a_running_one_which_starts_again_when_readmitted(ns, quota):
    ns.apply_job("low", SMALL, labels={QUEUE: "lq"})
    ns.wait_phase("low", "Running", timeout=90)
    ns.wait_running_pods("low", 4)
    ns.kubectl("patch", PLURAL, "low", "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"controller": {"starts": 1, "started": "2026-01-01T00:00:00Z"}}}))

    ns.apply_job("high", SMALL, labels={QUEUE: "lq", PRIORITY: f"{quota}-high"})
    ns.wait_phase("low", "Queued", timeout=60)
    evicted = ns.condition("low", "Admitted")
    assert evicted["reason"] == reasons.EVICTED and "Preempted" in evicted["message"], evicted
    assert ns.wait_event("low", reasons.EVICTED)["type"] == "Warning"
    # its pods go first, then its quota: only then does the higher priority start
    ns.wait_phase("high", "Running", timeout=90)
    assert not ns.pods("low")
    assert "controller" not in ns.status("low"), "the controller an admission starts begins the job anew"
    assert workload(ns, "high")["spec"]["priority"] == 1000
    low = workload(ns, "low")
    assert "admission" not in low["status"]
    assert any(c["type"] == "Requeued" and c["status"] == "True" for c in low["status"]["conditions"])
    ns.wait_running_pods("high", 4)

    finish(ns, "high")
    ns.wait_phase("low", "Running", timeout=90)
    ns.wait_running_pods("low", 4)


def test_a_queue_that_does_not_exist_keeps_the_job_waiting_and_saying_so(ns, quota):
    ns.apply_job("lost", SMALL, labels={QUEUE: "nope"})
    ns.wait_phase("lost", "Queued")
    waiting = wait_for("the Admitted condition naming the queue", lambda: c if "nope" in (
        c := ns.condition("lost", "Admitted")).get("message", "") else None, 30)
    assert waiting["status"] == "False" and "doesn't exist" in waiting["message"], waiting
    assert not ns.pods("lost") and set(replicas(ns, "lost").values()) == {0}

    # suspended, the Workload is deactivated; resumed, it is active again
    ns.kubectl("patch", PLURAL, "lost", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    ns.wait_phase("lost", "Suspended")
    wait_for("the Workload deactivated", lambda: workload(ns, "lost")["spec"]["active"] is False, 30)
    ns.kubectl("patch", PLURAL, "lost", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    wait_for("the Workload active", lambda: workload(ns, "lost")["spec"]["active"] is True, 30)

    # the queue the job names appears: it is admitted
    ns.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "nope"},
        "spec": {"clusterQueue": quota}}))
    ns.wait_phase("lost", "Running", timeout=90)
    ns.wait_running_pods("lost", 4)
