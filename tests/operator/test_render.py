"""Rendering a job's children, choosing its network, computing its status: the operator's pure
functions, without a cluster."""

import base64
import re

import pytest
import yaml

from weightsync.job import (
    API_VERSION,
    CONTROLLER,
    DATA_PORT,
    HEALTH_PORT,
    INFERENCE,
    KIND,
    LABEL_JOB,
    LIVENESS,
    MASTER_PORT,
    PLURAL,
    READINESS,
    ROLES,
    SHM_MOUNT,
    SPEC_KEY,
    SPEC_MOUNT,
    STARTUP,
    STORE_PORT,
    TMP_MOUNT,
    TOKEN_KEY,
    TOKEN_MOUNT,
    TRAINER,
    VERSION,
    WORKER_UID,
    WRITABLE_ENV,
    Env,
    Layout,
    SpecError,
    load_job,
    master_addr,
    torchrun_env,
)
from weightsync.job.states import Condition
from weightsync_operator import network, render, status, tokens
from weightsync_operator.handlers import children
from weightsync_operator.kube import ApiError, matches
from weightsync_operator.report import Indexes

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def job(spec=None, name="demo", namespace="team-a"):
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"config": {"model_type": "gpt2", "n_layer": 2}}, **(spec or {})}})


def by_kind(objs):
    out = {}
    for o in objs:
        out.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    return out


def pod(job, role, mode):
    return render.statefulset(job, role, mode)["spec"]["template"]


def container(job, role, mode):
    return pod(job, role, mode)["spec"]["containers"][0]


def env(job, role, mode):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(job, role, mode)["env"]}


# ------------------------------------------------------------------ defaulting and the spec file

def test_configmap_holds_the_defaulted_job_that_the_workers_load():
    j = job({"trainer": {"replicas": 3}})
    cm = render.configmap(j)
    doc = yaml.safe_load(cm["data"][SPEC_KEY])
    assert doc["spec"]["training"]["steps"] == 100  # a CRD default, applied before rendering
    assert doc["spec"]["trainer"] == {"replicas": 3, "procsPerPod": 1, "gpusPerProc": 1, "attachTimeoutSeconds": 1800,
                                      "external": False}
    assert load_job(doc) == j


def test_every_child_is_named_after_the_job_and_labelled_with_it():
    j = job({"trainer": {"replicas": 2}, "inference": {"replicas": 3}})
    kinds = by_kind(render.children(j, "tcp", "t" * 32))
    assert set(kinds) == {"Service", "Secret", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "StatefulSet"}
    assert set(kinds["StatefulSet"]) == {"demo-controller", "demo-trainer", "demo-inference"}
    assert set(kinds["Service"]) == {j.service_name} and set(kinds["Secret"]) == {j.secret_name}
    for objs in kinds.values():
        for o in objs.values():
            assert o["metadata"]["namespace"] == "team-a"
            assert o["metadata"]["labels"][LABEL_JOB] == "demo"


