"""The Helm chart against the real API server: lint, every rendered object accepted by a
server-side dry run, and the Makefile's deploy and undeploy (the operator's RBAC and a clean
uninstall: test_rbac.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml
from e2e_harness import CHART, ROOT, install, leftovers, new_namespace

from weightsync.job import LABEL_JOB
from weightsync_operator.render import DEFAULT_WORKER_IMAGE_ENV, FALLBACK_WORKER_IMAGE

pytestmark = pytest.mark.cluster

def server_version(cluster) -> str:
    return json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]


@pytest.mark.parametrize("values", [[], ["watchNamespaces={a,b}", "logLevel=debug"], ["metrics.podMonitor.enabled=true"]],
                         ids=["default", "two-namespaces", "pod-monitors"])
def test_helm_lint_is_clean(helm, values):
    proc = helm("lint", "--strict", str(CHART), *[a for v in values for a in ("--set", v)])
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout, proc.stdout


def test_a_bad_log_level_is_refused_with_what_to_fix(helm, cluster):
    proc = helm("template", "x", str(CHART), "--kube-version", server_version(cluster), "--set", "logLevel=verbose",
                check=False)
    assert proc.returncode != 0 and 'logLevel must be debug, info or warning, not "verbose"' in proc.stderr


def test_an_install_without_watched_namespaces_is_refused_with_what_to_fix(helm, cluster):
    proc = helm("template", "x", str(CHART), "--kube-version", server_version(cluster), "--set", "watchNamespaces=null",
                check=False)
    assert proc.returncode != 0 and "watchNamespaces must list the namespaces" in proc.stderr


def test_a_cluster_without_admission_policies_is_refused_unless_the_user_opts_out(helm):
    """Kubernetes 1.27-1.29 serve no ValidatingAdmissionPolicy v1: the chart refuses to install
    there, saying what to do, and installs without the policies only when told to, saying so."""
    proc = helm("template", "x", str(CHART), "--kube-version", "1.29.4", check=False)
    assert proc.returncode != 0 and "serves no ValidatingAdmissionPolicy" in proc.stderr, proc.stderr
    assert "set admissionPolicy.create=false" in proc.stderr
    # The cluster's own answer (what helm install asks) counts over the version.
    served = helm("template", "x", str(CHART), "--kube-version", "1.29.4", "--api-versions",
                  "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy").stdout
    assert "kind: ValidatingAdmissionPolicyBinding" in served
    proc = helm("template", "x", str(CHART), "--kube-version", "1.29.4", "--set", "admissionPolicy.create=false")
    assert "ValidatingAdmissionPolicy" not in proc.stdout
    # What the install then says (helm prints the NOTES; a server-side dry run renders them).
    notes = " ".join(helm("install", "x", str(CHART), "--dry-run=server", "--namespace", "default",
                          "--set", "admissionPolicy.create=false").stdout.split())
    assert "NOT ENFORCED (admissionPolicy.create=false)" in notes and "the host network" in notes, notes


def test_the_rendered_chart_passes_a_server_side_dry_run(helm, cluster):
    release_ns = new_namespace(cluster, "ops")
    watched = [new_namespace(cluster, "jobs"), new_namespace(cluster, "jobs")]
    try:
        rendered = helm("template", "ws", str(CHART), "--namespace", release_ns, "--include-crds",
                        "--kube-version", server_version(cluster), "--api-versions",
                        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
                        "--set", f"watchNamespaces={{{','.join(watched)}}}").stdout
        objects = [o for o in yaml.safe_load_all(rendered) if o]
        kinds = sorted(o["kind"] for o in objects)
        assert kinds == sorted(["CustomResourceDefinition", "ServiceAccount", "Secret", "Deployment",
                                "ClusterRole", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                                "RoleBinding", "RoleBinding", *["ValidatingAdmissionPolicy",
                                                                 "ValidatingAdmissionPolicyBinding"] * 4])
        # Rights in the watched namespaces only: one RoleBinding of the jobs' ClusterRole in each.
        bindings = [o for o in objects if o["kind"] == "RoleBinding" and o["roleRef"]["kind"] == "ClusterRole"]
        assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(watched)
        (binding,) = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
        (cluster_wide,) = [o for o in objects
                           if o["kind"] == "ClusterRole" and o["metadata"]["name"] == binding["roleRef"]["name"]]
        assert ({r for rule in cluster_wide["rules"] for r in rule["resources"]}
                == {"nodes", "customresourcedefinitions", "namespaces",
                    "resourceflavors", "workloadpriorityclasses"})  # Kueue's: where a queued job runs, and its priority
        assert {v for rule in cluster_wide["rules"] for v in rule["verbs"]} <= {"get", "list", "watch"}
        proc = cluster.kubectl("apply", "--dry-run=server", "-f", "-", "-o", "name", input=rendered)
        assert len(proc.stdout.split()) == len(objects), proc.stdout

        (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["args"] == [f"--namespace={n}" for n in watched]
        # The default worker image reaches the operator under the name it reads.
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[DEFAULT_WORKER_IMAGE_ENV] == FALLBACK_WORKER_IMAGE
    finally:
        cluster.delete_namespaces(release_ns, *watched)


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
        assert "kubectl apply -n default -f examples/tcp-job.yaml" in status["info"]["notes"]
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
        cluster.delete_namespaces(ns)


def test_pod_monitors_scrape_the_operator_and_the_jobs_worker_pods(helm, cluster):
    """Off by default; on, one PodMonitor for the operator's metrics port and one for the worker
    pods of the watched namespaces on their health port, both at /metrics."""
    args = ["template", "ws", str(CHART), "--kube-version", server_version(cluster), "--set", "watchNamespaces={a,b}"]
    assert not [o for o in yaml.safe_load_all(helm(*args).stdout) if o and o["kind"] == "PodMonitor"]
    objects = [o for o in yaml.safe_load_all(helm(*args, "--set", "metrics.podMonitor.enabled=true").stdout) if o]
    monitors = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "PodMonitor"}
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    assert monitors["ws-weightsync-operator"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitors["ws-weightsync-operator"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in pod["spec"]["containers"][0]["ports"]
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "8081",
                                              "prometheus.io/path": "/metrics"}
    jobs = monitors["ws-weightsync-jobs"]
    assert jobs["namespaceSelector"] == {"matchNames": ["a", "b"]}
    assert jobs["podMetricsEndpoints"][0]["port"] == "health" and jobs["podMetricsEndpoints"][0]["path"] == "/metrics"
    # the labels every worker pod carries (job.labels), the operator's pod none of them
    assert jobs["selector"] == {"matchLabels": {"app.kubernetes.io/name": "weightsync"},
                                "matchExpressions": [{"key": LABEL_JOB, "operator": "Exists"}]}


def test_make_dist_builds_a_release_whose_packages_install_and_run(helm, cluster, tmp_path):
    """`make dist`'s packages (`make dist-packages`; its images are the ones the real-pod tests
    build and run): the wheel, the sdist and the chart package, each with the one version number;
    the wheel installed into a fresh virtual environment, its dependencies resolved from its own
    metadata, runs `weightsync --version` and `weightsync plan` from there, and the chart package
    installs into the cluster."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    dist = tmp_path / "dist"
    proc = subprocess.run(["make", "--no-print-directory", "dist-packages", f"DIST={dist}",
                           f"HELM={cluster.binaries / 'helm'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = dist.glob(f"weightsync-{version}-*.whl")
    assert (dist / f"weightsync-{version}.tar.gz").is_file() and (dist / f"weightsync-{version}.tgz").is_file()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python, command = venv / "bin" / "python", venv / "bin" / "weightsync"
    got = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
                         capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout + got.stderr
    out = subprocess.run([str(command), "--version"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"weightsync {version}", out.stdout + out.stderr
    # `plan` builds the model: the worker extra's torch and transformers (GBs), taken from this
    # environment by a path line after the venv's own packages (which hold weightsync itself)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = subprocess.run([sys.executable, "-c", "import torch, pathlib; print(pathlib.Path(torch.__file__).parents[1])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "worker-extra.pth").write_text(ours + "\n")
    where = subprocess.run([str(python), "-c", "import weightsync; print(weightsync.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(site), where  # the installed wheel, not this checkout
    plan = subprocess.run([str(command), "plan", str(ROOT / "examples" / "tcp-job.yaml")], capture_output=True,
                          text=True, timeout=300)
    assert plan.returncode == 0 and "balance" in plan.stdout, plan.stdout + plan.stderr
    assert b"Apache License" in zipfile.ZipFile(wheel).read(f"weightsync-{version}.dist-info/licenses/LICENSE")

    release, ns, watched = f"ws-{uuid.uuid4().hex[:6]}", new_namespace(cluster, "dist"), new_namespace(cluster, "jobs")
    try:
        install(helm, release, ns, f"watchNamespaces={{{watched}}}", chart=dist / f"weightsync-{version}.tgz")
        status = json.loads(helm("status", release, "-n", ns, "-o", "json").stdout)
        (listed,) = json.loads(helm("list", "-n", ns, "-o", "json").stdout)
        assert status["info"]["status"] == "deployed"
        assert (listed["chart"], listed["app_version"]) == (f"weightsync-{version}", version)
        assert f"kubectl apply -n {watched} -f examples/tcp-job.yaml" in status["info"]["notes"]
        assert f"runs ghcr.io/weightsync/worker:{version}" in status["info"]["notes"]
    finally:
        helm("uninstall", release, "--namespace", ns, "--ignore-not-found", check=False)
        cluster.delete_namespaces(ns, watched)
