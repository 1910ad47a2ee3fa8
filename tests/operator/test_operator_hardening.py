"""The operator against what users, and the pods of a job, can do to it on a real local control
plane: Pod Security `restricted` namespaces, a controller pod writing its job's status, edits of a
running job and a new default image, deleted children, and a namespace being deleted."""

import base64
import json
import logging
import types

import pytest
from controlplane import wait_for

from weightsync.job import (
    ANNOTATION_NETWORK_MODE,
    ANNOTATION_TOKEN_SHA256,
    LABEL_ROLE,
    PLURAL,
    ROLES,
    TOKEN_KEY,
    TRAINER,
)
from weightsync_operator import reconcile, tokens
from weightsync_operator.kube import ApiError, Kube
from weightsync_operator.render import DEFAULT_WORKER_IMAGE_ENV
from weightsync_operator.report import Indexes

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

TCP = {"trainer": {"replicas": 2}, "inference": {"replicas": 1}, "network": {"mode": "tcp"}}


def restricted(ns):
    ns.kubectl("label", "namespace", ns.name, "pod-security.kubernetes.io/enforce=restricted")


def pod_uids(ns, name):
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in ns.pods(name)}


def wait_pods(ns, name, count, timeout=90):
    def running():
        pods = ns.pods(name)
        return pods if len(pods) == count and all(p["status"].get("phase") == "Running" for p in pods) else None
    return wait_for(f"{count} Running pods of {name}", running, timeout)


def token_of(ns, name):
    secret = ns.get("secret", f"{name}-token")
    return base64.b64decode(secret["data"][TOKEN_KEY]) if secret else None


def template(ns, name, role):
    return ns.get("statefulset", f"{name}-{role}")["spec"]["template"]