def test_statefulsets_share_one_ordinal_space_and_the_headless_service():
    j = job({"trainer": {"replicas": 2}, "inference": {"replicas": 3}})
    sets = by_kind(render.children(j, "tcp", "t" * 32))["StatefulSet"]
    assert [(sets[f"demo-{r}"]["spec"]["ordinals"]["start"], sets[f"demo-{r}"]["spec"]["replicas"])
            for r in (CONTROLLER, TRAINER, INFERENCE)] == [(0, 1), (1, 2), (3, 3)]
    for role in (CONTROLLER, TRAINER, INFERENCE):
        s = sets[f"demo-{role}"]["spec"]
        assert s["serviceName"] == "demo" and s["podManagementPolicy"] == "Parallel"
        assert s["selector"]["matchLabels"] == j.labels(role) == s["template"]["metadata"]["labels"]
    svc = render.service(j)["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    assert svc["selector"] == j.labels()  # all three roles


def test_finished_jobs_run_no_pods():
    j = job({"trainer": {"replicas": 2}})
    assert all(s["spec"]["replicas"] == 0 for s in render.children(j, "tcp", "t" * 32, stopped=True)
               if s["kind"] == "StatefulSet")


def test_longest_allowed_name_keeps_every_child_name_valid():
    name = "j" * 42  # the CRD's limit
    j = job({"trainer": {"replicas": 1024}, "inference": {"replicas": 1024}}, name=name)
    for o in render.children(j, "tcp", "t" * 32):
        assert DNS_LABEL.match(o["metadata"]["name"]) and len(o["metadata"]["name"]) <= 63
    last = j.layout.pods - 1
    assert len(j.pod_name(last)) <= 63 and DNS_LABEL.match(j.pod_name(last))
    # The StatefulSet controller labels pods with "<statefulset>-<10-character hash>".
    assert len(j.child_name(INFERENCE)) + 11 <= 63
    with pytest.raises(SpecError, match="at most 42 characters"):
        job(name="j" * 43)


def test_secret_and_rbac():
    j = job()
    sec = render.secret(j, "s3cret-token-value")
    assert base64.b64decode(sec["data"][TOKEN_KEY]) == b"s3cret-token-value"
    rules = render.role(j)["rules"]
    assert all(r["resourceNames"] == ["demo"] for r in rules)
    assert {(tuple(r["resources"]), tuple(r["verbs"])) for r in rules} == {
        ((PLURAL,), ("get",)), ((f"{PLURAL}/status",), ("get", "patch"))}
    binding = render.role_binding(j)
    assert binding["roleRef"]["name"] == j.service_account_name
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": j.service_account_name, "namespace": "team-a"}]


# ------------------------------------------------------------------ pods per role and mode

def test_every_pod_learns_its_ordinal_job_and_files():
    j = job()
    for role in (CONTROLLER, TRAINER, INFERENCE):
        e = env(j, role, "tcp")
        assert e[Env.ORDINAL] == {"fieldRef": {"apiVersion": "v1",
                                               "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
        assert e[Env.POD_IP]["fieldRef"]["fieldPath"] == "status.podIP"
        assert e[Env.POD_NAME]["fieldRef"]["fieldPath"] == "metadata.name"
        assert e[Env.NAMESPACE]["fieldRef"]["fieldPath"] == "metadata.namespace"
        assert e[Env.CONTROLLER_HOST] == "demo-controller-0.demo.team-a.svc" == j.controller_host
        assert e[Env.SPEC_FILE] == f"{SPEC_MOUNT}/{SPEC_KEY}"
        assert e[Env.TOKEN_FILE] == f"{TOKEN_MOUNT}/{TOKEN_KEY}"
        assert e[Env.NETWORK_MODE] == "tcp"
        assert (Env.REPORT_TO_KUBERNETES in e) == (role == CONTROLLER)
        c = container(j, role, "tcp")
        assert c["command"] == ["weightsync", "worker"] and c["image"] == render.FALLBACK_WORKER_IMAGE
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {SPEC_MOUNT, TOKEN_MOUNT} <= mounts


def test_a_trainer_command_pod_gets_where_its_ranks_meet_and_the_users_env_and_image():
    user_env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                {"name": "OMP_NUM_THREADS", "value": "4"}]
    j = job({"image": "ghcr.io/weightsync/worker:dev",
             "trainer": {"replicas": 2, "procsPerPod": 4, "command": ["torchrun", "train.py"], "args": ["--fsdp"],
                         "env": user_env, "image": "registry.example/my-trainer:1"}})
    c = container(j, TRAINER, "tcp")
    assert c["image"] == "registry.example/my-trainer:1" and c["command"] == ["weightsync", "worker"]
    e = env(j, TRAINER, "tcp")
    assert e["MASTER_ADDR"] == "demo-trainer-1.demo.team-a.svc" == master_addr(j)
    assert e["MASTER_PORT"] == str(MASTER_PORT)
    assert e["HF_TOKEN"] == user_env[0]["valueFrom"] and e["OMP_NUM_THREADS"] == "4"
    names = [v["name"] for v in c["env"]]
    assert names.index("OMP_NUM_THREADS") > names.index(Env.TOKEN_FILE)  # the user's own come last
    assert {"name": "torch", "containerPort": MASTER_PORT, "protocol": "TCP"} in c["ports"]
    for role in (CONTROLLER, INFERENCE):  # only trainer pods run the command
        assert container(j, role, "tcp")["image"] == "ghcr.io/weightsync/worker:dev"
        assert "MASTER_ADDR" not in env(j, role, "tcp") and "HF_TOKEN" not in env(j, role, "tcp")
    builtin = job()
    assert "MASTER_ADDR" not in env(builtin, TRAINER, "tcp")
    assert all(p["name"] != "torch" for p in container(builtin, TRAINER, "tcp")["ports"])


def test_the_worker_gives_each_trainer_pods_command_torchruns_variables():
    j = job({"trainer": {"replicas": 3, "procsPerPod": 4, "command": ["torchrun", "train.py"]}})
    second = torchrun_env(j, 2, "demo-trainer-1.demo.team-a.svc", 29800)
    assert second == {"MASTER_ADDR": "demo-trainer-1.demo.team-a.svc", "MASTER_PORT": "29800", "WORLD_SIZE": "12",
                      "NODE_RANK": "1", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "4", "PET_NNODES": "3",
                      "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "demo-trainer-1.demo.team-a.svc",
                      "PET_MASTER_PORT": "29800"}
    single = job({"trainer": {"replicas": 3, "command": ["python", "train.py"]}})
    third = torchrun_env(single, 3, "127.0.0.1", 1234)
    assert third["RANK"] == "2" and third["LOCAL_RANK"] == "0" and third["WORLD_SIZE"] == "3"  # env:// without torchrun


def test_vllm_pods_serve_the_openai_api_through_a_service_of_their_own():
    j = job({"inference": {"replicas": 2, "engine": "vllm", "image": "registry.example/weightsync-vllm:1",
                           "vllm": {"port": 8100, "args": ["--max-model-len", "4096"]}}})
    kids = by_kind(render.children(j, "tcp", "t" * 64))
    served = kids["Service"]["demo-vllm"]["spec"]
    assert served["selector"] == j.labels(INFERENCE) and "clusterIP" not in served  # ready pods only
    assert served["ports"] == [{"name": "vllm", "port": 8100, "targetPort": "vllm", "protocol": "TCP"}]
    c = container(j, INFERENCE, "tcp")
    assert c["image"] == "registry.example/weightsync-vllm:1"
    assert {"name": "vllm", "containerPort": 8100, "protocol": "TCP"} in c["ports"]
    assert {"name": "dshm", "mountPath": SHM_MOUNT} in c["volumeMounts"]
    assert {"name": "VLLM_CACHE_ROOT", "value": "/tmp/vllm"} in c["env"]
    assert "demo-vllm" not in by_kind(render.children(job(), "tcp", "t" * 64))["Service"]


def test_a_tensor_parallel_vllm_pod_asks_for_a_gpu_and_a_data_port_per_worker():
    """One server per pod, spec.inference.tensorParallel workers: each worker is an inference rank
    on a GPU of its own, listening on a data port of its own."""
    j = job({"inference": {"replicas": 2, "engine": "vllm", "tensorParallel": 4, "gpusPerProc": 1}})
    c = container(j, INFERENCE, "tcp")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4" and c["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert [p["name"] for p in c["ports"] if p["name"].startswith("data-")] == ["data-0", "data-1", "data-2", "data-3"]
    assert j.layout.world_size(INFERENCE) == 8 and list(j.layout.ranks_of(j.layout.first_ordinal(INFERENCE) + 1)) == [4, 5, 6, 7]


def test_only_the_controller_holds_an_api_identity():
    j = job()
    ctl = pod(j, CONTROLLER, "tcp")["spec"]
    assert ctl["serviceAccountName"] == j.service_account_name and ctl["automountServiceAccountToken"] is True
    for role in (TRAINER, INFERENCE):
        spec = pod(j, role, "tcp")["spec"]
        assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec


def test_tcp_pods():
    j = job({"network": {"mode": "tcp", "tcp": {"socketIfname": "eth0"}}})
    for role in (TRAINER, INFERENCE):
        e = env(j, role, "tcp")
        assert e["NCCL_IB_DISABLE"] == "1" and e["NCCL_SOCKET_IFNAME"] == "eth0"
        c = container(j, role, "tcp")
        assert c["resources"] == {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}}
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        spec = pod(j, role, "tcp")["spec"]
        assert "hostNetwork" not in spec and all(v["name"] != "dshm" for v in spec["volumes"])
        assert render.MULTUS_ANNOTATION not in pod(j, role, "tcp")["metadata"]["annotations"]


def test_rdma_pods():
    j = job({"network": {"mode": "rdma", "rdma": {"resourceCount": 2, "hcas": ["mlx5_0", "mlx5_1"], "gidIndex": 5,
                                                  "networks": "default/rdma-net", "hostNetwork": True}}})
    for role in (TRAINER, INFERENCE):
        e = env(j, role, "rdma")
        assert e["NCCL_IB_DISABLE"] == "0" and e["NCCL_IB_HCA"] == "mlx5_0,mlx5_1" == e["UCCL_P2P_RDMA_DEV"]
        assert e["NCCL_IB_GID_INDEX"] == "5" and e["NCCL_IB_TC"] == "104" and e["NCCL_NET_GDR_LEVEL"] == "PHB"
        c = container(j, role, "rdma")
        resources = c["resources"]
        assert resources["limits"]["rdma/rdma_shared_device_a"] == "2" == resources["requests"]["rdma/rdma_shared_device_a"]
        # IPC_LOCK and root (which IPC_LOCK needs to lift the locked-memory limit), nothing more.
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
        assert pod(j, role, "rdma")["spec"]["securityContext"] == {"runAsUser": 0, "runAsGroup": 0,
                                                                   "seccompProfile": {"type": "RuntimeDefault"}}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        p = pod(j, role, "rdma")
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in p["spec"]["volumes"]
        assert p["spec"]["hostNetwork"] is True and p["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert p["metadata"]["annotations"][render.MULTUS_ANNOTATION] == "default/rdma-net"
    # The controller: no GPU, no RDMA device, no special networking, no root.
    c = container(j, CONTROLLER, "rdma")
    assert "resources" not in c and "add" not in c["securityContext"]["capabilities"]
    p = pod(j, CONTROLLER, "rdma")
    assert p["spec"]["securityContext"]["runAsNonRoot"] is True
    assert "hostNetwork" not in p["spec"] and render.MULTUS_ANNOTATION not in p["metadata"]["annotations"]
    assert not any(k.startswith("NCCL_") for k in env(j, CONTROLLER, "rdma"))


def test_rdma_without_networks_or_host_network():
    j = job({"network": {"mode": "rdma"}})
    p = pod(j, TRAINER, "rdma")
    assert render.MULTUS_ANNOTATION not in p["metadata"]["annotations"] and "hostNetwork" not in p["spec"]
    assert "NCCL_IB_HCA" not in env(j, TRAINER, "rdma")


def test_auto_must_be_resolved_before_rendering():
    with pytest.raises(ValueError, match="resolved"):
        render.statefulset(job(), TRAINER, "auto")


def test_gpu_requests_follow_procs_per_pod_unless_resources_say_otherwise():
    j = job({"trainer": {"procsPerPod": 4, "gpusPerProc": 2, "resources": {"limits": {"cpu": "8", "memory": "64Gi"}}},
             "inference": {"procsPerPod": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
             "controller": {"resources": {"requests": {"cpu": "500m"}}}})
    trainer = container(j, TRAINER, "tcp")["resources"]
    assert trainer["limits"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "8"}
    assert trainer["requests"] == {"nvidia.com/gpu": "8"}
    assert container(j, INFERENCE, "tcp")["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert container(j, CONTROLLER, "tcp")["resources"] == {"requests": {"cpu": "500m"}}
    cpu_only = job({"trainer": {"gpusPerProc": 0}})
    assert "resources" not in container(cpu_only, TRAINER, "tcp")
    # Several processes in one pod share /dev/shm: memory-backed even over TCP.
    assert any(v["name"] == "dshm" for v in pod(j, TRAINER, "tcp")["spec"]["volumes"])
    assert [p["containerPort"] for p in container(j, INFERENCE, "tcp")["ports"]] == [
        DATA_PORT, DATA_PORT + 1, HEALTH_PORT]


def test_every_pod_is_probed_for_startup_liveness_and_readiness_on_its_health_port():
    j = job({"inference": {"procsPerPod": 2}})
    for role in (CONTROLLER, TRAINER, INFERENCE):
        for mode in ("tcp", "rdma"):
            c = container(j, role, mode)
            (health,) = [p for p in c["ports"] if p["name"] == "health"]
            assert health == {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"}
            assert env(j, role, mode)[Env.HEALTH_PORT] == str(HEALTH_PORT)
            for key, spec in (("startupProbe", STARTUP), ("livenessProbe", LIVENESS),
                              ("readinessProbe", READINESS)):
                assert c[key] == {"httpGet": {"path": spec.path, "port": "health", "scheme": "HTTP"},
                                  "periodSeconds": spec.period_seconds, "timeoutSeconds": spec.timeout_seconds,
                                  "failureThreshold": spec.failure_threshold}
    assert (LIVENESS.path, READINESS.path) == ("/healthz", "/readyz")
    # A pod that stops answering is restarted within seconds, and only after four probes in a row failed.
    assert LIVENESS.failure_threshold == 4 and LIVENESS.deadline == 25
    # One that has not answered yet (it imports torch and builds its model) has minutes to start,
    # and is live within seconds of its first answer; liveness begins only then.
    assert STARTUP.path == LIVENESS.path and STARTUP.deadline >= 300
    assert STARTUP.period_seconds <= 2
    # Ports of one pod never collide, whatever procsPerPod allows (16 at most).
    assert HEALTH_PORT not in range(DATA_PORT, DATA_PORT + 16)
    assert HEALTH_PORT != STORE_PORT


def test_worker_pods_on_the_nodes_network_have_no_health_port_and_no_probes():
    # one port per node would keep the job's pods from sharing a node; heartbeats still find frozen ranks
    j = job({"network": {"mode": "rdma", "rdma": {"hostNetwork": True}}})
    for role in (TRAINER, INFERENCE):
        c = container(j, role, "rdma")
        assert "health" not in [p["name"] for p in c["ports"]]
        assert "livenessProbe" not in c and "readinessProbe" not in c and "startupProbe" not in c
        assert env(j, role, "rdma")[Env.HEALTH_PORT] == "0"
    assert "livenessProbe" in container(j, CONTROLLER, "rdma")  # the controller never runs on the node's network


def test_scheduling_and_pull_secrets_per_role():
    j = job({"trainer": {"nodeSelector": {"pool": "train"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]},
             "imagePullSecrets": [{"name": "registry"}]})
    t = pod(j, TRAINER, "tcp")["spec"]
    assert t["nodeSelector"] == {"pool": "train"} and t["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    i = pod(j, INFERENCE, "tcp")["spec"]
    assert "nodeSelector" not in i and "tolerations" not in i
    assert t["imagePullSecrets"] == i["imagePullSecrets"] == [{"name": "registry"}]


def test_a_spec_change_rolls_every_role():
    before, after = job(), job({"training": {"steps": 7}})
    for role in (CONTROLLER, TRAINER, INFERENCE):
        assert (pod(before, role, "tcp")["metadata"]["annotations"][render.SPEC_HASH_ANNOTATION]
                != pod(after, role, "tcp")["metadata"]["annotations"][render.SPEC_HASH_ANNOTATION])


@pytest.mark.parametrize("edit", [{"resources": {"requests": {"cpu": "2"}}}, {"nodeSelector": {"pool": "big"}},
                                  {"tolerations": [{"key": "gpu", "operator": "Exists"}]},
                                  {"image": "registry.local/worker:fixed"}])
def test_an_edit_that_only_places_or_sizes_a_roles_pods_replaces_that_roles_pods_alone(edit):
    """As when a Pending job's trainers are given resources a node has: the controller (and the
    rendezvous it hosts) and the inference pods keep their templates."""
    before, after = job({"trainer": {"replicas": 2}}), job({"trainer": {"replicas": 2, **edit}})
    assert pod(before, TRAINER, "tcp") != pod(after, TRAINER, "tcp")
    for role in (CONTROLLER, INFERENCE):
        assert pod(before, role, "tcp") == pod(after, role, "tcp"), role
    pulled = job({"trainer": {"replicas": 2}, "imagePullSecrets": [{"name": "registry"}]})
    assert (pod(pulled, CONTROLLER, "tcp")["metadata"] == pod(before, CONTROLLER, "tcp")["metadata"])


# ------------------------------------------------------------------ network resolution

def node(name, allocatable, unschedulable=False):
    return {"metadata": {"name": name}, "spec": {"unschedulable": unschedulable}, "status": {"allocatable": allocatable}}


def test_auto_takes_rdma_where_a_node_offers_it():
    mode, reason = network.resolve(job().network, [node("gpu-0", {"nvidia.com/gpu": "8"}),
                                                  node("rdma-0", {"rdma/rdma_shared_device_a": "1k"})])
    assert mode == "rdma" and "rdma-0" in reason


def test_auto_takes_tcp_where_no_node_offers_rdma():
    net = job().network
    nodes = [node("gpu-0", {"nvidia.com/gpu": "8"}), node("cordoned", {"rdma/rdma_shared_device_a": "4"}, True),
             node("zero", {"rdma/rdma_shared_device_a": "0"})]
    mode, reason = network.resolve(net, nodes)
    assert mode == "tcp" and "no schedulable node offers 1 rdma/rdma_shared_device_a" in reason
    assert network.resolve(net, [])[0] == "tcp"


def test_explicit_modes_need_no_nodes():
    assert network.resolve(job({"network": {"mode": "rdma"}}).network, []) == ("rdma", "spec.network.mode is rdma")
    assert network.resolve(job({"network": {"mode": "tcp"}}).network, [node("r", {"rdma/rdma_shared_device_a": "1"})])[0] == "tcp"


# ------------------------------------------------------------------ status

LAYOUT = Layout(trainers=2, trainer_procs=1, inferences=1, inference_procs=1)
READY = {"controller": {"ready": 1}, "trainer": {"ready": 2}, "inference": {"ready": 1}}
PODS = {role: LAYOUT.replicas(role) for role in ROLES}  # the pods each role runs
CREATED = status.condition(Condition.CHILDREN_CREATED, True, "Created", "ok")


def test_phase_follows_readiness_and_completion():
    pending = status.compute({}, LAYOUT, {"trainer": {"ready": 1}}, [], [CREATED], at="t0")
    assert pending["phase"] == "Pending"
    assert pending["replicas"]["trainer"] == {"ready": 1, "desired": 2, "summary": "1/2", "restarts": 0, "rejoins": 0}
    ready = {c["type"]: c for c in pending["conditions"]}[Condition.READY]
    assert ready["status"] == "False" and ready["reason"] == "PodsNotReady"

    running = status.compute(pending, LAYOUT, READY, [], at="t1")
    assert running["phase"] == "Running"
    conditions = {c["type"]: c for c in running["conditions"]}
    assert conditions[Condition.READY]["status"] == "True" and conditions[Condition.READY]["lastTransitionTime"] == "t1"
    assert conditions[Condition.CHILDREN_CREATED]["lastTransitionTime"] == "t0"  # unchanged status keeps its time

    # A pod restarting does not send the job back to Pending.
    again = status.compute(running, LAYOUT, {**READY, "trainer": {"ready": 1}}, [], at="t2")
    assert again["phase"] == "Running"

    done = status.compute({**running, "completion": {"state": "Succeeded", "versions": 3}}, LAYOUT, READY, [], at="t3")
    assert done["phase"] == "Succeeded"
    assert all(r["desired"] == 0 for r in done["replicas"].values())
    conditions = {c["type"]: c for c in done["conditions"]}
    completed = conditions[Condition.COMPLETED]
    assert completed["status"] == "True" and "3 weight versions" in completed["message"]
    assert conditions[Condition.READY]["reason"] == "Finished"

    failed = status.compute({**running, "completion": {"state": "Failed", "message": "rank 3 timed out"}}, LAYOUT, READY, [])
    assert failed["phase"] == "Failed"
    assert {c["type"]: c for c in failed["conditions"]}[Condition.FAILED]["message"] == "rank 3 timed out"


def test_a_suspended_job_wants_no_pods_and_says_so_until_it_resumes():
    running = status.compute({}, LAYOUT, READY, [], [CREATED], at="t0")
    held = status.compute({**running, "transfer": {"version": 3}}, LAYOUT, READY, [], suspended=True, at="t1")
    assert held["phase"] == "Suspended"
    assert all(r["desired"] == 0 and r["ready"] == 0 for r in held["replicas"].values())
    conditions = {c["type"]: c for c in held["conditions"]}
    assert (conditions[Condition.SUSPENDED]["status"], conditions[Condition.SUSPENDED]["reason"]) == ("True", "Suspended")
    assert conditions[Condition.READY]["reason"] == "Suspended"
    assert status.events(running, held) == [("Normal", "Suspended", conditions[Condition.SUSPENDED]["message"])]
    resumed = status.compute(held, LAYOUT, {}, [], at="t2")
    assert resumed["phase"] == "Pending"
    conditions = {c["type"]: c for c in resumed["conditions"]}
    assert (conditions[Condition.SUSPENDED]["status"], conditions[Condition.SUSPENDED]["reason"]) == ("False", "Resumed")
    assert conditions[Condition.SUSPENDED]["lastTransitionTime"] == "t2"
    assert render.spec_hash(job()) == render.spec_hash(job({"suspend": True})), "suspending rolls no pod template"


def test_scaled_inference_pods_change_the_statefulset_and_the_status_but_roll_no_pod():
    small, large = (job({"inference": {"replicas": n, "maxReplicas": 3}}) for n in (1, 3))
    sets = [render.statefulset(j, "inference", "tcp", running=True) for j in (small, large)]
    assert [s["spec"]["replicas"] for s in sets] == [1, 3]
    assert sets[0]["spec"]["template"] == sets[1]["spec"]["template"], "scaling rolls no pod template"
    assert render.spec_hash(small) != render.spec_hash(job({"inference": {"replicas": 1}}))  # maxReplicas is read
    layout = small.layout  # the layout holds maxReplicas' ranks: the status wants the pods the job runs
    scaled = status.compute({}, layout, READY, [], at="t0", running={"inference": 1})
    assert scaled["replicas"]["inference"]["desired"] == 1 and scaled["replicas"]["inference"]["summary"] == "1/1"


def test_restarts_and_rejoins_per_role():
    # The index holds (role, restarts) of each job's pods that restarted; pods that did not are not in it.
    assert status.restarts({"containerStatuses": [{"name": "worker", "restartCount": 3}]}) == 3
    assert status.restarts({"phase": "Pending"}) == 0
    indexes = Indexes({}, {}, {}, {("ns", "demo"): [(TRAINER, 2), (INFERENCE, 1), (TRAINER, 3)], ("ns", "other"): [(TRAINER, 9)]})
    restarts = indexes.observed("ns", "demo", PODS)[2]
    assert restarts == {TRAINER: 5, INFERENCE: 1}

    reported = {"phase": "Running", "rejoins": {INFERENCE: 1}}  # the controller pod counts rejoins
    running = status.compute(reported, LAYOUT, READY, [], [CREATED], pod_restarts=restarts)
    assert running["replicas"][TRAINER] == {"ready": 2, "desired": 2, "summary": "2/2", "restarts": 5, "rejoins": 0}
    assert running["replicas"][INFERENCE] == {"ready": 1, "desired": 1, "summary": "1/1", "restarts": 1, "rejoins": 1}
    assert running["replicas"][CONTROLLER]["restarts"] == running["replicas"][CONTROLLER]["rejoins"] == 0
    # A pod deleted and created again starts counting from zero, as kubectl counts.
    again = status.compute({**reported, **running}, LAYOUT, READY, [], pod_restarts={TRAINER: 3})
    assert again["replicas"][TRAINER]["restarts"] == 3
    # A finished job's pods are gone: its status keeps the counts it had.
    done = status.compute({**reported, **running, "completion": {"state": "Succeeded", "versions": 3}}, LAYOUT, {}, [],
                          pod_restarts={})
    assert (done["replicas"][TRAINER]["restarts"], done["replicas"][INFERENCE]["rejoins"]) == (5, 1)


def test_the_failed_condition_takes_the_controllers_reason():
    failed = status.compute({"completion": {"state": "Failed", "reason": "ControllerRestarted",
                                            "message": "the controller restarted at version 3 and cannot resume"}},
                            LAYOUT, READY, [], [CREATED])
    condition = {c["type"]: c for c in failed["conditions"]}[Condition.FAILED]
    assert (failed["phase"], condition["reason"]) == ("Failed", "ControllerRestarted")
    # its Event says why, as kubectl describe and get events show it
    assert status.events({}, failed)[-1] == ("Warning", "Failed", f"ControllerRestarted: {condition['message']}")
    plain = status.compute({"completion": {"state": "Failed", "message": "rank 3 timed out"}}, LAYOUT, READY, [], [CREATED])
    assert {c["type"]: c for c in plain["conditions"]}[Condition.FAILED]["reason"] == "WorkersFailed"


def test_the_status_schema_takes_what_the_controller_reports():
    from weightsync.job.schema import openapi_schema

    status_schema = openapi_schema(VERSION)["properties"]["status"]["properties"]
    assert set(status_schema["rejoins"]["properties"]) == {TRAINER, INFERENCE}
    reason = status_schema["completion"]["properties"]["reason"]
    assert re.match(reason["pattern"], "ControllerRestarted") and not re.match(reason["pattern"], "controller restarted")
    assert {"restarts", "rejoins"} <= set(status_schema["replicas"]["additionalProperties"]["properties"])


def test_refusals_fail_the_job_and_stuck_pods_say_why():
    refused = status.compute({}, LAYOUT, {}, [], [status.condition(Condition.CHILDREN_CREATED, False, "ChildRefused", "bad")])
    assert refused["phase"] == "Failed"
    stuck = status.compute({}, LAYOUT, {}, [("pod demo-trainer-2", "Unschedulable", "0/5 nodes"),
                                            ("pod demo-trainer-1", "Unschedulable", "0/5 nodes")], [CREATED])
    ready = {c["type"]: c for c in stuck["conditions"]}[Condition.READY]
    assert stuck["phase"] == "Pending" and ready["reason"] == "Unschedulable"
    assert ready["message"] == "pod demo-trainer-1: 0/5 nodes (and 1 more)"
    events = status.events({}, stuck)
    assert ("Warning", "Unschedulable", ready["message"]) in events
    # The same problem again is no new Event.
    assert status.events(stuck, status.compute(stuck, LAYOUT, {}, [("pod demo-trainer-1", "Unschedulable", "x")])) == []


def test_pod_problems():
    assert status.pod_problem({"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                               "message": "0/5 nodes are available: 5 Insufficient nvidia.com/gpu."}]}) == (
        "Unschedulable", "0/5 nodes are available: 5 Insufficient nvidia.com/gpu.")
    def waiting(reason):
        return {"containerStatuses": [{"name": "worker", "state": {"waiting": {"reason": reason}}}]}

    assert status.pod_problem(waiting("ImagePullBackOff"))[0] == "ImagePullBackOff"
    assert status.pod_problem(waiting("ContainerCreating")) is None
    assert status.pod_problem({"phase": "Running"}) is None


# ------------------------------------------------------------------ create-or-compare

def test_stored_objects_match_when_every_rendered_field_is_there():
    desired = {"spec": {"replicas": 2, "hostNetwork": False, "volumes": [],
                        "resources": {"limits": {"cpu": "0.5", "memory": "1Gi"}}, "env": [{"name": "A", "value": "1"}]}}
    stored = {"metadata": {"uid": "x"}, "spec": {"replicas": 2, "resources": {"limits": {"cpu": "500m", "memory": "1024Mi"}},
                                                 "env": [{"name": "A", "value": "1"}], "dnsPolicy": "ClusterFirst"}}
    assert matches(desired, stored)
    assert not matches(desired, {**stored, "spec": {**stored["spec"], "replicas": 0}})
    assert not matches(desired, {**stored, "spec": {**stored["spec"],
                                                    "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}})
    assert not matches({"spec": {"replicas": 0}}, {"spec": {}})
    assert not matches({"metadata": {"labels": {"a": "1"}}}, {"metadata": {}})


def test_the_operator_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, weightsync_operator; print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_worker_image_is_the_jobs_own_else_the_default_recorded_at_creation(monkeypatch):
    assert container(job({"image": "registry.local/worker:7"}), TRAINER, "tcp")["image"] == "registry.local/worker:7"
    monkeypatch.setenv(render.DEFAULT_WORKER_IMAGE_ENV, "registry.local/worker:default")
    assert render.default_worker_image() == "registry.local/worker:default"
    # A job renders with the default it was created under, whatever the operator's default is now.
    sts = render.statefulset(job(), INFERENCE, "tcp", image="registry.local/worker:old")
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.local/worker:old"


RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID,
                  "fsGroup": WORKER_UID, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def test_tcp_pods_meet_pod_security_restricted_with_a_read_only_root():
    j = job({"trainer": {"procsPerPod": 2}})
    for role in (CONTROLLER, TRAINER, INFERENCE):
        p, c = pod(j, role, "tcp")["spec"], container(j, role, "tcp")
        assert p["securityContext"] == RESTRICTED_POD and c["securityContext"] == RESTRICTED_CONTAINER
        assert "hostNetwork" not in p
        # The one writable place, and every cache and home pointed into it.
        assert {"name": "tmp", "emptyDir": {}} in p["volumes"]
        assert {"name": "tmp", "mountPath": TMP_MOUNT} in c["volumeMounts"]
        e = env(j, role, "tcp")
        for name, value in WRITABLE_ENV.items():
            assert e[name] == value
            assert name == "PYTHONDONTWRITEBYTECODE" or value.startswith(TMP_MOUNT)
    assert {"HOME", "HF_HOME", "XDG_CACHE_HOME"} <= set(WRITABLE_ENV)


def test_a_running_job_never_has_its_pods_replaced_by_a_template_change():
    j = job()
    for role in (CONTROLLER, TRAINER, INFERENCE):
        assert render.statefulset(j, role, "tcp")["spec"]["updateStrategy"]["type"] == "RollingUpdate"
        assert render.statefulset(j, role, "tcp", running=True)["spec"]["updateStrategy"] == {"type": "OnDelete"}


# ------------------------------------------------------------------ tokens, refusals, pods not created

def test_a_jobs_token_follows_from_the_key_and_the_jobs_uid():
    key = b"k" * 32
    token = tokens.derive(key, "uid-1")
    assert token == tokens.derive(key, "uid-1") and len(token) == 43
    assert token != tokens.derive(key, "uid-2") and token != tokens.derive(b"j" * 32, "uid-1")
    assert tokens.fingerprint(token) != tokens.fingerprint(tokens.derive(key, "uid-2"))
    assert token not in tokens.fingerprint(token)


def test_a_namespace_being_deleted_is_told_apart_from_a_missing_permission():
    terminating = ApiError(403, "Forbidden", "unable to create new content in namespace x because it is being terminated",
                           "POST", [{"reason": "NamespaceTerminating", "field": "metadata.namespace"}])
    assert terminating.namespace_terminating
    assert not ApiError(403, "Forbidden", 'secrets is forbidden: User "x" cannot create', "POST").namespace_terminating


def test_pods_not_created_are_problems_only_while_their_statefulset_lacks_pods():
    event = {"reason": "FailedCreate", "involvedObject": {"kind": "StatefulSet", "name": "my-job-trainer"},
             "message": 'create Pod my-job-trainer-1 in StatefulSet my-job-trainer failed error: '
                        'pods "my-job-trainer-1" is forbidden'}
    assert children.statefulset_of_a_job(event) == ("my-job", TRAINER)
    assert children.statefulset_of_a_job({**event, "involvedObject": {"kind": "StatefulSet", "name": "other"}}) is None
    failed = {("ns", "my-job"): [("my-job-trainer", TRAINER, event["message"])]}
    lacking = Indexes({("ns", "my-job"): [{"role": TRAINER, "ready": 0, "created": 1}]}, {}, failed, {})
    (problem,) = lacking.observed("ns", "my-job", PODS)[1]
    assert problem == ("StatefulSet my-job-trainer", "FailedCreate", event["message"])
    complete = Indexes({("ns", "my-job"): [{"role": TRAINER, "ready": 2, "created": 2}]}, {}, failed, {})
    assert complete.observed("ns", "my-job", PODS)[1] == []


def test_pods_with_a_health_port_say_where_prometheus_scrapes_them():
    expected = {"prometheus.io/scrape": "true", "prometheus.io/port": str(HEALTH_PORT),
                "prometheus.io/path": "/metrics"}
    j = job()
    for role in (CONTROLLER, TRAINER, INFERENCE):
        annotations = pod(j, role, "tcp")["metadata"]["annotations"]
        assert {k: annotations[k] for k in expected} == expected
    # pods on the node's network serve no endpoint (render.on_host_network): nothing to scrape
    rdma = job({"network": {"mode": "rdma", "rdma": {"hostNetwork": True}}})
    assert not any(k.startswith("prometheus.io/") for k in pod(rdma, TRAINER, "rdma")["metadata"]["annotations"])
