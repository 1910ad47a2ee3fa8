"""Running the operator as users run it (`kopf run` in its own process) and reading a job and
its children back from the API server: shared by the operator tests and the benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from controlplane import die_with_parent, free_ports, probe, stop_group, wait_for

from weightsync.job import API_VERSION, KIND, LABEL_JOB, PLURAL
from weightsync_operator.metrics import METRICS_PORT_ENV

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "weightsync.io_weighttransferjobs.yaml"


class Operator:
    """One `kopf run` process; restartable. Its log accumulates in one file."""

    def __init__(self, kubeconfig: Path, log: Path, args: tuple[str, ...] = ("--all-namespaces",),
                 env: dict[str, str] | None = None):
        self.kubeconfig, self.log_path = kubeconfig, log
        self.args, self.env = args, dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.port = self.metrics_port = 0
        self.starts = 0

    def start(self, timeout: float = 60, wait: bool = True) -> "Operator":
        """Start it; with wait, return once its liveness endpoint answers."""
        self.port, self.metrics_port = free_ports(2)
        self.starts += 1
        with open(self.log_path, "a") as log:
            log.write(f"===== operator start {self.starts}\n")
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kopf", "run", "--standalone", *self.args,
                 f"--liveness=http://127.0.0.1:{self.port}/healthz", "-m", "weightsync_operator"],
                env={**os.environ, "KUBECONFIG": str(self.kubeconfig), METRICS_PORT_ENV: str(self.metrics_port), **self.env},
                stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
        if wait:
            wait_for("operator liveness endpoint", self.healthy, timeout)
        return self

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"the operator exited ({self.proc and self.proc.returncode}):\n{self.log()[-3000:]}")
        return probe(f"http://127.0.0.1:{self.port}/healthz")

    def stop(self, timeout: float = 30) -> None:
        if self.proc is not None:
            stop_group(self.proc, timeout)

    def restart(self) -> "Operator":
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_since_start(self) -> str:
        return self.log().rsplit(f"===== operator start {self.starts}\n", 1)[-1]


class Namespace:
    """One test's namespace and the job helpers that read everything back from the API server."""

    def __init__(self, cluster, name: str):
        self.cluster, self.name = cluster, name

    def kubectl(self, *args, input=None, check=True):  # noqa: A002 - as the cluster's kubectl
        return self.cluster.kubectl("-n", self.name, *args, input=input, check=check)

    def get(self, kind: str, name: str | None = None, selector: str | None = None):
        args = ["get", kind, "-o", "json"] + ([name] if name else []) + (["-l", selector] if selector else [])
        proc = self.kubectl(*args, check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            raise AssertionError(proc.stderr)
        return json.loads(proc.stdout)

    def apply_job(self, name: str, spec: dict, check=True, labels: dict | None = None):
        obj = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "labels": labels or {}},
               "spec": {"model": {"config": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
                                             "vocab_size": 1024}}, **spec}}
        return self.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj), check=check)

    def job(self, name: str) -> dict | None:
        return self.get(PLURAL, name)

    def status(self, name: str) -> dict:
        return (self.job(name) or {}).get("status") or {}

    def condition(self, name: str, kind: str) -> dict:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == kind), {})

    def children(self, name: str) -> dict[str, dict]:
        """Every object labelled as the job's, by "Kind/name"."""
        items = self.get("services,secrets,configmaps,serviceaccounts,roles,rolebindings,statefulsets",
                         selector=f"{LABEL_JOB}={name}")["items"]
        return {f"{o['kind']}/{o['metadata']['name']}": o for o in items}

    def pods(self, name: str) -> list[dict]:
        return self.get("pods", selector=f"{LABEL_JOB}={name}")["items"]

    def events(self, name: str) -> list[dict]:
        return [e for e in self.get("events")["items"]
                if e["involvedObject"].get("kind") == KIND and e["involvedObject"].get("name") == name]

    def wait_children(self, name: str, timeout: float = 60) -> dict[str, dict]:
        return wait_for(f"all 9 children of {name}", lambda: c if len(c := self.children(name)) == 9 else None,
                        timeout)

    def wait_running_pods(self, name: str, count: int, timeout: float = 90) -> list[dict]:
        def running():
            pods = self.pods(name)
            ok = [p for p in pods if p["status"].get("phase") == "Running"
                  and all(c.get("ready") for c in p["status"].get("containerStatuses", []))]
            return pods if len(pods) == count and len(ok) == count else None
        return wait_for(f"{count} Running pods of {name}", running, timeout)

    def wait_phase(self, name: str, phase: str, timeout: float = 60) -> dict:
        return wait_for(f"{name} phase {phase}",
                        lambda: s if (s := self.status(name)).get("phase") == phase else None, timeout)

    def wait_event(self, name: str, reason: str, timeout: float = 30) -> dict:
        return wait_for(f"Event {reason} for {name}",
                        lambda: next((e for e in self.events(name) if e["reason"] == reason), None), timeout)


def running_operator(cluster, tmp_path_factory):
    """The operator of a test module, stopped at its end, its log's path shown with the output."""
    op = Operator(Path(cluster.kubeconfig), tmp_path_factory.mktemp("operator") / "operator.log").start()
    try:
        yield op
    finally:
        op.stop()
        # Shown with the test output when something failed.
        print(f"operator log: {op.log_path}")
