"""The Helm chart against the real API server: lint, every rendered object accepted by a
server-side dry run, least-privilege RBAC for both kinds of install, and a clean uninstall."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
import yaml
from e2e_harness import CHART, ROOT, install, new_namespace

from weightsync_operator.render import DEFAULT_WORKER_IMAGE_ENV, FALLBACK_WORKER_IMAGE

pytestmark = pytest.mark.cluster

CLUSTER_SCOPED = ("clusterroles", "clusterrolebindings")
NAMESPACED = ("deployments", "serviceaccounts", "roles", "rolebindings", "secrets", "configmaps", "services")


def server_version(cluster) -> str:
    return json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]


@pytest.mark.parametrize("values", [[], ["watchNamespaces={a,b}", "logLevel=debug"]], ids=["cluster-wide", "namespaced"])
def test_helm_lint_is_clean(helm, values):
    proc = helm("lint", "--strict", str(CHART), *[a for v in values for a in ("--set", v)])
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout, proc.stdout


def test_a_bad_log_level_is_refused_with_what_to_fix(helm, cluster):
    proc = helm("template", "x", str(CHART), "--kube-version", server_version(cluster), "--set", "logLevel=verbose",
                check=False)
    assert proc.returncode != 0 and 'logLevel must be debug, info or warning, not "verbose"' in proc.stderr


@pytest.mark.parametrize("namespaced", [False, True], ids=["cluster-wide", "namespaced"])
def test_the_rendered_chart_passes_a_server_side_dry_run(helm, cluster, namespaced):
    release_ns = new_namespace(cluster, "ops")
    watched = [new_namespace(cluster, "jobs"), new_namespace(cluster, "jobs")] if namespaced else []
    try:
        args = ["--set", f"watchNamespaces={{{','.join(watched)}}}"] if watched else []
        rendered = helm("template", "ws", str(CHART), "--namespace", release_ns, "--include-crds",
                        "--kube-version", server_version(cluster), *args).stdout
        objects = [o for o in yaml.safe_load_all(rendered) if o]
        kinds = sorted(o["kind"] for o in objects)
        roles = ["Role", "RoleBinding"] * len(watched)
        assert kinds == sorted(["CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                "Deployment", *roles])
        proc = cluster.kubectl("apply", "--dry-run=server", "-f", "-", "-o", "name", input=rendered)
        assert len(proc.stdout.split()) == len(objects), proc.stdout

        (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        expected = [f"--namespace={n}" for n in watched] or ["--all-namespaces"]
        assert container["args"] == expected
        # The default worker image reaches the operator under the name it reads.
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[DEFAULT_WORKER_IMAGE_ENV] == FALLBACK_WORKER_IMAGE
    finally:
        for ns in [release_ns, *watched]:
            cluster.kubectl("delete", "namespace", ns, "--wait=false")


def can(cluster, who: str, *request: str) -> bool:
    proc = cluster.kubectl("auth", "can-i", f"--as={who}", *request, check=False)
    assert proc.stdout.strip() in ("yes", "no"), proc.stdout + proc.stderr
    return proc.stdout.strip() == "yes"


def leftovers(cluster, release: str, namespaces: list[str]) -> list[str]:
    selector = f"app.kubernetes.io/instance={release}"
    found = cluster.kubectl("get", ",".join(CLUSTER_SCOPED), "-l", selector, "-o", "name").stdout.split()
    for ns in namespaces:
        found += cluster.kubectl("get", ",".join(NAMESPACED), "-n", ns, "-l", selector, "-o", "name").stdout.split()
        # helm's own record of the release
        found += cluster.kubectl("get", "secrets", "-n", ns, "-l", f"owner=helm,name={release}", "-o", "name").stdout.split()
    return found


@pytest.mark.parametrize("namespaced", [False, True], ids=["cluster-wide", "namespaced"])
def test_rbac_is_least_privilege_and_uninstall_leaves_nothing(helm, cluster, namespaced):
    release = f"ws-{uuid.uuid4().hex[:6]}"
    release_ns = new_namespace(cluster, "ops")
    watched, other = new_namespace(cluster, "jobs"), new_namespace(cluster, "other")
    try:
        install(helm, release, release_ns, *([f"watchNamespaces={{{watched}}}"] if namespaced else []))
        sa = f"system:serviceaccount:{release_ns}:{release}-weightsync"
        for ns in (watched, other):
            allowed = ns == watched or not namespaced
            # what the operator does
            for request in (("watch", "weighttransferjobs.weightsync.io"), ("patch", "weighttransferjobs.weightsync.io"),
                            ("patch", "weighttransferjobs.weightsync.io", "--subresource=status"),
                            ("create", "statefulsets.apps"), ("patch", "statefulsets.apps"),
                            ("list", "pods"), ("create", "secrets"), ("get", "secrets"), ("create", "roles.rbac.authorization.k8s.io"),
                            ("create", "rolebindings.rbac.authorization.k8s.io"), ("create", "events")):
                assert can(cluster, sa, *request, "-n", ns) == allowed, (request, ns)
            # and what it never does
            for request in (("delete", "secrets"), ("list", "secrets"), ("delete", "weighttransferjobs.weightsync.io"),
                            ("create", "weighttransferjobs.weightsync.io"), ("create", "pods"), ("delete", "statefulsets.apps"),
                            ("create", "deployments.apps"), ("escalate", "roles.rbac.authorization.k8s.io"),
                            ("bind", "roles.rbac.authorization.k8s.io"), ("*", "*")):
                assert not can(cluster, sa, *request, "-n", ns), (request, ns)
        assert can(cluster, sa, "list", "nodes")
        assert not can(cluster, sa, "patch", "nodes")
        assert not can(cluster, sa, "create", "customresourcedefinitions.apiextensions.k8s.io")
        assert not can(cluster, sa, "create", "clusterroles.rbac.authorization.k8s.io")

        helm("uninstall", release, "--namespace", release_ns, "--wait")
        assert leftovers(cluster, release, [release_ns, watched, other]) == []
        # helm keeps a chart's CRDs (removing one would delete every job): that is the one thing left.
        cluster.kubectl("get", "crd", "weighttransferjobs.weightsync.io")
    finally:
        helm("uninstall", release, "--namespace", release_ns, "--ignore-not-found", check=False)
        for ns in (release_ns, watched, other):
            cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_make_deploy_tcp_then_undeploy(cluster):
    """The Makefile targets a user runs, against the current kube context ($KUBECONFIG)."""
    release, ns = f"ws-{uuid.uuid4().hex[:6]}", f"weightsync-{uuid.uuid4().hex[:6]}"
    env = {**cluster.env, "PATH": f"{cluster.binaries}:{os.environ['PATH']}"}
    make = ["make", "--no-print-directory", f"RELEASE={release}", f"NAMESPACE={ns}"]
    job = yaml.safe_load((ROOT / "examples" / "tcp-job.yaml").read_text())["metadata"]["name"]
    try:
        proc = subprocess.run([*make, "deploy-tcp"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        status = json.loads(subprocess.run(["helm", "status", release, "-n", ns, "-o", "json"], env=env,
                                           capture_output=True, text=True, check=True).stdout)
        assert status["info"]["status"] == "deployed"
        assert "kubectl apply -f examples/tcp-job.yaml" in status["info"]["notes"]
        cluster.kubectl("get", "wtj", job, "-n", "default")
        # Again: an upgrade, and the job unchanged.
        proc = subprocess.run([*make, "deploy-tcp"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "unchanged" in proc.stdout, proc.stdout + proc.stderr

        proc = subprocess.run([*make, "undeploy"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert cluster.kubectl("get", "wtj", job, "-n", "default", "--ignore-not-found", "-o", "name").stdout == ""
        assert leftovers(cluster, release, [ns]) == []
    finally:
        subprocess.run([*make, "undeploy"], cwd=ROOT, env=env, capture_output=True, timeout=300)
        cluster.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=false")