def test_tcp_job_pods_are_admitted_in_a_restricted_namespace(ns):
    restricted(ns)
    ns.apply_job("strict", TCP)
    pods = wait_pods(ns, "strict", 4)
    for p in pods:
        (c,) = p["spec"]["containers"]
        assert p["spec"]["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    ns.wait_phase("strict", "Running")


def test_pods_that_admission_refuses_are_named_in_the_jobs_condition(ns):
    restricted(ns)
    # rdma pods run as root with IPC_LOCK: Pod Security `restricted` refuses them.
    ns.apply_job("root", {**TCP, "network": {"mode": "rdma"}})
    ready = wait_for("Ready=False FailedCreate",
                     lambda: (c := ns.condition("root", "Ready")).get("reason") == "FailedCreate" and c)
    assert ready["status"] == "False" and "violates PodSecurity" in ready["message"]
    assert ready["message"].startswith("StatefulSet root-")
    assert ns.wait_event("root", "FailedCreate")["type"] == "Warning"
    assert ns.status("root")["phase"] == "Pending"


def test_the_controller_pod_cannot_change_what_the_operator_renders(ns):
    ns.apply_job("mine", TCP)
    ns.wait_children("mine")
    ns.wait_phase("mine", "Running")
    before = {r: ns.get("statefulset", f"mine-{r}") for r in ROLES}
    # The controller pod's identity may patch its job's status, network included...
    token = ns.kubectl("create", "token", "mine-controller").stdout.strip()
    ns.kubectl("--token", token, "patch", PLURAL, "mine", "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": {"network": {"mode": "rdma", "reason": "the controller said so"}}}))
    # ...but not the job's annotations, where the operator keeps what it decided.
    denied = ns.kubectl("--token", token, "annotate", PLURAL, "mine", f"{ANNOTATION_NETWORK_MODE}=rdma",
                        "--overwrite", check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr
    wait_for("status.network put back", lambda: ns.status("mine").get("network", {}).get("mode") == "tcp")
    assert ns.status("mine")["network"] == {"mode": "tcp", "reason": "spec.network.mode is tcp"}
    for r in ROLES:
        after = ns.get("statefulset", f"mine-{r}")
        assert after["spec"]["template"] == before[r]["spec"]["template"]
        (c,) = after["spec"]["template"]["spec"]["containers"]
        assert "add" not in c["securityContext"]["capabilities"]
        assert "rdma/rdma_shared_device_a" not in c.get("resources", {}).get("limits", {})


def test_a_running_job_is_never_rolled(operator, ns):
    ns.apply_job("steady", TCP)
    ns.wait_children("steady")
    wait_pods(ns, "steady", 4)
    ns.wait_phase("steady", "Running")
    uids = pod_uids(ns, "steady")
    image = template(ns, "steady", TRAINER)["spec"]["containers"][0]["image"]
    # A spec edit is refused while the job runs...
    proc = ns.kubectl("patch", PLURAL, "steady", "--type=merge", "-p", '{"spec":{"training":{"steps":7}}}',
                      check=False)
    assert proc.returncode != 0 and "the job is Running and its spec cannot change" in proc.stderr, proc.stderr
    # ...and a new default worker image (a chart upgrade) reaches new jobs only.
    operator.stop()
    operator.env[DEFAULT_WORKER_IMAGE_ENV] = "registry.local/worker:next"
    try:
        operator.start()
        wait_for("resume", lambda: f"[{ns.name}/steady] Resuming is processed" in operator.log_since_start())
        ns.apply_job("later", TCP)
        ns.wait_children("later")
        assert template(ns, "later", TRAINER)["spec"]["containers"][0]["image"] == "registry.local/worker:next"
    finally:
        operator.stop()
        del operator.env[DEFAULT_WORKER_IMAGE_ENV]
        operator.start()
    assert template(ns, "steady", TRAINER)["spec"]["containers"][0]["image"] == image
    for r in ROLES:
        assert ns.get("statefulset", f"steady-{r}")["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert pod_uids(ns, "steady") == uids


def test_a_job_that_is_not_running_yet_takes_edits(ns):
    # 16 GPUs per pod; the largest node has 8: Pending for good, and fixable.
    ns.apply_job("fixme", {**TCP, "trainer": {"replicas": 2, "procsPerPod": 2, "gpusPerProc": 8}})
    ns.wait_children("fixme")
    wait_for("Unschedulable", lambda: ns.condition("fixme", "Ready").get("reason") == "Unschedulable")
    ns.kubectl("patch", PLURAL, "fixme", "--type=merge", "-p", '{"spec":{"trainer":{"gpusPerProc":1}}}')
    ns.wait_phase("fixme", "Running", timeout=90)


def test_fixing_a_pending_jobs_trainer_resources_leaves_its_other_pods_alone(ns):
    """The trainers ask for more CPU than any node has; once they ask for less, they start, and
    the controller (whose rendezvous the other ranks joined) and the inference pods are the same
    pods as before."""
    ns.apply_job("roomy", {**TCP, "trainer": {"replicas": 2, "resources": {"requests": {"cpu": "100000"}}}})
    ns.wait_children("roomy")
    wait_for("Unschedulable", lambda: ns.condition("roomy", "Ready").get("reason") == "Unschedulable")

    def others_running():
        running = {p["metadata"]["name"]: p["metadata"]["uid"] for p in ns.pods("roomy")
                   if p["metadata"]["labels"].get(LABEL_ROLE) != TRAINER
                   and p["status"].get("phase") == "Running"}
        return running if len(running) == 2 else None
    others = wait_for("the controller and inference pods Running", others_running)
    ns.kubectl("patch", PLURAL, "roomy", "--type=merge", "-p",
               '{"spec":{"trainer":{"resources":{"requests":{"cpu":"100m"}}}}}')
    ns.wait_phase("roomy", "Running", timeout=90)
    assert {n: u for n, u in pod_uids(ns, "roomy").items() if n in others} == others


def test_deleted_children_come_back_with_the_same_token(operator, ns):
    ns.apply_job("keep", TCP)
    ns.wait_children("keep")
    ns.wait_phase("keep", "Running")
    token = token_of(ns, "keep")
    job = ns.job("keep")
    assert job["metadata"]["annotations"][ANNOTATION_TOKEN_SHA256] == tokens.fingerprint(token.decode())

    ns.kubectl("delete", "secret", "keep-token")
    ns.kubectl("delete", "statefulset", "keep-trainer", "--cascade=orphan")
    wait_for("Secret and StatefulSet back", lambda: token_of(ns, "keep") and ns.get("statefulset", "keep-trainer"))
    assert token_of(ns, "keep") == token
    repaired = wait_for("Repaired", lambda: (c := ns.condition("keep", "ChildrenCreated")).get("reason") == "Repaired" and c)
    assert "it had been deleted" in repaired["message"]
    assert ns.wait_event("keep", "Repaired")["type"] == "Warning"

    # Deleted while no operator runs: the next one restores the same token too.
    operator.stop()
    try:
        ns.kubectl("delete", "secret", "keep-token")
    finally:
        operator.start()
    wait_for("Secret back after a restart", lambda: token_of(ns, "keep"))
    assert token_of(ns, "keep") == token
    assert ns.status("keep")["phase"] == "Running"


def test_a_secret_that_cannot_hold_the_same_token_fails_the_job(cluster, operator, ns):
    ns.apply_job("lost", TCP)
    ns.wait_children("lost")
    # The operator's token key is replaced and the job's Secret deleted while no operator runs (done
    # while one runs, a reconcile under way with the old key would rightly put the Secret back): a
    # new token would lock out every running rank.
    operator.stop()
    try:
        operator.env[tokens.KEY_SECRET_ENV] = f"another-key-{ns.name}"
        ns.kubectl("delete", "secret", "lost-token")
        operator.start()
        failed = ns.wait_phase("lost", "Failed")
        cond = {c["type"]: c for c in failed["conditions"]}["ChildrenCreated"]
        assert cond["reason"] == "TokenLost" and "Secret lost-token" in cond["message"]
        assert ns.get("secret", "lost-token") is None
    finally:
        operator.stop()
        del operator.env[tokens.KEY_SECRET_ENV]
        cluster.kubectl("delete", "secret", f"another-key-{ns.name}", "-n", tokens.key_location()[0],
                        "--ignore-not-found")
        operator.start()


def test_a_namespace_being_deleted_is_not_reported_as_missing_rights(cluster, operator, ns, monkeypatch):
    """A job's pass while its namespace is being deleted: the API server's 403 is told apart
    from a missing permission, and nothing is written, posted or retried."""
    ns.apply_job("late", TCP)
    ns.wait_children("late")
    obj = ns.job("late")
    kube = Kube(cluster.api())
    # A finalizer holds the namespace in Terminating while the test looks.
    ns.kubectl("create", "configmap", "hold")
    ns.kubectl("patch", "configmap", "hold", "--type=merge", "-p", '{"metadata":{"finalizers":["weightsync.io/test-hold"]}}')
    try:
        cluster.kubectl("delete", "namespace", ns.name, "--wait=false")
        wait_for("namespace Terminating", lambda: cluster.kubectl(
            "get", "namespace", ns.name, "-o", "jsonpath={.status.phase}").stdout == "Terminating")
        with pytest.raises(ApiError) as refused:
            kube.request("POST", f"/api/v1/namespaces/{ns.name}/configmaps",
                         {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "probe"}})
        assert refused.value.status == 403 and refused.value.namespace_terminating

        # The children go with the namespace; the operator sees them deleted and tries to put
        # them back, as does this pass over the job (as it was before): both are refused.
        wait_for("children gone", lambda: not ns.children("late"))
        writes = []
        monkeypatch.setattr(reconcile, "report", lambda *args, **kwargs: writes.append(kwargs))
        memo = types.SimpleNamespace(kube=kube, token_key=tokens.load_key(kube))
        reconcile.reconcile_read(memo, obj, logging.getLogger(__name__), Indexes({}, {}, {}, {}))  # returns: no retry
        assert writes == []  # no condition, no Event
        log = [line for line in operator.log_since_start().splitlines() if f"[{ns.name}/" in line]
        assert not [line for line in log if "ERROR" in line or "may not write" in line], log
    finally:
        ns.kubectl("patch", "configmap", "hold", "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)
