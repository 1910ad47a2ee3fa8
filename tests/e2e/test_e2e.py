"""End to end, the way a user runs weightsync: the chart installed with helm, the operator running
from the chart's Deployment pod (with that pod's ServiceAccount, so the chart's RBAC is all it
has), jobs applied with kubectl from examples/, their pods scheduled onto KWOK's fake GPU/RDMA
nodes, and, for the tcp example, every pod's container run for real by tests/e2e/localpod.py so
that the job trains, transfers and reports through the API until the operator ends it."""

from __future__ import annotations

import copy
import json
import uuid

import pytest
import yaml
from e2e_harness import example, install, new_namespace, pods, running
from controlplane import wait_for
from kubernetes.utils import parse_quantity
from localpod import LocalPod, service_hosts

from weightsync import contract

pytestmark = pytest.mark.cluster

RDMA = "rdma/rdma_shared_device_a"
GPU = "nvidia.com/gpu"


def apply(cluster, namespace: str, job: dict) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(job))


def get_job(cluster, namespace: str, name: str) -> dict:
    return json.loads(cluster.kubectl("get", "wtj", name, "-n", namespace, "-o", "json").stdout)


def job_pods(cluster, namespace: str, name: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in pods(cluster, namespace, f"{contract.LABEL_JOB}={name}")}


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}


def events(cluster, namespace: str, name: str) -> list[dict]:
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                          f"involvedObject.kind={contract.KIND},involvedObject.name={name}", "-o", "json").stdout
    return json.loads(out)["items"]


def all_running(cluster, namespace: str, name: str, count: int) -> dict[str, dict] | None:
    """The job's pods once all `count` of them are Running (KWOK marks scheduled pods so)."""
    found = job_pods(cluster, namespace, name)
    return found if len(found) == count and all(running(p) for p in found.values()) else None


def phase_in(cluster, namespace: str, name: str, phases: tuple[str, ...]) -> dict | None:
    job = get_job(cluster, namespace, name)
    return job if job.get("status", {}).get("phase") in phases else None


