"""The end-to-end tests' tools: the real helm CLI against the session's local cluster, the chart
installed with it, the operator as the chart runs it (its Deployment's pod on the real node), a
real Prometheus scraping with the chart's configuration, and reading pods, logs and examples back."""

from __future__ import annotations

import copy
import json
import subprocess
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import yaml
from controlplane import free_ports, probe, wait_for

from weightsync.job import LABEL_JOB
from weightsync.runtime.procs import stop

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "weightsync"


class Helm:
    def __init__(self, cluster, home: Path):
        self.cluster = cluster
        self.env = {**cluster.env, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                    "HELM_DATA_HOME": str(home / "data")}

    def __call__(self, *args: str, check: bool = True, input: str | None = None,  # noqa: A002 - as subprocess.run's
                 timeout: float = 180):
        proc = subprocess.run([str(self.cluster.binaries / "helm"), f"--kubeconfig={self.cluster.kubeconfig}", *args],
                              capture_output=True, text=True, env=self.env, input=input, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def package(self, destination: Path) -> Path:
        """The chart's package, with the package's one version number, as `make dist` builds it."""
        version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
        self("package", str(CHART), "--destination", str(destination), "--version", version, "--app-version", version)
        return destination / f"weightsync-{version}.tgz"


def new_namespace(cluster, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    return name


def pods(cluster, namespace: str, selector: str) -> list[dict]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
    return json.loads(out)["items"]


def running(pod: dict) -> bool:
    return pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")


def restarts(pod: dict) -> int:
    return sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or [])


def install(helm: Helm, release: str, namespace: str, *values: str, chart: Path = CHART) -> None:
    """The chart (its folder, or a package `make dist` built) installed as `make deploy-*` installs
    it: the CRD applied first (helm installs a chart's CRD only once and never upgrades it), then
    the release."""
    helm.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    helm.cluster.wait_served("weighttransferjobs.weightsync.io")
    helm("install", release, str(chart), "--namespace", namespace, "--create-namespace", "--wait", "--timeout", "3m",
         *[a for v in values for a in ("--set", v)])


class LogFollower:
    """`kubectl logs -f` of each pod it is shown, into a file per pod, as a user watching the job
    would: the lines stay readable after the operator has removed the pods."""

    def __init__(self, cluster, namespace: str, directory: Path):
        self.cluster, self.namespace, self.dir = cluster, namespace, directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.uids: dict[str, tuple[str, int]] = {}  # {pod: (its uid, its container's restarts)}
        self.ended: list[subprocess.Popen] = []
        self.seen: dict[str, dict] = {}  # {pod: the pod as last shown}, kept after the pod is gone
        self.lives: dict[str, list[str]] = {}  # {pod: the uids it had, the first first}

    def follow(self, pod: dict) -> None:
        """Follow the pod's logs; a pod deleted and created again under its name, or whose
        container started again, is followed again, into the same file."""
        name, uid = pod["metadata"]["name"], (pod["metadata"].get("uid", ""), restarts(pod))
        self.seen[name] = pod
        if uid[0] not in self.lives.setdefault(name, []):
            self.lives[name].append(uid[0])
        if (name in self.procs and self.uids.get(name) == uid) or not running(pod):
            return
        if name in self.procs:
            self.ended.append(self.procs.pop(name))
        self.uids[name] = uid
        with open(self.dir / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                ["kubectl", f"--kubeconfig={self.cluster.kubeconfig}", "logs", "-f", "-n", self.namespace, name],
                stdout=out, stderr=subprocess.STDOUT)

    def text(self, name: str) -> str:
        """What the pod's containers said so far ("" before it ran)."""
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def story(self, name: str) -> str:
        """How the pod last looked: its uids (a pod the StatefulSet created again has a new one),
        each container's state, restarts and last end (exit code, signal, reason: OOMKilled,
        Error), and whether its log stream was followed and how that ended."""
        pod = self.seen.get(name)
        if pod is None:
            return "never seen"
        said = [f"uids {', '.join(self.lives[name])}", f"phase {pod['status'].get('phase')}"]
        if pod["metadata"].get("deletionTimestamp"):
            said.append(f"deleted at {pod['metadata']['deletionTimestamp']}")
        for c in pod["status"].get("containerStatuses") or []:
            said.append(f"container {c['name']}: {c.get('restartCount', 0)} restarts, state {json.dumps(c.get('state'))}"
                        f", last state {json.dumps(c.get('lastState') or {})}")
        proc = self.procs.get(name)
        said.append("its log not followed" if proc is None else f"its log stream exited {proc.poll()}")
        return "; ".join(said)

    def stop(self, timeout: float = 30) -> None:
        """Waits for every stream to end (its container exited), then stops those that did not."""
        for proc in [*self.ended, *self.procs.values()]:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(10)


class Operator:
    """The operator as the chart runs it: the one pod of the chart's Deployment, from the operator
    image, on the real node, with the chart's ServiceAccount (so the chart's RBAC is all it has)."""

    def __init__(self, cluster, helm_namespace: str, release: str, node: str):
        self.cluster, self.namespace = cluster, helm_namespace
        self.selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator"
        self.node = node
        self.pod: dict = {}

    def __enter__(self) -> "Operator":
        (self.pod,) = wait_for("the operator pod Running", lambda: [
            p for p in pods(self.cluster, self.namespace, self.selector) if running(p)], 120, failed=self.check)
        assert self.pod["spec"]["nodeName"] == self.node, "the operator's pod must run on the real node"
        self.wait_healthy()
        return self

    @property
    def name(self) -> str:
        return self.pod["metadata"]["name"]

    def wait_healthy(self, timeout: float = 90) -> None:
        """The Deployment's liveness probe, sent as the kubelet sends it, to the pod's address."""
        liveness = self.pod["spec"]["containers"][0]["livenessProbe"]["httpGet"]
        port = liveness["port"]
        if isinstance(port, str):
            (port,) = [p["containerPort"] for p in self.pod["spec"]["containers"][0]["ports"] if p["name"] == port]
        url = f"http://{self.pod['status']['podIP']}:{port}{liveness['path']}"
        wait_for(f"operator liveness {url}", lambda: probe(url), timeout, failed=self.check)

    def check(self) -> None:
        """Fails when the operator's container has exited or restarted (a crash loop)."""
        for pod in pods(self.cluster, self.namespace, self.selector):
            for status in pod["status"].get("containerStatuses") or []:
                exited = status.get("restartCount") or "terminated" in (status.get("state") or {})
                if exited:
                    which = ["--previous"] if "terminated" not in (status.get("state") or {}) else []
                    last = self.cluster.kubectl("logs", "-n", self.namespace, pod["metadata"]["name"], *which,
                                                "--tail=60", check=False)
                    raise AssertionError(f"the operator's container exited ({status.get('restartCount')} restarts, now "
                                         f"{json.dumps(status['state'])}); it logged:\n{last.stdout}{last.stderr}")

    def logs(self) -> str:
        return self.cluster.kubectl("logs", "-n", self.namespace, self.name).stdout

    def exec(self, *command: str) -> subprocess.CompletedProcess:
        return self.cluster.kubectl("exec", "-n", self.namespace, self.name, "--", *command, check=False)

    def __exit__(self, *exc) -> None:
        log = self.logs()
        if exc[0] is not None:
            print(f"--- operator log:\n{log[-8000:]}")
            return
        self.check()
        # The chart's RBAC was enough for everything the operator tried.
        refused = [line for line in log.splitlines() if "forbidden" in line.lower()]
        assert not refused, "\n".join(refused)


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


# What a chart release may create, by scope.
CLUSTER_SCOPED = ("clusterroles", "clusterrolebindings", "validatingadmissionpolicies", "validatingadmissionpolicybindings")
NAMESPACED = ("deployments", "serviceaccounts", "roles", "rolebindings", "secrets", "configmaps", "services")



def leftovers(cluster, release: str, namespaces: list[str]) -> list[str]:
    selector = f"app.kubernetes.io/instance={release}"
    found = cluster.kubectl("get", ",".join(CLUSTER_SCOPED), "-l", selector, "-o", "name").stdout.split()
    for ns in namespaces:
        found += cluster.kubectl("get", ",".join(NAMESPACED), "-n", ns, "-l", selector, "-o", "name").stdout.split()
        # helm's own record of the release
        found += cluster.kubectl("get", "secrets", "-n", ns, "-l", f"owner=helm,name={release}", "-o", "name").stdout.split()
    return found


class Prometheus:
    """A real Prometheus on this machine, scraping with the chart's scrape configuration (the
    ConfigMap that metrics.scrapeConfig.enabled installs) as a user's Prometheus that mounts it
    would. Only the connection is this machine's: it runs outside the cluster, so each of the
    chart's Kubernetes service discoveries reaches the API server through the test cluster's
    kubeconfig, where a Prometheus in the cluster uses its ServiceAccount."""

    def __init__(self, cluster, chart_namespace: str, release: str, directory: Path):
        self.cluster, self.dir = cluster, directory
        configmap = json.loads(cluster.kubectl("get", "configmap", f"{release}-scrape-config", "-n", chart_namespace,
                                               "-o", "json").stdout)
        scrape = yaml.safe_load(configmap["data"]["weightsync.yaml"])
        for job in scrape["scrape_configs"]:
            for discovery in job["kubernetes_sd_configs"]:
                discovery["kubeconfig_file"] = str(cluster.kubeconfig)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "weightsync.yaml").write_text(yaml.safe_dump(scrape))
        (directory / "prometheus.yml").write_text(yaml.safe_dump({"scrape_config_files": ["weightsync.yaml"]}))
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Prometheus":
        log = open(self.dir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [str(self.cluster.binaries / "prometheus"), f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        wait_for("Prometheus ready", lambda: self.proc.poll() is not None or probe(f"{self.url}/-/ready"), 60)
        assert self.proc.poll() is None, f"Prometheus exited:\n{self.log()[-3000:]}"
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop(self.proc, grace=30)

    def log(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")

    def query(self, promql: str) -> dict[tuple, float]:
        """An instant query over the HTTP API: {the series' labels, sorted: its value}."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with urllib.request.urlopen(url, timeout=30) as response:
            answer = json.loads(response.read())
        assert answer["status"] == "success", answer
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in answer["data"]["result"]}

    def targets(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=30) as response:
            return json.loads(response.read())["data"]["activeTargets"]


# ---------------------------------------------------------------- running a job for real


def restricted(cluster, namespace: str) -> None:
    """Pod Security `restricted` enforced in the namespace: the API server admits no pod that runs
    as root, keeps a capability, may escalate privileges or lacks a seccomp profile."""
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")


def apply(cluster, namespace: str, job: dict) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(job))


def host_claim(cluster, namespace: str, claim: str, folder: Path, access: str) -> str:
    """A PersistentVolumeClaim `claim` bound to a hostPath PersistentVolume of `folder` on the real
    node, as a cluster's storage gives pods its checkpoints; returns the volume's name
    (drop_claim() deletes both: the volume's reclaim policy keeps the folder)."""
    pv = f"{namespace}-{claim}"
    for obj in (
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": [access], "storageClassName": "",
                  "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder), "type": "Directory"},
                  "claimRef": {"namespace": namespace, "name": claim}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": namespace},
         "spec": {"accessModes": [access], "storageClassName": "", "volumeName": pv,
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ):
        apply(cluster, namespace, obj)
    return pv


def drop_claim(cluster, namespace: str, claim: str) -> None:
    cluster.kubectl("delete", "pvc", claim, "-n", namespace, "--ignore-not-found", "--wait=false", check=False)
    cluster.kubectl("delete", "pv", f"{namespace}-{claim}", "--ignore-not-found", "--wait=false", check=False)


def mounted(claim: str, path: str, read_only: bool = False) -> dict:
    """A pod template (spec.<role>.podTemplate) that mounts the claim at `path` in the worker."""
    return {"spec": {"volumes": [{"name": claim, "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}],
                     "containers": [{"name": "worker", "volumeMounts": [
                         {"name": claim, "mountPath": path, "readOnly": read_only}]}]}}


def job_pods(cluster, namespace: str, name: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in pods(cluster, namespace, f"{LABEL_JOB}={name}")}


def fast(job: dict) -> dict:
    """The tcp example, kept as it is except where a 2-core node needs less: fewer steps, and CPU
    requests that let all five pods (and the operator) fit on it. Two versions: one before training
    and one after it."""
    job = copy.deepcopy(job)
    job["spec"].setdefault("training", {}).update(steps=3)
    job["spec"].setdefault("transfer", {}).update(everySteps=3)
    for role in ("trainer", "inference"):
        job["spec"][role].setdefault("resources", {}).setdefault("requests", {})["cpu"] = "200m"
    return job


# A model of 230 KB (the tcp example's is 6.6 MB): where a test proves what pods, rejoins, scaling or
# queueing do, not what a version of the example's size does, its steps cost the shared cores little.
SMALL_MODEL = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 32,
               "bos_token_id": 0, "eos_token_id": 0}


def small(job: dict, steps: int = 3) -> dict:
    """fast(), with SMALL_MODEL and `steps` steps (0: until the job is deleted)."""
    job = fast(job)
    job["spec"]["model"]["config"] = SMALL_MODEL
    job["spec"]["training"].update(steps=steps, seqLen=32)
    return job


def following(cluster, namespace: str, name: str, operator, logs: LogFollower):
    """The `failed` hook of a wait on a job: the operator still healthy, every pod's log followed."""
    def progress():
        operator.check()
        for pod in job_pods(cluster, namespace, name).values():
            logs.follow(pod)
    return progress


def get_job(cluster, namespace: str, name: str) -> dict:
    return json.loads(cluster.kubectl("get", "wtj", name, "-n", namespace, "-o", "json").stdout)


def phase_in(cluster, namespace: str, name: str, phases: tuple[str, ...]) -> dict | None:
    job = get_job(cluster, namespace, name)
    return job if job.get("status", {}).get("phase") in phases else None


def finished(cluster, namespace: str, name: str, progress) -> dict:
    """The job once it ended, Succeeded or Failed."""
    return wait_for(f"{name} finished", lambda: phase_in(cluster, namespace, name, ("Succeeded", "Failed")),
                    600, interval=1, failed=progress)


def show_logs(logs: LogFollower, tail: int = 2500) -> None:
    logs.stop()
    for pod_name in sorted(logs.procs):
        print(f"--- kubectl logs {pod_name}:\n{logs.text(pod_name)[-tail:]}")


def assert_succeeded(cluster, namespace: str, job: dict, logs: LogFollower, lines: int = 20) -> dict:
    """The job's status, which must say Succeeded. Otherwise the failure says why as far as the
    cluster can tell, in the assertion's own message (which a CI log keeps when it cuts the
    captured output): the job's conditions, the namespace's events (a container killed, a probe
    failing, a pod evicted) and the last lines of each of the job's pods."""
    status = job.get("status", {})
    if status.get("phase") == "Succeeded":
        return status
    name = job["metadata"]["name"]
    said = [f"{name} ended {status.get('phase')}:", json.dumps(status.get("conditions"), indent=1),
            "events of the job, its children and its pods:", *job_events(cluster, namespace, name)[-40:]]
    for pod in sorted(p for p in logs.seen if p.startswith(f"{name}-")):
        said += [f"--- {pod}: {logs.story(pod)}", "its last lines:", *logs.text(pod).splitlines()[-lines:]]
    raise AssertionError("\n".join(said))


def job_events(cluster, namespace: str, name: str) -> list[str]:
    """The namespace's events about the job, its children and its pods (named after the job), oldest
    first, one line each: the events of another job in the namespace do not push them out."""
    out = cluster.kubectl("get", "events", "-n", namespace, "-o", "json", check=False).stdout
    events = json.loads(out)["items"] if out else []
    ours = [e for e in events if e["involvedObject"].get("name") == name
            or e["involvedObject"].get("name", "").startswith(f"{name}-")]
    ours.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return [f"{e.get('lastTimestamp') or e.get('eventTime')} {e['type']} {e['reason']} "
            f"{e['involvedObject']['kind']}/{e['involvedObject']['name']} (x{e.get('count', 1)}): {e.get('message', '')}"
            for e in ours]
