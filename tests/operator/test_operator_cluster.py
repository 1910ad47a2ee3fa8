"""The CRD and the operator against a real local control plane (kube-apiserver, controllers,
scheduler, KWOK nodes with and without RDMA): what the API server refuses, what the operator
creates, where pods land, and how jobs end. Everything is read back from the API server."""

import base64
import json

import pytest
import yaml
from controlplane import wait_for

from weightsync.job import (
    API_VERSION,
    CONTROLLER,
    INFERENCE,
    KIND,
    LABEL_JOB,
    LABEL_ROLE,
    PLURAL,
    POD_INDEX_LABEL,
    ROLES,
    SPEC_KEY,
    STORE_PORT,
    TOKEN_KEY,
    TRAINER,
    Env,
    SpecError,
    load_job,
    reasons,
)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

RDMA = "rdma/rdma_shared_device_a"
RDMA_NODES = {"gpu-rdma-0", "gpu-rdma-1"}
SMALL = {"trainer": {"replicas": 2}, "inference": {"replicas": 1}}


def test_crd_is_accepted(cluster, crd_applied):
    assert "weighttransferjobs.weightsync.io" in crd_applied.stdout
    crd = json.loads(cluster.kubectl("get", "crd", "weighttransferjobs.weightsync.io", "-o", "json").stdout)
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["wtj"]
    assert cluster.kubectl("get", "wtj", "--all-namespaces").returncode == 0  # the short name is served


INVALID = [
    ({"model": {"config": {"model_type": "gpt2"}, "path": "/m"}}, "demo", "set exactly one of spec.model.config"),
    ({"model": {}}, "demo", "set exactly one of spec.model.config"),
    ({"model": {"config": {"n_layer": 2}}}, "demo", "spec.model.config needs model_type"),
    ({"trainer": {"replicas": 0}}, "demo", "spec.trainer.replicas in body should be greater than or equal to 1"),
    ({"inference": {"replicas": 0}}, "demo", "spec.inference.replicas in body should be greater than or equal to 1"),
    ({"trainer": {"procsPerPod": 17}}, "demo", "spec.trainer.procsPerPod in body should be less than or equal to 16"),
    ({"network": {"mode": "infiniband"}}, "demo",
     'spec.network.mode: Unsupported value: "infiniband": supported values: "auto", "rdma", "tcp"'),
    ({"network": {"rdma": {"gidIndex": 300}}}, "demo", "spec.network.rdma.gidIndex in body should be less than or equal to 255"),
    ({}, "j" * 43, "metadata.name must be at most 42 characters"),
    ({}, "demo.v2", "metadata.name must start with a lowercase letter"),
    ({"transfer": {"verify": "sha"}}, "demo", 'spec.transfer.verify: Unsupported value: "sha"'),
    ({"model": {"path": "models/x"}}, "demo", "spec.model.path in body should match '^/'"),
    ({"model": {"config": {"model_type": "gpt2"}, "dtype": "int8"}}, "demo", 'spec.model.dtype: Unsupported value: "int8"'),
    ({"training": {"learningRate": 0}}, "demo", "spec.training.learningRate in body should be greater than 0"),
    ({"trainer": {"resources": {"limits": {"cpu": "lots"}}}}, "demo", "spec.trainer.resources.limits.cpu in body should match"),
    ({"imagePullSecrets": [{}]}, "demo", "spec.imagePullSecrets[0].name: Required value"),
    ({"inference": {"replicas": 3, "tensorParallelSizes": [2, 2]}}, "demo",
     "tensorParallelSizes must add up to inference replicas x procsPerPod"),
    ({"model": {"config": {"model_type": "llama", "num_attention_heads": 6}},
      "inference": {"tensorParallel": 4, "engine": "vllm"}}, "demo",
     "every tensor-parallel size must divide spec.model.config.num_attention_heads"),
    ({"inference": {"replicas": 2, "tensorParallelSizes": [2, 1], "engine": "vllm"}}, "demo",
     "with spec.inference.engine vllm on GPUs (gpusPerProc 1) every server has one tensor-parallel size"),
]


