"""The operator's ServiceAccount as the chart installs it, against the real API server: what RBAC
allows it (kubectl auth can-i --as), what it cannot do when it tries with its own token (read
another namespace's Secrets, grant rights, run a pod as another account or of another shape,
write what no job owns), that it still runs a job with nothing more, and that helm uninstall
leaves nothing behind."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import kubernetes
import pytest
import yaml
from controlplane import wait_for
from e2e_harness import install, leftovers, new_namespace
from support.kueue_harness import Kueue
from support.operator_harness import Namespace, Operator  # noqa: E402

from weightsync.job import API_VERSION, CONTROLLER, GROUP, KIND, LABEL_JOB, PLURAL, TRAINER  # noqa: E402
from weightsync_operator import queueing, render, tokens  # noqa: E402
from weightsync_operator.kube import ApiError, Kube  # noqa: E402
from weightsync_operator.reconcile import load  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

JOBS = "weighttransferjobs.weightsync.io"


def can(cluster, who: str, *request: str) -> bool:
    proc = cluster.kubectl("auth", "can-i", f"--as={who}", *request, check=False)
    assert proc.stdout.strip() in ("yes", "no"), proc.stdout + proc.stderr
    return proc.stdout.strip() == "yes"


def refused(proc, *words: str) -> bool:
    return proc.returncode != 0 and all(w in proc.stderr for w in words)


def statefulset(name: str, namespace: str, account: str | None, job: str = "x") -> str:
    pod = {"containers": [{"name": "c", "image": "busybox"}]}
    if account:
        pod["serviceAccountName"] = account
    return json.dumps({"apiVersion": "apps/v1", "kind": "StatefulSet",
                       "metadata": {"name": name, "namespace": namespace, "labels": {LABEL_JOB: job}},
                       "spec": {"serviceName": name, "selector": {"matchLabels": {"a": "b"}},
                                "template": {"metadata": {"labels": {"a": "b"}}, "spec": pod}}})


def test_the_operator_account_runs_jobs_and_can_do_nothing_else(helm, cluster, tmp_path):
    release = f"ws-{uuid.uuid4().hex[:6]}"
    release_ns, watched, other = new_namespace(cluster, "ops"), new_namespace(cluster, "jobs"), new_namespace(cluster, "other")
    fullname = f"{release}-weightsync"
    try:
        install(helm, release, release_ns, f"watchNamespaces={{{watched}}}")
        sa = f"system:serviceaccount:{release_ns}:{fullname}"

        # RBAC: what it does, in the watched namespace only...
        for ns in (watched, other, "kube-system"):
            for request in (("watch", JOBS), ("patch", JOBS), ("patch", JOBS, "--subresource=status"),
                            ("create", "statefulsets.apps"), ("patch", "statefulsets.apps"), ("list", "pods"),
                            ("create", "secrets"), ("get", "secrets"), ("watch", "secrets"),
                            ("create", "roles.rbac.authorization.k8s.io"),
                            ("create", "rolebindings.rbac.authorization.k8s.io"), ("create", "events")):
                assert can(cluster, sa, *request, "-n", ns) == (ns == watched), (request, ns)
            # ...and what it never does, anywhere.
            for request in (("delete", "secrets"), ("delete", JOBS), ("create", JOBS), ("create", "pods"),
                            ("delete", "statefulsets.apps"), ("create", "deployments.apps"),
                            ("create", "serviceaccounts", "--subresource=token"),
                            ("escalate", "roles.rbac.authorization.k8s.io"), ("bind", "roles.rbac.authorization.k8s.io"),
                            ("bind", "clusterroles.rbac.authorization.k8s.io"), ("impersonate", "serviceaccounts"), ("*", "*")):
                assert not can(cluster, sa, *request, "-n", ns), (request, ns)
        # Cluster-wide it only reads nodes, CRDs and namespaces; it reads no Secret anywhere but its key.
        assert can(cluster, sa, "list", "nodes") and can(cluster, sa, "watch", "customresourcedefinitions.apiextensions.k8s.io")
        for request in (("list", "secrets", "-A"), ("list", JOBS, "-A"), ("list", "pods", "-A"), ("patch", "nodes"),
                        ("create", "customresourcedefinitions.apiextensions.k8s.io"),
                        ("create", "clusterroles.rbac.authorization.k8s.io"),
                        ("create", "clusterrolebindings.rbac.authorization.k8s.io")):
            assert not can(cluster, sa, *request), request
        assert can(cluster, sa, "get", f"secret/{fullname}-token-key", "-n", release_ns)
        assert not can(cluster, sa, "get", "secrets", "-n", release_ns)

        # Real attempts with its own token.
        token = cluster.kubectl("create", "token", fullname, "-n", release_ns).stdout.strip()

        def as_operator(*args, input=None):  # noqa: A002 - as kubectl's
            return cluster.kubectl("--token", token, *args, input=input, check=False)

        assert refused(as_operator("get", "secrets", "-n", "kube-system"), "forbidden")
        assert refused(as_operator("get", "secrets", "-A"), "forbidden")
        assert refused(as_operator("create", "-f", "-", input=statefulset("gc", "kube-system", "generic-garbage-collector")),
                       "forbidden")
        assert refused(as_operator("create", "rolebinding", "grab", "-n", "kube-system", "--clusterrole=admin",
                                   f"--serviceaccount={release_ns}:{fullname}"), "forbidden")
        # In the watched namespace RBAC lets it create Roles, RoleBindings, Secrets and StatefulSets;
        # it may grant only what it holds, and the admission policy only what a job needs.
        assert refused(as_operator("create", "rolebinding", "x-controller", "-n", watched, "--clusterrole=admin",
                                   "--serviceaccount=kube-system:default"), "forbidden")
        role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": "x-controller", "namespace": watched, "labels": {LABEL_JOB: "x"}},
                "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]}
        assert refused(as_operator("create", "-f", "-", input=json.dumps(role)), "ValidatingAdmissionPolicy",
                       "creates only a job's own Role")
        # A job's Role, as the operator makes it, bound to anyone but the job's own account.
        role["rules"] = [{"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": ["x"],
                          "verbs": ["get"]}]
        cluster.kubectl("create", "-f", "-", input=json.dumps(role))
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "x-controller", "namespace": watched, "labels": {LABEL_JOB: "x"}},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "x-controller"},
                   "subjects": [{"kind": "ServiceAccount", "name": "builder", "namespace": other}]}
        assert refused(as_operator("create", "-f", "-", input=json.dumps(binding)), "ValidatingAdmissionPolicy",
                       "binds only a job's own Role")
        assert refused(as_operator("create", "-f", "-", input=statefulset("x-trainer", watched, "builder")),
                       "ValidatingAdmissionPolicy", "run as the job's own ServiceAccount")
        minted = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
                  "metadata": {"name": "x-token", "namespace": watched, "labels": {LABEL_JOB: "x"},
                               "annotations": {"kubernetes.io/service-account.name": "default"}}}
        for secret_name in ("x-token", "x-join"):
            minted["metadata"]["name"] = secret_name
            assert refused(as_operator("create", "-f", "-", input=json.dumps(minted)), "ValidatingAdmissionPolicy",
                           "only a job's own token and join Secrets")

        # Pods of another shape than the operator renders, and anything not owned by the job its
        # label names, are refused too.
        privileged = json.loads(statefulset("x-trainer", watched, None))
        privileged["spec"]["template"]["spec"]["containers"][0]["securityContext"] = {"privileged": True}
        host = json.loads(statefulset("x-trainer", watched, None))
        host["spec"]["template"]["spec"].update(hostPID=True)
        mounted = json.loads(statefulset("x-trainer", watched, None))
        mounted["spec"]["template"]["spec"]["volumes"] = [{"name": "root", "hostPath": {"path": "/"}}]
        for shape in (privileged, host, mounted):
            assert refused(as_operator("create", "-f", "-", input=json.dumps(shape)), "ValidatingAdmissionPolicy",
                           "are not privileged"), shape
        orphan = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": "x-spec", "namespace": watched, "labels": {LABEL_JOB: "x"}}}
        assert refused(as_operator("create", "-f", "-", input=json.dumps(orphan)), "ValidatingAdmissionPolicy",
                       "owned by the WeightTransferJob its weightsync.io/job label names")
        # An object of no job cannot be taken over by labelling it as one's child.
        cluster.kubectl("create", "configmap", "unrelated", "-n", watched, "--from-literal=a=b")
        takeover = as_operator("label", "configmap", "unrelated", "-n", watched, f"{LABEL_JOB}=x")
        assert refused(takeover, "ValidatingAdmissionPolicy", "changes only objects it created for that same job")
        assert refused(as_operator("patch", "configmap", "unrelated", "-n", watched, "--type=merge", "-p",
                                   '{"data":{"a":"c"}}'), "ValidatingAdmissionPolicy", "children of a WeightTransferJob")

        the_policy_follows_each_jobs_spec(cluster, as_operator, token, watched, tmp_path)

        # With exactly these rights, as the chart's pod runs it, the operator runs a job and puts
        # back a deleted Secret with the job's token; a job outside its namespaces is not its business.
        config = yaml.safe_load(Path(cluster.kubeconfig).read_text())
        config["users"][0]["user"] = {"token": token}
        kubeconfig = tmp_path / "operator.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))
        op = Operator(kubeconfig, tmp_path / "operator.log", args=(f"--namespace={watched}",),
                      env={tokens.NAMESPACE_ENV: release_ns, tokens.KEY_SECRET_ENV: f"{fullname}-token-key"})
        try:
            op.start()
            jobs, elsewhere = Namespace(cluster, watched), Namespace(cluster, other)
            spec = {"trainer": {"replicas": 2}, "network": {"mode": "tcp"}}
            jobs.apply_job("ok", spec)
            elsewhere.apply_job("ok", spec)
            jobs.wait_children("ok")
            wait_for("ChildrenCreated", lambda: jobs.condition("ok", "ChildrenCreated").get("status") == "True")
            secret = jobs.get("secret", "ok-token")
            jobs.kubectl("delete", "secret", "ok-token")
            wait_for("Secret put back", lambda: (s := jobs.get("secret", "ok-token")) and s["data"] == secret["data"])
            assert "status" not in elsewhere.job("ok") and not elsewhere.children("ok")
            # The job's controller pod reports its transfers; the rest of the status is the operator's.
            controller = jobs.kubectl("create", "token", "ok-controller").stdout.strip()

            def as_controller(status):
                return jobs.kubectl("--token", controller, "patch", PLURAL, "ok", "--subresource=status",
                                    "--type=merge", "-p", json.dumps({"status": status}), check=False)

            reported = as_controller({"transfer": {"version": 1, "bytes": 10, "gbps": 0.5}})
            assert reported.returncode == 0, reported.stderr
            receivers = {"total": 1, "ready": "1/1", "version": 1, "current": 1, "behind": 0, "away": 0, "rejoining": 0,
                         "ranks": [{"rank": 0, "pod": "ok-inference-0", "version": 1, "state": "current",
                                    "since": "2026-11-26T15:04:05Z"}]}
            reported = as_controller({"receivers": receivers})
            assert reported.returncode == 0, reported.stderr
            assert jobs.job("ok")["status"]["receivers"] == receivers  # the CRD's schema keeps every field
            for status in ({"network": {"mode": "rdma", "reason": "x"}}, {"phase": "Succeeded"},
                           {"conditions": [{"type": "Ready", "status": "True"}]}):
                assert refused(as_controller(status), "ValidatingAdmissionPolicy", "writes only status.transfer"), status
            assert "Forbidden" not in op.log() and "ValidatingAdmissionPolicy" not in op.log()
        finally:
            op.stop()

        helm("uninstall", release, "--namespace", release_ns, "--wait")
        assert leftovers(cluster, release, [release_ns, watched, other]) == []
        # helm keeps a chart's CRDs (removing one would delete every job): that is the one thing left.
        cluster.kubectl("get", "crd", f"{PLURAL}.{GROUP}")
    finally:
        helm("uninstall", release, "--namespace", release_ns, "--ignore-not-found", check=False)
        cluster.delete_namespaces(release_ns, watched, other)


def the_policy_follows_each_jobs_spec(cluster, as_operator, token: str, namespace: str, tmp_path: Path) -> None:
    """What the operator may write for a job depends on that job's spec, which it cannot change:
    the host network only for a job that asks, root and IPC_LOCK only for RDMA, no capability
    beyond, Services on no node's or outside address, the Workload in the job's own queue. Each
    write is a server-side dry run as the operator, of the objects the operator itself renders."""
    Kueue(cluster, tmp_path / "kueue").install_crds()  # the Workload's kind, served (Kueue itself need not run)
    jobs = Namespace(cluster, namespace)
    rdma = {"trainer": {"replicas": 1}, "network": {"mode": "rdma"}}
    jobs.apply_job("plain", rdma, labels={queueing.QUEUE_LABEL: "lq"})
    jobs.apply_job("hostnet", {**rdma, "network": {"mode": "rdma", "rdma": {"hostNetwork": True}}})
    jobs.apply_job("sockets", {"trainer": {"replicas": 1}, "network": {"mode": "tcp"}})
    owned = {}
    for name in ("plain", "hostnet", "sockets"):
        stored = jobs.job(name)
        job = load(stored)
        owner = {"apiVersion": API_VERSION, "kind": KIND, "name": name,
                 "uid": stored["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
        owned[name] = job, owner

    def rendered(name: str, mode: str, kind: str = "StatefulSet") -> dict:
        job, owner = owned[name]
        (obj,) = [o for o in render.children(job, mode, "t" * 32) if o["kind"] == kind
                  and o["metadata"]["name"] in (job.child_name(TRAINER), job.service_name)]
        obj["metadata"]["ownerReferences"] = [owner]
        return obj

    def write(obj: dict):
        return as_operator("create", "--dry-run=server", "-f", "-", input=json.dumps(obj))

    def pod(obj: dict) -> dict:
        return obj["spec"]["template"]["spec"]

    # The job that asked: its trainers on the host network, root with IPC_LOCK and nothing more.
    asked = rendered("hostnet", "rdma")
    assert pod(asked)["hostNetwork"] is True
    assert pod(asked)["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    accepted = write(asked)
    assert accepted.returncode == 0, accepted.stderr
    raw = json.loads(json.dumps(asked))
    pod(raw)["containers"][0]["securityContext"]["capabilities"]["add"].append("NET_RAW")
    assert refused(write(raw), "ValidatingAdmissionPolicy", "drop ALL capabilities and add none but IPC_LOCK")
    # The runtime's default capabilities (NET_RAW among them), root, on the host network: refused
    # even for the job that asked.
    default_caps = json.loads(json.dumps(asked))
    del pod(default_caps)["containers"][0]["securityContext"]["capabilities"]
    assert refused(write(default_caps), "ValidatingAdmissionPolicy", "drop ALL capabilities")
    # A job that did not ask gets no host network, and no host port off it.
    sneaked = rendered("plain", "rdma")
    assert write(sneaked).returncode == 0
    pod(sneaked).update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    assert refused(write(sneaked), "ValidatingAdmissionPolicy", "use the host network only for a job whose spec asks")
    ported = rendered("plain", "rdma")
    pod(ported)["containers"][0]["ports"][0]["hostPort"] = 2222
    assert refused(write(ported), "ValidatingAdmissionPolicy", "open a host port only on the host network")
    # Nor does a tcp job's pod run as root or add a capability.
    tcp = rendered("sockets", "tcp")
    assert write(tcp).returncode == 0
    root = rendered("sockets", "rdma")  # what an rdma render gives: root with IPC_LOCK
    assert refused(write(root), "ValidatingAdmissionPolicy", "of a tcp job run as non-root")
    # The owner is the job its label names, by uid.
    stolen = rendered("hostnet", "rdma")
    stolen["metadata"]["ownerReferences"][0]["uid"] = owned["plain"][1]["uid"]
    assert refused(write(stolen), "ValidatingAdmissionPolicy", "owned by that very job")

    # Services: ClusterIP only, on no outside address or node port.
    service = rendered("plain", "rdma", kind="Service")
    assert write(service).returncode == 0
    for change in ({"externalIPs": ["203.0.113.7"]}, {"type": "NodePort", "clusterIP": None},
                   {"type": "LoadBalancer", "clusterIP": None}):
        exposed = json.loads(json.dumps(service))
        exposed["spec"].update({k: v for k, v in change.items() if v is not None})
        if "clusterIP" in change:
            del exposed["spec"]["clusterIP"]
        assert refused(write(exposed), "ValidatingAdmissionPolicy", "of type ClusterIP, with no externalIPs"), change

    # The Workload: the job's own name, queue and pod sets, of the shape the job's pods take.
    job, owner = owned["plain"]
    templates = {r: render.pod_template(job, r, "rdma") for r in (CONTROLLER, TRAINER)}
    workload = queueing.workload(job, "lq", templates)
    workload["metadata"]["ownerReferences"] = [owner]
    accepted = write(workload)
    assert accepted.returncode == 0, accepted.stderr
    elsewhere = json.loads(json.dumps(workload))
    elsewhere["spec"]["queueName"] = "the-fast-lane"
    assert refused(write(elsewhere), "ValidatingAdmissionPolicy", "in the LocalQueue and of the priority class")
    host = json.loads(json.dumps(workload))
    host["spec"]["podSets"][1]["template"]["spec"]["hostNetwork"] = True
    assert refused(write(host), "ValidatingAdmissionPolicy", "use the host network only for a job whose spec asks")
    renamed = json.loads(json.dumps(workload))
    renamed["metadata"]["name"] = "plain-other"
    assert refused(write(renamed), "ValidatingAdmissionPolicy", "Workload <job>-wtj")
    # Its status: the operator finishes it or gives its quota back, and never admits it; it
    # deletes it only while it holds no quota.
    made = as_operator("create", "-f", "-", input=json.dumps(workload))
    assert made.returncode == 0, made.stderr
    name = workload["metadata"]["name"]

    # The operator's own calls, with its token.
    config = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    config["users"][0]["user"] = {"token": token}
    (tmp_path / "workloads.kubeconfig").write_text(yaml.safe_dump(config))
    kube = Kube(kubernetes.config.new_client_from_config(config_file=str(tmp_path / "workloads.kubeconfig")))

    def stored() -> dict:
        return json.loads(cluster.kubectl("get", "workloads.kueue.x-k8s.io", name, "-n", namespace, "-o", "json").stdout)

    admitted = {"clusterQueue": "cq", "podSetAssignments": [
        {"name": role, "count": 1, "flavors": {}, "resourceUsage": {}} for role in (CONTROLLER, TRAINER)]}
    reserved = {"type": queueing.QUOTA_RESERVED, "status": "True", "reason": "QuotaReserved", "message": "m",
                "lastTransitionTime": "2026-11-28T00:00:00Z"}
    with pytest.raises(ApiError, match="admits none and reserves no quota"):
        kube.patch_status(stored(), {"admission": admitted, "conditions": [reserved]})
    reserve = cluster.kubectl("patch", "workloads.kueue.x-k8s.io", name, "-n", namespace, "--subresource=status",
                                    "--type=merge", "-p", json.dumps({"status": {"admission": admitted,
                                                                                 "conditions": [reserved]}}))
    assert reserve.returncode == 0  # as Kueue reserves quota
    with pytest.raises(ApiError, match="only while they hold no quota"):
        kube.delete(queueing.API_VERSION, queueing.WORKLOAD, namespace, name)
    kube.patch_status(stored(), queueing.quota_returned(stored(), "2026-11-28T00:01:00Z"))  # the quota given back
    kube.delete(queueing.API_VERSION, queueing.WORKLOAD, namespace, name)

    # Events: about jobs only.
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e.1", "namespace": namespace},
             "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": "someone", "namespace": namespace},
             "reason": "Hello", "message": "m", "type": "Normal"}
    assert refused(write(event), "ValidatingAdmissionPolicy", "Events about WeightTransferJobs only")
    event["involvedObject"] = {"apiVersion": API_VERSION, "kind": KIND, "name": "plain", "namespace": namespace}
    assert write(event).returncode == 0

    # The job itself: annotations yes (kopf's state, the operator's decisions), spec and labels no.
    def patch(body: dict):
        return as_operator("patch", PLURAL, "plain", "-n", namespace, "--type=merge", "--dry-run=server",
                           "-p", json.dumps(body))

    assert patch({"metadata": {"annotations": {"weightsync.io/x": "y"}}}).returncode == 0
    assert refused(patch({"spec": {"network": {"rdma": {"hostNetwork": True}}}}), "ValidatingAdmissionPolicy",
                   "changes neither a job's spec nor its labels")
    assert refused(patch({"metadata": {"labels": {queueing.QUEUE_LABEL: "the-fast-lane"}}}),
                   "ValidatingAdmissionPolicy", "changes neither a job's spec nor its labels")
    jobs.kubectl("delete", PLURAL, "plain", "hostnet", "sockets", "--wait=true")
