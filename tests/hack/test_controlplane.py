"""The local control plane itself: real API server version, KWOK nodes with GPU/RDMA capacity,
scheduling onto them, StatefulSet start ordinals, service-account tokens and RBAC, clean stop."""
import json
import socket
import subprocess
import sys
import urllib.error
import uuid
from pathlib import Path

import pytest
from controlplane import DEFAULT_NODES, GPU_RESOURCE, RDMA_RESOURCE, ControlPlane
from kubernetes import client
from kubernetes.utils import parse_quantity

pytestmark = pytest.mark.cluster


@pytest.fixture
def namespace(cluster):
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.create_namespace(name)
    yield name
    cluster.delete_namespaces(name)


def test_api_server_reports_its_release(cluster):
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.34.4"
    assert (version["serverVersion"]["major"], version["serverVersion"]["minor"]) == ("1", "34")


def test_fake_nodes_are_ready_with_their_devices(cluster):
    core = client.CoreV1Api(cluster.api())
    nodes = {n.metadata.name: n for n in core.list_node().items}
    for name, gpus, rdma in DEFAULT_NODES:
        node = nodes[name]
        ready = [c.status for c in node.status.conditions if c.type == "Ready"]
        assert ready == ["True"], name
        assert parse_quantity(node.status.allocatable.get(GPU_RESOURCE, "0")) == gpus, name
        assert parse_quantity(node.status.allocatable.get(RDMA_RESOURCE, "0")) == rdma, name

    cluster.add_node("gpu-extra", gpus=4, labels={"pool": "extra"})
    try:
        node = core.read_node("gpu-extra")
        assert node.status.allocatable[GPU_RESOURCE] == "4"
        assert RDMA_RESOURCE not in node.status.allocatable
        assert node.metadata.labels["pool"] == "extra"
    finally:
        cluster.delete_node("gpu-extra")
    assert "gpu-extra" not in {n.metadata.name for n in core.list_node().items}


def test_gpu_rdma_statefulset_runs_on_rdma_nodes_from_its_start_ordinal(cluster, namespace):
    apps, core = client.AppsV1Api(cluster.api()), client.CoreV1Api(cluster.api())
    devices = {GPU_RESOURCE: "1", RDMA_RESOURCE: "1"}
    apps.create_namespaced_stateful_set(namespace, {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "trainer"},
        "spec": {
            "serviceName": "trainer", "replicas": 2, "ordinals": {"start": 1},
            "selector": {"matchLabels": {"app": "trainer"}},
            "template": {
                "metadata": {"labels": {"app": "trainer"}},
                "spec": {"containers": [{
                    "name": "worker", "image": "registry.invalid/worker:1",
                    "resources": {"requests": devices, "limits": devices},
                }]},
            },
        },
    })

    def pods_ready():
        pods = core.list_namespaced_pod(namespace, label_selector="app=trainer").items
        return len(pods) == 2 and all(
            p.status.phase == "Running" and p.status.pod_ip
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            for p in pods
        )

    cluster.wait("trainer pods Running and Ready", pods_ready, timeout=60)
    pods = sorted(core.list_namespaced_pod(namespace, label_selector="app=trainer").items,
                  key=lambda p: p.metadata.name)
    assert [p.metadata.name for p in pods] == ["trainer-1", "trainer-2"]
    assert [p.metadata.labels["apps.kubernetes.io/pod-index"] for p in pods] == ["1", "2"]
    rdma_nodes = {name for name, _, rdma in DEFAULT_NODES if rdma}
    assert {p.spec.node_name for p in pods} <= rdma_nodes
    cluster.wait("StatefulSet status ready 2/2",
                 lambda: apps.read_namespaced_stateful_set(namespace=namespace, name="trainer").status.ready_replicas == 2,
                 timeout=60)


def test_service_account_token_authenticates_and_rbac_limits_it(cluster, namespace):
    core, rbac = client.CoreV1Api(cluster.api()), client.RbacAuthorizationV1Api(cluster.api())
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "job"}})
    rbac.create_namespaced_role(namespace, {
        "metadata": {"name": "read-pods"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
    })
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "job-reads-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "job", "namespace": namespace}],
    })
    token = core.create_namespaced_service_account_token(
        "job", namespace, {"spec": {"expirationSeconds": 600}}).status.token

    review = cluster.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                             {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}, token=token)
    assert review["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:job"

    # RBAC takes a moment to see a new binding; the allowed call is polled, the refusals are not.
    cluster.wait("the role binding to take effect",
                 lambda: cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods", token=token)["kind"] == "PodList",
                 timeout=30)
    for path in (f"/api/v1/namespaces/{namespace}/secrets", "/api/v1/namespaces/default/pods", "/api/v1/nodes"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            cluster.request("GET", path, token=token)
        assert refused.value.code == 403, path
    with pytest.raises(urllib.error.HTTPError) as refused:
        cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods", token=token[:-4] + "AAAA")
    assert refused.value.code == 401


def test_cli_up_and_down_leave_nothing_running(tmp_path):
    script = Path(__file__).resolve().parents[2] / "hack" / "cluster" / "controlplane.py"
    up = subprocess.run([sys.executable, str(script), "up", "--dir", str(tmp_path)],
                        capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stderr
    assert "control plane ready in" in up.stdout
    cp = ControlPlane(tmp_path)
    pids = {name: int((tmp_path / f"{name}.pid").read_text()) for name in
            ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")}
    assert sorted(cp.running()) == sorted(pids)
    nodes = cp.kubectl("get", "nodes", "-o", "name").stdout.split()
    assert sorted(nodes) == sorted(f"node/{name}" for name, _, _ in DEFAULT_NODES)
    api_port = int(cp.server.rsplit(":", 1)[1])

    down = subprocess.run([sys.executable, str(script), "down", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert cp.running() == []
    for name, pid in pids.items():
        assert not _alive(pid), f"{name} ({pid}) still running"
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_mentions(p, tmp_path)]
    assert leftovers == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", api_port), timeout=5).close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline_mentions(proc: Path, path: Path) -> bool:
    try:
        return str(path).encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False