@pytest.mark.parametrize("spec,name,message", INVALID, ids=[m[:40] for _, _, m in INVALID])
def test_invalid_specs_are_refused_by_the_api_server(ns, spec, name, message):
    proc = ns.apply_job(name, spec, check=False)
    assert proc.returncode != 0, f"the API server accepted an invalid job: {spec}"
    assert "is invalid" in proc.stderr and message in proc.stderr, proc.stderr
    # The contract module refuses it too, before anything reaches a cluster.
    obj = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
           "spec": {"model": {"config": {"model_type": "gpt2"}}, **spec}}
    with pytest.raises(SpecError):
        load_job(obj)


def owned_by(obj, job):
    (ref,) = obj["metadata"]["ownerReferences"]
    return ref["uid"] == job["metadata"]["uid"] and ref["kind"] == KIND and ref["controller"] is True


def container(sts):
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return c


def env(sts):
    return {e["name"]: e.get("value") for e in container(sts)["env"]}


def test_tcp_job_children(ns):
    ns.apply_job("tcp", {**SMALL, "network": {"mode": "tcp", "tcp": {"socketIfname": "eth0"}}})
    children = ns.wait_children("tcp")
    job = ns.job("tcp")
    assert all(owned_by(o, job) for o in children.values())

    svc = children["Service/tcp"]["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    token = base64.b64decode(children["Secret/tcp-token"]["data"][TOKEN_KEY])
    assert len(token) >= 32
    spec_doc = yaml.safe_load(children["ConfigMap/tcp-spec"]["data"][SPEC_KEY])
    assert spec_doc["spec"] == job["spec"]  # the job as the API server defaulted it
    assert spec_doc["spec"]["training"]["steps"] == 100
    role = children["Role/tcp-controller"]
    assert all(r["resourceNames"] == ["tcp"] for r in role["rules"])

    sets = {r: children[f"StatefulSet/tcp-{r}"] for r in ROLES}
    assert [(s["spec"]["ordinals"]["start"], s["spec"]["replicas"]) for s in sets.values()] == [(0, 1), (1, 2), (3, 1)]
    for r, s in sets.items():
        assert s["spec"]["serviceName"] == "tcp" and s["spec"]["podManagementPolicy"] == "Parallel"
        assert container(s)["command"] == ["weightsync", "worker"]
        assert env(s)[Env.NETWORK_MODE] == "tcp"
        limits = container(s).get("resources", {}).get("limits", {})
        assert RDMA not in limits
        if r == CONTROLLER:
            assert "nvidia.com/gpu" not in limits
        else:
            assert env(s)["NCCL_IB_DISABLE"] == "1" and env(s)["NCCL_SOCKET_IFNAME"] == "eth0"
            assert limits["nvidia.com/gpu"] == "1"
        assert container(s)["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # no IPC_LOCK

    status = ns.wait_phase("tcp", "Running")
    assert status["network"] == {"mode": "tcp", "reason": "spec.network.mode is tcp"}
    assert {r: v["summary"] for r, v in status["replicas"].items()} == {"controller": "1/1", "trainer": "2/2", "inference": "1/1"}
    pods = ns.wait_running_pods("tcp", 4)
    assert sorted(p["metadata"]["name"] for p in pods) == ["tcp-controller-0", "tcp-inference-3",
                                                           "tcp-trainer-1", "tcp-trainer-2"]
    gpu_nodes = {"gpu-0", "gpu-1"} | RDMA_NODES
    for p in pods:
        if p["metadata"]["labels"][LABEL_ROLE] != CONTROLLER:
            assert p["spec"]["nodeName"] in gpu_nodes
        assert p["metadata"]["labels"][POD_INDEX_LABEL] == p["metadata"]["name"].rsplit("-", 1)[1]


def test_rdma_job_lands_on_rdma_nodes(ns):
    ns.apply_job("rdma", {**SMALL, "network": {"mode": "rdma", "rdma": {
        "hcas": ["mlx5_0", "mlx5_1"], "networks": "rdma-net", "hostNetwork": True}}})
    children = ns.wait_children("rdma")
    for r in (TRAINER, INFERENCE):
        s = children[f"StatefulSet/rdma-{r}"]
        c, pod = container(s), s["spec"]["template"]
        assert c["resources"]["limits"][RDMA] == "1" == c["resources"]["requests"][RDMA]
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]
        assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
        assert pod["spec"]["hostNetwork"] is True and pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
        e = env(s)
        assert e["NCCL_IB_DISABLE"] == "0" and e["NCCL_IB_HCA"] == "mlx5_0,mlx5_1" and e["NCCL_IB_TC"] == "104"
        assert e["UCCL_P2P_RDMA_DEV"] == "mlx5_0,mlx5_1"
    ctl = children["StatefulSet/rdma-controller"]
    assert not container(ctl).get("resources") and not ctl["spec"]["template"]["spec"].get("hostNetwork")

    pods = ns.wait_running_pods("rdma", 4)
    for p in pods:
        if p["metadata"]["labels"][LABEL_ROLE] != CONTROLLER:
            assert p["spec"]["nodeName"] in RDMA_NODES, f"{p['metadata']['name']} on {p['spec']['nodeName']}"
    ns.wait_phase("rdma", "Running")


def test_auto_takes_rdma_when_nodes_offer_it(ns):
    ns.apply_job("auto", {})
    ns.wait_children("auto")
    status = wait_for("network recorded", lambda: ns.status("auto").get("network"))
    assert status["mode"] == "rdma" and "gpu-rdma-0" in status["reason"]
    assert RDMA in container(ns.get("statefulset", "auto-trainer"))["resources"]["limits"]
    event = ns.wait_event("auto", "NetworkResolved")
    assert "network mode rdma" in event["message"]


def test_auto_without_rdma_nodes_takes_tcp_and_never_flips(cluster, operator, ns):
    try:
        for node in sorted(RDMA_NODES):
            cluster.delete_node(node)
        ns.apply_job("auto", SMALL)
        ns.wait_children("auto")
        network = wait_for("network recorded", lambda: ns.status("auto").get("network"))
        assert network["mode"] == "tcp"
        assert network["reason"] == f"auto: no schedulable node offers 1 {RDMA} in its allocatable resources"
        event = ns.wait_event("auto", "NetworkResolved")
        assert event["type"] == "Normal" and "network mode tcp" in event["message"]
        ns.wait_running_pods("auto", 4)  # on the GPU nodes without RDMA
    finally:
        cluster.reset_nodes()
    # RDMA nodes are back; an operator restart leaves the choice alone.
    operator.restart()
    wait_for("resume", lambda: "[%s/auto] Resuming is processed" % ns.name in operator.log_since_start())
    assert ns.status("auto")["network"] == network
    assert env(ns.get("statefulset", "auto-trainer"))["NCCL_IB_DISABLE"] == "1"
    assert RDMA not in container(ns.get("statefulset", "auto-trainer"))["resources"]["limits"]
    assert [e["message"] for e in ns.events("auto") if e["reason"] == "NetworkResolved"] == [event["message"]]


def test_an_external_role_gets_the_join_secret_and_no_pods(ns):
    ns.apply_job("ext", {"trainer": {"external": True, "replicas": 2}, "inference": {"replicas": 1}})
    children = wait_for("the children of ext", lambda: c if "Secret/ext-join" in (c := ns.children("ext"))
                        and "StatefulSet/ext-inference" in c else None)
    job = ns.job("ext")
    assert all(owned_by(o, job) for o in children.values())
    assert sorted(k for k in children if k.startswith("StatefulSet/")) == ["StatefulSet/ext-controller",
                                                                           "StatefulSet/ext-inference"]
    join = {k: base64.b64decode(v).decode() for k, v in children["Secret/ext-join"]["data"].items()}
    assert join == {"WEIGHTSYNC_CONTROLLER": f"ext-controller-0.ext.{ns.name}.svc:{STORE_PORT}",
                    "WEIGHTSYNC_JOB_ID": f"{ns.name}/ext",
                    "WEIGHTSYNC_TOKEN": base64.b64decode(children["Secret/ext-token"]["data"][TOKEN_KEY]).decode()}
    status = ns.wait_phase("ext", "Running")  # the operator's own two pods: nothing waits for the trainers
    assert {r: v["summary"] for r, v in status["replicas"].items()} == {
        "controller": "1/1", "trainer": "external (2 ranks)", "inference": "1/1"}
    ns.kubectl("delete", "secret", "ext-join")
    wait_for("the join Secret put back", lambda: (s := ns.get("secret", "ext-join")) and s["data"] ==
             children["Secret/ext-join"]["data"])
    assert not ns.get("statefulsets", selector=f"{LABEL_JOB}=ext,{LABEL_ROLE}=trainer")["items"]


def test_deleting_a_job_removes_every_child(ns):
    ns.apply_job("gone", SMALL)
    ns.wait_children("gone")
    ns.wait_running_pods("gone", 4)
    ns.kubectl("delete", PLURAL, "gone", "--wait=true", "--timeout=60s")
    wait_for("children garbage-collected", lambda: not ns.children("gone") and not ns.pods("gone"), 90)


def test_restarting_the_operator_writes_nothing_that_is_right(operator, ns):
    ns.apply_job("steady", SMALL)
    ns.wait_children("steady")
    ns.wait_phase("steady", "Running")
    ns.wait_running_pods("steady", 4)

    def versions():
        objs = {**ns.children("steady"), "job": ns.job("steady")}
        return {k: o["metadata"]["resourceVersion"] for k, o in objs.items()}

    # Settled: every pod ready and reported, so nothing is left for the operator to write.
    wait_for("all pods reported ready", lambda: ns.condition("steady", "Ready").get("status") == "True")
    before = wait_for("no write in flight", lambda: (v := versions()) == versions() and v)
    operator.restart()
    def resumed():
        log = operator.log_since_start()
        done = f"[{ns.name}/steady] Resuming is processed" in log and all(
            f"[{ns.name}/steady-{r}] Handler 'statefulset_changed' succeeded" in log for r in ROLES)
        return log if done else None

    log = wait_for("resume and status refresh", resumed)
    assert f"[{ns.name}/steady] children:" not in log  # nothing created or patched
    assert versions() == before


def test_drifted_children_are_put_back(ns):
    ns.apply_job("drift", SMALL)
    ns.wait_children("drift")
    ns.wait_phase("drift", "Running")
    ns.kubectl("patch", "statefulset", "drift-trainer", "--type=merge", "-p", '{"spec":{"replicas":5}}')
    wait_for("StatefulSet put back", lambda: ns.get("statefulset", "drift-trainer")["spec"]["replicas"] == 2)
    ns.kubectl("delete", "configmap", "drift-spec")
    wait_for("ConfigMap put back", lambda: ns.get("configmap", "drift-spec"))
    # (the StatefulSet's repair set Repaired first, with its own message: wait for the ConfigMap's)
    repaired = wait_for("ChildrenCreated Repaired for the ConfigMap",
                        lambda: (c := ns.condition("drift", "ChildrenCreated")).get("reason") == "Repaired"
                        and "ConfigMap drift-spec" in c.get("message", "") and c)
    assert repaired["status"] == "True" and "ConfigMap drift-spec (it had been deleted)" in repaired["message"]
    assert ns.status("drift")["phase"] == "Running"


def test_completion_scales_to_zero_and_succeeds(cluster, ns):
    ns.apply_job("done", SMALL)
    ns.apply_job("other", SMALL)
    ns.wait_children("done")
    ns.wait_phase("done", "Running")
    # The controller pod's identity: it may patch its own job's status and nothing else.
    token = ns.kubectl("create", "token", "done-controller").stdout.strip()
    as_controller = ("--token", token)
    denied = ns.kubectl(*as_controller, "patch", PLURAL, "other", "--subresource=status", "--type=merge",
                        "-p", '{"status":{"completion":{"state":"Succeeded"}}}', check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr
    denied = ns.kubectl(*as_controller, "patch", PLURAL, "done", "--type=merge",
                        "-p", '{"spec":{"image":"x"}}', check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr
    completion = {"state": "Succeeded", "message": "all versions verified", "versions": 11, "time": "2026-01-01T00:00:00Z"}
    ns.kubectl(*as_controller, "patch", PLURAL, "done", "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": {"completion": completion}}))

    status = ns.wait_phase("done", "Succeeded")
    wait_for("StatefulSets at zero", lambda: all(
        s["spec"]["replicas"] == 0 for s in ns.get("statefulsets", selector=f"{LABEL_JOB}=done")["items"]))
    wait_for("pods gone", lambda: not ns.pods("done"), 60)
    completed = ns.condition("done", "Completed")
    assert completed["status"] == "True" and completed["message"] == "11 weight versions delivered: all versions verified"
    assert status["completion"] == completion  # the controller's report is kept as written
    assert ns.wait_event("done", "Succeeded")["type"] == "Normal"
    assert ns.status("other")["phase"] == "Running"


def test_topology_is_immutable(ns):
    ns.apply_job("fixed", SMALL)
    ns.wait_children("fixed")
    topology = "trainer and inference replicas, procsPerPod and the tensor-parallel sizes are immutable"
    refusals = [
        ('{"spec":{"trainer":{"replicas":3}}}', topology),
        ('{"spec":{"inference":{"procsPerPod":2}}}', topology),
        ('{"spec":{"inference":{"tensorParallelSizes":[1]}}}', topology),
        ('{"spec":{"model":{"dtype":"float32"}}}', "spec.model is immutable"),
        ('{"spec":{"network":{"mode":"tcp"}}}', "spec.network.mode is immutable"),
        ('{"spec":{"trainer":{"external":true}}}', "spec.trainer.external and spec.inference.external are immutable"),
        ('{"spec":{"inference":{"replicas":2}}}', "spec.inference.replicas can change only in a job created with "
                                                  "spec.inference.maxReplicas"),
        ('{"spec":{"inference":{"maxReplicas":3}}}', "spec.inference.maxReplicas is immutable"),
    ]
    for patch, message in refusals:
        proc = ns.kubectl("patch", PLURAL, "fixed", "--type=merge", "-p", patch, check=False)
        assert proc.returncode != 0 and message in proc.stderr, (patch, proc.stderr)


def test_an_impossible_request_ends_in_a_condition_and_an_event(operator, ns):
    # 16 GPUs per pod; the largest node has 8.
    ns.apply_job("huge", {"trainer": {"procsPerPod": 2, "gpusPerProc": 8}})
    ns.wait_children("huge")
    ready = wait_for("Ready=False Unschedulable",
                     lambda: (c := ns.condition("huge", "Ready")).get("reason") == "Unschedulable" and c)
    assert ready["status"] == "False" and "huge-trainer-1" in ready["message"] and "nvidia.com/gpu" in ready["message"]
    assert ns.wait_event("huge", "Unschedulable")["type"] == "Warning"
    assert ns.status("huge")["phase"] == "Pending"
    assert operator.healthy()


def test_a_missing_pull_secret_holds_the_pods_until_it_exists(ns):
    ns.apply_job("private", {"imagePullSecrets": [{"name": "regcred"}]})
    cond = wait_for("ChildrenCreated=False",
                    lambda: (c := ns.condition("private", "ChildrenCreated")).get("reason") == "ImagePullSecretMissing" and c)
    assert "regcred" in cond["message"] and cond["status"] == "False"
    assert ns.wait_event("private", "ImagePullSecretMissing")["type"] == "Warning"
    assert not [k for k in ns.children("private") if k.startswith("StatefulSet/")]
    ns.kubectl("create", "secret", "docker-registry", "regcred", "--docker-server=registry.local",
               "--docker-username=u", "--docker-password=p")
    children = ns.wait_children("private", timeout=60)  # the operator retries every 15 s
    assert children["StatefulSet/private-trainer"]["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    wait_for("ChildrenCreated=True", lambda: ns.condition("private", "ChildrenCreated").get("status") == "True")


def test_a_child_the_api_server_refuses_fails_the_job_not_the_operator(operator, ns):
    # The CRD cannot know every pod rule: a label key with a space passes it, not the StatefulSet's.
    ns.apply_job("refused", {"trainer": {"nodeSelector": {"bad key": "x"}}})
    failed = ns.wait_phase("refused", "Failed")
    cond = {c["type"]: c for c in failed["conditions"]}["ChildrenCreated"]
    assert cond["reason"] == "ChildRefused" and "StatefulSet refused-trainer" in cond["message"]
    assert "nodeSelector" in cond["message"]
    assert ns.wait_event("refused", "ChildRefused")["type"] == "Warning"
    assert operator.healthy()
    ns.apply_job("fine", {})
    ns.wait_children("fine")


def test_a_suspended_job_runs_no_pods_until_resumed_and_suspending_a_running_one_removes_them(ns):
    """spec.suspend as batch/v1 Job has it: created suspended, the job has its children but no
    pods; resumed, its pods start; suspended while it runs (the one spec change a running job
    takes), its pods go, its status keeps what it delivered, and the controller started next begins
    the job anew. A finished job cannot be suspended."""
    ns.apply_job("held", {**SMALL, "suspend": True})
    children = ns.wait_children("held")
    assert all(children[f"StatefulSet/held-{r}"]["spec"]["replicas"] == 0 for r in ROLES)
    status = ns.wait_phase("held", "Suspended")
    assert ns.condition("held", "Suspended")["reason"] == reasons.SUSPENDED
    assert {r: v["summary"] for r, v in status["replicas"].items()} == {r: "0/0" for r in ROLES}
    assert ns.wait_event("held", "Suspended")["type"] == "Normal"
    assert not ns.pods("held")

    ns.kubectl("patch", PLURAL, "held", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    ns.wait_phase("held", "Running")
    ns.wait_running_pods("held", 4)
    assert ns.condition("held", "Suspended")["status"] == "False"
    assert ns.condition("held", "Suspended")["reason"] == reasons.RESUMED
    # what the job's controller pod reports as it runs
    ns.kubectl("patch", PLURAL, "held", "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"controller": {"starts": 1, "started": "2026-01-01T00:00:00Z"},
                    "transfer": {"version": 3, "bytes": 1000, "gbps": 1.0}}}))
    refused = ns.kubectl("patch", PLURAL, "held", "--type=merge", "-p", '{"spec":{"image":"other"}}',
                         check=False)
    assert refused.returncode != 0 and "suspend it first" in refused.stderr

    ns.kubectl("patch", PLURAL, "held", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    status = ns.wait_phase("held", "Suspended")
    wait_for("pods of a suspended job gone", lambda: not ns.pods("held"), 60)
    assert "controller" not in ns.status("held"), "the controller a resume starts would count itself restarted"
    assert status["transfer"]["version"] == 3  # what it delivered stays

    completion = {"state": "Succeeded", "message": "done", "versions": 4, "time": "2026-01-01T00:00:00Z"}
    ns.kubectl("patch", PLURAL, "held", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    ns.kubectl("patch", PLURAL, "held", "--subresource=status", "--type=merge", "-p",
               json.dumps({"status": {"completion": completion}}))
    ns.wait_phase("held", "Succeeded")
    refused = ns.kubectl("patch", PLURAL, "held", "--type=merge", "-p", '{"spec":{"suspend":true}}',
                         check=False)
    assert refused.returncode != 0 and "has finished" in refused.stderr


def test_a_running_job_scales_its_inference_pods_up_to_max_replicas_and_replaces_no_other_pod(ns):
    """spec.inference.maxReplicas: kubectl scale (the scale subresource) changes the inference
    pods' count of a running job, up to it; the StatefulSet follows, its template unchanged, and
    no pod of another role is replaced. Any other change of the running spec is still refused, and
    so is a count above maxReplicas."""
    ns.apply_job("elastic", {"trainer": {"replicas": 1}, "inference": {"replicas": 1, "maxReplicas": 3}})
    ns.wait_phase("elastic", "Running")
    ns.wait_running_pods("elastic", 3)
    before = ns.get("statefulset", "elastic-inference")["spec"]["template"]
    others = {p["metadata"]["name"]: p["metadata"]["uid"] for p in ns.pods("elastic")
              if p["metadata"]["labels"][LABEL_ROLE] != "inference"}

    ns.kubectl("scale", PLURAL, "elastic", "--replicas=3")
    wait_for("three inference pods", lambda: ns.get("statefulset", "elastic-inference")["spec"]["replicas"] == 3)
    ns.wait_running_pods("elastic", 5)
    assert ns.get("statefulset", "elastic-inference")["spec"]["template"] == before
    wait_for("status: 3/3 inference", lambda: ns.status("elastic")["replicas"]["inference"]["summary"] == "3/3")
    scale = json.loads(ns.kubectl("get", PLURAL, "elastic", "--subresource=scale", "-o", "json").stdout)
    assert (scale["kind"], scale["spec"]["replicas"], scale["status"]["replicas"]) == ("Scale", 3, 3)
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in ns.pods("elastic")
            if p["metadata"]["labels"][LABEL_ROLE] != "inference"} == others

    refused = ns.kubectl("scale", PLURAL, "elastic", "--replicas=4", check=False)
    assert refused.returncode != 0 and "spec.inference.replicas is more than spec.inference.maxReplicas" in refused.stderr
    refused = ns.kubectl("patch", PLURAL, "elastic", "--type=merge", "-p",
                         '{"spec":{"inference":{"replicas":2,"awayGraceSeconds":5}}}', check=False)
    assert refused.returncode != 0 and "cannot change while it runs" in refused.stderr

    ns.kubectl("scale", PLURAL, "elastic", "--replicas=1")
    wait_for("one inference pod", lambda: len([p for p in ns.pods("elastic")
                                               if p["metadata"]["labels"][LABEL_ROLE] == "inference"]) == 1, 60)
    assert ns.status("elastic")["replicas"]["inference"]["desired"] == 1
