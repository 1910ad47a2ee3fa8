"""Kueue's controller, built from its Go module (hack/cluster/build-binaries.sh), run as a process
against the local cluster with its own CRDs, for the tests of jobs that Kueue admits.

Kueue's webhooks are not registered with the API server (it runs outside the cluster, where no
Service reaches it): its objects are written valid and complete by the tests. Kueue reads the
certificate of its metrics endpoint from a fixed path, /etc/kueue/metrics/certs, when it does not
manage certificates itself (which needs its webhooks installed): the process sees its own /etc,
an overlay over the machine's in a mount namespace of its own, so nothing is written to the
machine's /etc."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import yaml
from controlplane import die_with_parent, free_ports, probe, stop_group, wait_for

CONFIG = {
    "apiVersion": "config.kueue.x-k8s.io/v1beta2",
    "kind": "Configuration",
    "namespace": "kueue-system",
    "metrics": {"bindAddress": "0"},
    "leaderElection": {"leaderElect": False},
    "internalCertManagement": {"enable": False},
    # The integrations Kueue runs itself: none the tests need; the jobs' operator is an external one.
    "integrations": {"frameworks": ["batch/job"], "externalFrameworks": ["WeightTransferJob.v1alpha1.weightsync.io"]},
}
METRICS_CERTS = "kueue/metrics/certs"  # under /etc


def unavailable() -> str | None:
    """Why Kueue cannot run here (it needs root for its mount namespace and overlay), else None."""
    if shutil.which("unshare") is None or shutil.which("openssl") is None:
        return "Kueue's harness needs unshare and openssl"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"Kueue's harness needs a mount namespace of its own (unshare --mount): {probe.stderr.strip()}"
    return None


class Kueue:
    def __init__(self, cluster, directory: Path):
        self.cluster = cluster
        self.dir = directory
        self.binary = Path(cluster.binaries) / "kueue"
        self.crds = self.binary.resolve().parent / "kueue-crds"
        self.proc: subprocess.Popen | None = None
        self.health, self.webhook = free_ports(2)

    def install_crds(self) -> None:
        for crd in sorted(self.crds.glob("*.yaml")):
            self.cluster.kubectl("apply", "--server-side", "-f", str(crd))
        self.cluster.wait_served(*(f"{k}.kueue.x-k8s.io" for k in (
            "workloads", "clusterqueues", "localqueues", "resourceflavors", "workloadpriorityclasses")))

    def start(self, timeout: float = 90) -> "Kueue":
        certs = self.dir / "certs"
        upper, work = self.dir / "etc-upper", self.dir / "etc-work"
        for d in (certs, upper / METRICS_CERTS, work):
            d.mkdir(parents=True, exist_ok=True)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kueue",
                        "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(certs / "tls.key"),
                        "-out", str(certs / "tls.crt")], check=True, capture_output=True)
        for name in ("tls.key", "tls.crt"):
            shutil.copy(certs / name, upper / METRICS_CERTS / name)
        config = {**CONFIG, "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health}"},
                  "webhook": {"host": "127.0.0.1", "port": self.webhook, "certDir": str(certs)}}
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config))
        self.cluster.kubectl("create", "namespace", "kueue-system", check=False)
        command = (f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper},workdir={work} /etc && "
                   f"exec {self.binary} --config={self.dir / 'config.yaml'} --kubeconfig={self.cluster.kubeconfig} "
                   f"--feature-gates=VisibilityOnDemand=false")
        with open(self.dir / "kueue.log", "w") as log:
            self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=die_with_parent)
        wait_for("Kueue's readiness endpoint", self.ready, timeout)
        return self

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"Kueue exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
        return probe(f"http://127.0.0.1:{self.health}/readyz")

    def log(self) -> str:
        path = self.dir / "kueue.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, 20)


@contextlib.contextmanager
def running(cluster, directory: Path):
    """Kueue's CRDs installed and its controller running for a test module (skipped, saying why,
    where it cannot run); stopped at the end."""
    import pytest

    why = unavailable()
    if why:
        pytest.skip(why)
    kueue = Kueue(cluster, directory)
    kueue.install_crds()
    kueue.start()
    try:
        yield kueue
    finally:
        kueue.stop()
        print(f"kueue log: {kueue.dir / 'kueue.log'}")