def printed_columns(cluster, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get wtj NAME` as a user reads it: header -> value."""
    header, row = cluster.kubectl("get", "wtj", name, "-n", namespace).stdout.splitlines()
    starts = [0] + [i for i in range(1, len(header)) if header[i] != " " and header[i - 1] == " " and header[i - 2] == " "]
    bounds = list(zip(starts, starts[1:] + [None]))
    return {header[a:b].strip(): row[a:b].strip() for a, b in bounds}


@pytest.fixture
def chart(cluster, helm):
    """The chart installed cluster-wide, as `make deploy-*` installs it."""
    release, ns = "weightsync", new_namespace(cluster, "weightsync-system")
    install(helm, release, ns)
    yield release, ns
    helm("uninstall", release, "--namespace", ns, "--ignore-not-found", "--wait", check=False)
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


# ---------------------------------------------------------------------------------- tcp, for real


def fast(job: dict) -> dict:
    """The tcp example, kept as it is except where 2 CPU cores need less work to finish quickly."""
    job = copy.deepcopy(job)
    job["spec"].setdefault("training", {}).update(steps=6)
    job["spec"].setdefault("transfer", {}).update(everySteps=3)
    return job


def test_tcp_example_trains_transfers_and_succeeds(cluster, namespace, chart, operator_from_chart, loopback, tmp_path):
    job = fast(example("tcp-job.yaml"))
    name = job["metadata"]["name"]
    spec = contract.load_job(job, namespace).spec
    layout = contract.Layout.from_spec(spec)
    assert spec["network"]["mode"] == "tcp"

    with operator_from_chart(chart[1], chart[0]) as operator:
        apply(cluster, namespace, job)
        # Scheduled and Running under KWOK, every ordinal of the job.
        scheduled = wait_for(f"{layout.pods} pods of {name} Running",
                             lambda: all_running(cluster, namespace, name, layout.pods), 90, failed=operator.check)
        by_ordinal = {int(p["metadata"]["labels"][contract.POD_INDEX_LABEL]): p for p in scheduled.values()}
        assert sorted(by_ordinal) == list(range(layout.pods))
        for ordinal, pod in by_ordinal.items():
            assert pod["metadata"]["labels"][contract.LABEL_ROLE] == layout.role_of(ordinal)
            if ordinal > 0:
                assert env_of(pod)["NCCL_IB_DISABLE"] == "1"
            requests = pod["spec"]["containers"][0].get("resources", {}).get("requests", {})
            assert RDMA not in requests

        # Each pod's container, run locally with exactly what the API server holds for it.
        ips = {p["metadata"]["name"]: loopback.take() for p in scheduled.values()}
        hosts = service_hosts(scheduled, ips)
        local = {n: LocalPod(cluster, p, ips[n], hosts, tmp_path / "pods", "Dockerfile.worker")
                 for n, p in scheduled.items()}
        try:
            for pod in local.values():
                pod.start()

            stopped = set()

            def progress():
                for pod in local.values():
                    if pod.name not in stopped and pod.proc.poll() not in (None, 0):
                        raise AssertionError(f"pod {pod.name} exited with {pod.proc.returncode}:\n{pod.tail(60)}")
                operator.check()
                # The kubelet stops a container when its pod goes away (the operator scales down).
                present = job_pods(cluster, namespace, name)
                for pod_name, pod in local.items():
                    if pod.running() and (pod_name not in present or present[pod_name]["metadata"].get("deletionTimestamp")):
                        stopped.add(pod_name)
                        pod.stop()

            done = wait_for(f"{name} Succeeded", lambda: phase_in(cluster, namespace, name, ("Succeeded", "Failed")),
                            600, interval=1, failed=progress)
            status = done["status"]
            assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
            wait_for(f"pods of {name} gone", lambda: not job_pods(cluster, namespace, name), 60, failed=progress)
        finally:
            codes = {n: p.stop() for n, p in local.items()}
            for n, p in local.items():
                print(f"--- {n} (exit {codes[n]}):\n{p.tail(15)}")

    # The controller's reports arrived through the API with the job's own ServiceAccount (the
    # only credentials its process had: its pod's projected token, no kubeconfig)...
    versions = 1 + spec["training"]["steps"] // spec["transfer"]["everySteps"]
    transfer, completion = status["transfer"], status["completion"]
    assert completion["state"] == "Succeeded" and completion["versions"] == versions
    assert transfer["version"] == versions - 1 and transfer["bytes"] > 0 and transfer["gbps"] > 0
    assert transfer["transport"] == "tcp"
    controller = local[f"{name}-controller-0"]
    reported = [json.loads(line) for line in controller.log.read_text().splitlines() if line.startswith("{")]
    last = [r for r in reported if r.get("event") == "transfer"][-1]
    assert {k: last[k] for k in ("version", "bytes", "gbps")} == {k: transfer[k] for k in ("version", "bytes", "gbps")}
    who = f"system:serviceaccount:{namespace}:{name}-controller"
    allowed = cluster.kubectl("auth", "can-i", f"--as={who}", "patch", f"weighttransferjobs.weightsync.io/{name}",
                              "--subresource=status", "-n", namespace, check=False).stdout.strip()
    other = cluster.kubectl("auth", "can-i", f"--as={who}", "patch", "weighttransferjobs.weightsync.io/another-job",
                            "--subresource=status", "-n", namespace, check=False).stdout.strip()
    assert (allowed, other) == ("yes", "no")

    # ...and the operator ended the job: Succeeded, every StatefulSet scaled to zero.
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Completed"]["status"] == "True"
    assert status["network"]["mode"] == "tcp"
    for role in contract.ROLES:
        sts = json.loads(cluster.kubectl("get", "statefulset", f"{name}-{role}", "-n", namespace, "-o", "json").stdout)
        assert sts["spec"]["replicas"] == 0, role

    shown = printed_columns(cluster, namespace, name)
    print(cluster.kubectl("get", "wtj", name, "-n", namespace).stdout)
    assert shown["PHASE"] == "Succeeded" and shown["NETWORK"] == "tcp"
    assert float(shown["GB/S"]) == pytest.approx(transfer["gbps"])


# ---------------------------------------------------------------------------------- rdma placement


@pytest.fixture
def more_rdma_nodes(cluster):
    """Room for the rdma example as written: four RDMA nodes of 8 GPUs in all."""
    added = [f"gpu-rdma-extra-{i}" for i in range(2)]
    for node in added:
        cluster.add_node(node, gpus=8, rdma=1000)
    yield
    for node in added:
        cluster.delete_node(node)


def test_rdma_example_lands_on_rdma_nodes_with_its_settings(cluster, namespace, chart, operator_from_chart,
                                                            more_rdma_nodes):
    job = example("rdma-job.yaml")
    name, spec = job["metadata"]["name"], contract.load_job(job, namespace).spec
    layout = contract.Layout.from_spec(spec)
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    rdma_nodes = {n["metadata"]["name"] for n in nodes if RDMA in n["status"]["allocatable"]}

    with operator_from_chart(chart[1], chart[0]) as operator:
        apply(cluster, namespace, job)
        scheduled = wait_for(f"{layout.pods} pods of {name} Running",
                             lambda: all_running(cluster, namespace, name, layout.pods), 90, failed=operator.check)
        status = wait_for(f"{name} Running", lambda: phase_in(cluster, namespace, name, ("Running",)), 60,
                          failed=operator.check)["status"]

    assert status["network"]["mode"] == "rdma"
    rdma = spec["network"]["rdma"]
    for pod_name, pod in scheduled.items():
        container = pod["spec"]["containers"][0]
        requests = container.get("resources", {}).get("requests", {})
        env = env_of(pod)
        if pod["metadata"]["labels"][contract.LABEL_ROLE] == contract.CONTROLLER:
            assert GPU not in requests and RDMA not in requests, pod_name
            continue
        assert pod["spec"]["nodeName"] in rdma_nodes, (pod_name, pod["spec"]["nodeName"])
        gpus = str(spec["trainer"]["procsPerPod"] * spec["trainer"]["gpusPerProc"])
        assert requests[RDMA] == str(rdma["resourceCount"]) and requests[GPU] == gpus
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        assert container["securityContext"]["runAsUser"] == 0  # IPC_LOCK lifts the memlock limit only for root
        assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/dev/shm"}
        assert env["NCCL_IB_DISABLE"] == "0"
        assert env["NCCL_IB_HCA"] == env["UCCL_P2P_IB_HCA"] == ",".join(rdma["hcas"])
        assert env["NCCL_IB_GID_INDEX"] == env["UCCL_P2P_IB_GID_INDEX"] == str(rdma["gidIndex"])
        assert env["NCCL_IB_TC"] == env["UCCL_P2P_IB_TC"] == str(rdma["trafficClass"])
        assert env["NCCL_IB_SL"] == env["UCCL_P2P_IB_SL"] == str(rdma["serviceLevel"])
        assert env["NCCL_NET_GDR_LEVEL"] == rdma["gdrLevel"]
    print(f"{name}: placed on {sorted({p['spec']['nodeName'] for p in scheduled.values()})}; its workers need GPUs "
          "and RDMA NICs, which this machine does not have, so they are not started here")


# ---------------------------------------------------------------------------------- auto fallback


@pytest.fixture
def no_rdma_nodes(cluster):
    """The cluster without its RDMA nodes, put back afterwards."""
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    removed = [(n["metadata"]["name"], n["status"]["allocatable"]) for n in nodes if RDMA in n["status"]["allocatable"]]
    for node, _ in removed:
        cluster.delete_node(node)
    yield
    for node, allocatable in removed:
        cluster.add_node(node, gpus=int(parse_quantity(allocatable.get(GPU, 0))), rdma=int(parse_quantity(allocatable[RDMA])))


def test_auto_on_a_cluster_without_rdma_falls_back_to_tcp_with_an_event(cluster, namespace, chart, operator_from_chart,
                                                                        no_rdma_nodes):
    job = example("rdma-job.yaml")
    job["metadata"]["name"] = "auto-example"
    job["spec"]["network"]["mode"] = "auto"
    name = job["metadata"]["name"]
    with operator_from_chart(chart[1], chart[0]) as operator:
        apply(cluster, namespace, job)
        network = wait_for(f"{name} network resolved", lambda: get_job(cluster, namespace, name).get("status", {}).get("network"),
                           60, failed=operator.check)
        seen = wait_for(f"an Event about {name}'s network", lambda: [
            e for e in events(cluster, namespace, name) if "tcp" in e["message"] and RDMA in e["message"]], 30,
            failed=operator.check)
        created = wait_for(f"pods of {name}", lambda: job_pods(cluster, namespace, name) or None, 60, failed=operator.check)
    assert network["mode"] == "tcp" and RDMA in network["reason"], network
    assert seen[0]["type"] == "Normal"
    for pod in created.values():
        if pod["metadata"]["labels"][contract.LABEL_ROLE] != contract.CONTROLLER:
            assert env_of(pod)["NCCL_IB_DISABLE"] == "1"
        assert RDMA not in pod["spec"]["containers"][0].get("resources", {}).get("requests", {})


# ---------------------------------------------------------------------------------- one namespace


def test_a_namespaced_install_runs_jobs_in_its_namespace_only(cluster, helm, operator_from_chart):
    release, ops = f"ws-{uuid.uuid4().hex[:6]}", new_namespace(cluster, "ops")
    watched, other = new_namespace(cluster, "team"), new_namespace(cluster, "other")
    job = example("rdma-job.yaml")
    job["metadata"]["name"] = "scoped"
    job["spec"]["network"]["mode"] = "tcp"
    try:
        install(helm, release, ops, f"watchNamespaces={{{watched}}}")
        with operator_from_chart(ops, release) as operator:
            apply(cluster, other, job)
            apply(cluster, watched, job)
            wait_for(f"{job['metadata']['name']} in {watched} has its pods", lambda: len(job_pods(cluster, watched, "scoped"))
                     == contract.Layout.from_spec(contract.load_job(job).spec).pods, 60, failed=operator.check)
            wait_for("scoped has ChildrenCreated", lambda: any(
                c["type"] == "ChildrenCreated" and c["status"] == "True"
                for c in get_job(cluster, watched, "scoped").get("status", {}).get("conditions", [])), 30,
                failed=operator.check)
            # The job outside the watched namespace was handled by nobody.
            assert "status" not in get_job(cluster, other, "scoped")
            assert not job_pods(cluster, other, "scoped")
    finally:
        helm("uninstall", release, "--namespace", ops, "--ignore-not-found", "--wait", check=False)
        for ns in (ops, watched, other):
            cluster.kubectl("delete", "namespace", ns, "--wait=false")
