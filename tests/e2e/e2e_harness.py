"""The end-to-end tests' tools: the real helm CLI against the session's local control plane,
the chart installed with it, the operator run from the chart's own Deployment pod
(tests/e2e/localpod.py), and reading pods and examples back."""

from __future__ import annotations

import json
import random
import subprocess
import uuid
from pathlib import Path

import yaml
from controlplane import probe, wait_for
from localpod import LocalPod

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "weightsync"


class Helm:
    def __init__(self, cluster, home: Path):
        self.cluster = cluster
        self.env = {**cluster.env, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                    "HELM_DATA_HOME": str(home / "data")}

    def __call__(self, *args: str, check: bool = True, input: str | None = None, timeout: float = 180):
        proc = subprocess.run([str(self.cluster.binaries / "helm"), f"--kubeconfig={self.cluster.kubeconfig}", *args],
                              capture_output=True, text=True, env=self.env, input=input, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc


def new_namespace(cluster, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    return name


class Loopback:
    """Addresses for local pods: one random 127.a.b.0/24 block per test, so that pods of different
    tests (and other programs on this machine) never share an address and port."""

    def __init__(self):
        self.prefix = f"127.{random.randint(100, 254)}.{random.randint(0, 255)}."
        self.next = 2

    def take(self) -> str:
        self.next += 1
        return f"{self.prefix}{self.next - 1}"


def pods(cluster, namespace: str, selector: str) -> list[dict]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
    return json.loads(out)["items"]


def running(pod: dict) -> bool:
    return pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")


def install(helm: Helm, release: str, namespace: str, *values: str) -> None:
    helm("install", release, str(CHART), "--namespace", namespace, "--create-namespace", "--wait", "--timeout", "2m",
         *[a for v in values for a in ("--set", v)])


class Operator:
    """The operator, started from the Deployment pod the chart created: that pod's arguments over
    the operator image's entrypoint, and that pod's ServiceAccount credentials, so only the
    chart's RBAC stands between it and the API."""

    def __init__(self, cluster, helm_namespace: str, release: str, ip: str, workdir: Path):
        selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator"
        (pod,) = wait_for(f"the operator pod of release {release} Running",
                          lambda: [p for p in pods(cluster, helm_namespace, selector) if running(p)], 60)
        self.pod = pod
        self.local = LocalPod(cluster, pod, ip, {}, workdir, "Dockerfile.operator")

    def __enter__(self) -> "Operator":
        self.local.start()
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = 60) -> None:
        """The Deployment's liveness probe, as the kubelet would send it, answers 200."""
        liveness = self.local.container["livenessProbe"]["httpGet"]
        port = liveness["port"]
        if isinstance(port, str):
            (port,) = [p["containerPort"] for p in self.local.container["ports"] if p["name"] == port]
        url = f"http://{self.local.ip}:{port}{liveness['path']}"
        wait_for(f"operator liveness {url}", lambda: probe(url), timeout, failed=self.check)

    def check(self) -> None:
        if not self.local.running():
            raise AssertionError(f"the operator exited ({self.local.proc.returncode}):\n{self.local.tail(60)}")

    def __exit__(self, *exc) -> None:
        self.local.stop()
        if exc[0] is not None:
            print(f"--- operator log:\n{self.local.tail(80)}")
            return
        # The chart's RBAC was enough for everything the operator tried.
        refused = [line for line in self.local.log.read_text().splitlines() if "forbidden" in line.lower()]
        assert not refused, "\n".join(refused)


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / name).read_text())
