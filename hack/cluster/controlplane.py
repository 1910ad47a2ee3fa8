#!/usr/bin/env python3
"""A local Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler built from the Kubernetes Go modules, plus KWOK playing the kubelets of fake
GPU/RDMA nodes. Everything listens on 127.0.0.1 at free ports; state, logs and pid files live
in one directory. A real node (hack/node/node.py) can join it: the API server already holds the
client certificate it presents to kubelets.

    python hack/cluster/controlplane.py up --dir .cluster      # prints how to use it
    python hack/cluster/controlplane.py down --dir .cluster
"""
from __future__ import annotations

import argparse
import base64
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "helm",
            "kubelet", "kube-proxy", "coredns",  # these three for a real node (hack/node)
            "prometheus",  # for the end-to-end tests that scrape a job's pods
            "kueue")  # for the tests of jobs that Kueue admits (its CRDs beside it, in kueue-crds)
# Started in this order, stopped in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
GPU_RESOURCE = "nvidia.com/gpu"
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
# Extensions of every certificate the cluster's CA signs.
SIGNED = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nauthorityKeyIdentifier=keyid,issuer\n"
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
SERVICE_CIDR = "10.96.0.0/12"
POD_CIDR = "10.244.0.1/16"
NODE_IP = "127.0.0.1"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
# name, GPUs, RDMA devices: the nodes `up` creates unless told otherwise.
DEFAULT_NODES = (
    ("gpu-rdma-0", 8, 1000),
    ("gpu-rdma-1", 8, 1000),
    ("gpu-0", 8, 0),
    ("gpu-1", 8, 0),
    ("cpu-0", 0, 0),
)
# Everything `up` writes into its directory; only these are removed when it starts afresh,
# so that pointing --dir at a directory with other content never deletes that content.
OWNED = ("bin", "etcd", "pki", "logs", "certs", "kubeconfig", "kubeconfigs", "tokens.csv", "state.json")


class ClusterError(RuntimeError):
    pass


class PortTaken(ClusterError):
    """A component could not bind its port (another process took it after we picked it)."""


def find_binaries(log=None, names: tuple[str, ...] = BINARIES) -> dict[str, Path]:
    """Path of each binary named: from KUBEBUILDER_ASSETS where it has it, else from the cache that
    build-binaries.sh fills once (it builds what is missing, one build of each binary at a time on
    the machine, and prints the directory)."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    found = {n: Path(assets, n) for n in names if assets and os.access(Path(assets, n), os.X_OK)}
    if len(found) < len(names):
        Path(os.environ.get("WEIGHTSYNC_CACHE", Path.home() / ".cache/weightsync")).mkdir(parents=True, exist_ok=True)
        out = subprocess.run(["bash", str(HERE / "build-binaries.sh"), *(n for n in names if n not in found)],
                             stdout=subprocess.PIPE, stderr=log or sys.stderr, text=True)
        if out.returncode != 0:
            raise ClusterError(f"hack/cluster/build-binaries.sh failed (exit {out.returncode}); see its output above")
        built = Path(out.stdout.strip().splitlines()[-1])
        found = {n: found.get(n, built / n) for n in names}
    missing = [str(p) for p in found.values() if not os.access(p, os.X_OK)]
    if missing:
        raise ClusterError(f"missing binaries: {', '.join(missing)}")
    return found


def free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(what: str, check, timeout: float = 60, interval: float = 0.5, failed=None):
    """Polls check() until it returns something true, which it returns; failed(), called between
    polls, may raise early with a reason. Raises TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if failed is not None:
            failed()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f}s (last: {value!r})")
        time.sleep(interval)


def stop_group(proc: subprocess.Popen, grace: float = 10) -> int:
    """Stops a child started with start_new_session: SIGTERM to its process group, SIGKILL after
    `grace` seconds, and whatever else is left in the group goes with it. Returns its exit status."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait(10)


def die_with_parent():
    """For Popen's preexec_fn: runs in the child before exec, so that if the process that started
    it dies without stopping it (a killed test run), the kernel kills the child too."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def node_manifest(name: str, gpus: int = 0, rdma: int = 0, labels: dict | None = None,
                  rdma_resource: str = RDMA_RESOURCE, cpu: str = "64", memory: str = "512Gi") -> dict:
    """A KWOK-managed node with the capacity a GPU node advertises once its device plugins run."""
    resources = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "1Ti"}
    node_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
    }
    taints = []
    if gpus:
        resources[GPU_RESOURCE] = str(gpus)
        node_labels["nvidia.com/gpu.present"] = "true"
        # As GPU node pools are tainted in real clusters: only pods that ask for a GPU land here
        # (the API server's ExtendedResourceToleration plugin gives them the toleration).
        taints.append({"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"})
    if rdma:
        resources[rdma_resource] = str(rdma)
        node_labels["feature.node.kubernetes.io/rdma.available"] = "true"
    node_labels.update(labels or {})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": node_labels,
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": taints} if taints else {},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


class ControlPlane:
    """One local cluster living in `dir`. `up()` starts it, `down()` stops every process it
    started (also from another process: the pid files are in `dir`). With `detached`, the
    components outlive the process that started them (the command line's `up`); otherwise they
    die with it."""

    def __init__(self, directory: str | os.PathLike, binaries: dict[str, Path] | None = None, detached: bool = False):
        self.dir = Path(directory).resolve()
        self._sources = binaries
        self.detached = detached
        self.binaries = self.dir / "bin"  # links to every binary, helm included
        self.kubeconfig = self.dir / "kubeconfig"
        self.ca_file = self.dir / "pki" / "ca.crt"
        self.timings: dict[str, float] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self.terminating: set[str] = set()  # namespaces deleted and not yet waited for (delete_namespaces)
        state = self.dir / "state.json"
        self._state = json.loads(state.read_text()) if state.exists() else {}

    # -- what users of a running cluster need ------------------------------------------------
    @property
    def server(self) -> str:
        return self._state["server"]

    @property
    def token(self) -> str:
        """The admin's bearer token (group system:masters)."""
        return self._state["token"]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,  # noqa: A002 - a keyword callers pass, as to subprocess.run
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Runs the real kubectl against this cluster; with check, a failure raises with its stderr."""
        proc = subprocess.run(
            ["kubectl", f"--kubeconfig={self.kubeconfig}", *args],
            input=input, capture_output=True, text=True, timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def wait_served(self, *resources: str, timeout: float = 60) -> None:
        """Until the API server serves every resource ("plural.group") a CRD just applied defines:
        `kubectl wait --for=condition=Established` right after the apply can find no conditions yet."""
        wait_for(f"{', '.join(resources)} served", lambda: self.kubectl(
            "get", ",".join(resources), "-A", "--request-timeout=5s", check=False).returncode == 0, timeout)

    def api(self):
        """A kubernetes.client.ApiClient for the admin."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def request(self, method: str, path: str, body: dict | None = None, token: str | None = None,
                timeout: float = 30, content_type: str = "application/json"):
        """One call to the API server; JSON in and out (text for non-JSON answers)."""
        req = urllib.request.Request(
            self.server + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {token or self.token}", "Content-Type": content_type,
                     "Accept": "application/json"},
        )
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
                data = resp.read().decode()
        except urllib.error.HTTPError as e:
            # Keep the status code for callers; make the message say what the API server said.
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("message", detail)
            except ValueError:
                pass
            e.msg = f"{e.msg}: {method} {path}: {detail}"
            raise
        return json.loads(data) if data.startswith(("{", "[")) else data

    def create_namespace(self, name: str, timeout: float = 60) -> None:
        """Creates a namespace and waits for its default ServiceAccount, without which the API
        server refuses the namespace's first pods."""
        self.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        self.wait(f"ServiceAccount {name}/default",
                  lambda: self._exists(f"/api/v1/namespaces/{name}/serviceaccounts/default"), timeout)

    def delete_namespaces(self, *names: str, timeout: float = 180) -> None:
        """Deletes namespaces with everything in them. What could still act there (the category
        `all`: pods, their controllers, Services, the project's jobs, each job's children removed
        first by its foreground deletion) is deleted and waited for here, while whatever removes
        finalizers (an operator, Kueue) still runs, so that no later test meets it. The namespaces
        themselves go on in the background: Kubernetes' namespace controller waits a fixed 5 s
        before it starts on any, and `wait_namespaces_gone` waits for all of them at once."""
        for name in names:
            self.kubectl("delete", "all", "--all", "--namespace", name, "--ignore-not-found", "--cascade=foreground",
                         "--wait=true", f"--timeout={int(timeout)}s", timeout=timeout + 30)
        self.kubectl("delete", "namespace", "--ignore-not-found", "--wait=false", *names)
        self.terminating.update(names)

    def wait_namespaces_gone(self, timeout: float = 180) -> None:
        """Until every namespace `delete_namespaces` deleted is gone; on timeout, says which and
        what is left in them."""
        waiting = sorted(self.terminating)
        try:
            wait_for(f"namespaces {', '.join(waiting)} gone",
                     lambda: not any(self._exists(f"/api/v1/namespaces/{n}") for n in waiting), timeout)
        except TimeoutError:
            left = {n: self.kubectl("get", "all,events", "--namespace", n, "-o", "name", check=False).stdout.split()
                    for n in waiting if self._exists(f"/api/v1/namespaces/{n}")}
            raise ClusterError(f"namespaces not gone after {timeout:.0f}s, with what is left in them: {left}") from None
        self.terminating.difference_update(waiting)

    def add_node(self, name: str, gpus: int = 0, rdma: int = 0, labels: dict | None = None,
                 wait: bool = True, timeout: float = 60, **resources) -> dict:
        """Creates a fake node; with wait, returns once KWOK reports it Ready."""
        node = self.request("POST", "/api/v1/nodes", node_manifest(name, gpus, rdma, labels, **resources))
        if wait:
            self.wait_nodes_ready([name], timeout)
        return node

    def delete_node(self, name: str, wait: bool = True, timeout: float = 60) -> None:
        self.request("DELETE", f"/api/v1/nodes/{name}")
        if wait:
            self.wait(f"node {name} deleted", lambda: not self._exists(f"/api/v1/nodes/{name}"), timeout)

    def reset_nodes(self, nodes=DEFAULT_NODES, timeout: float = 60) -> None:
        """Makes the fake nodes exactly `nodes` again, for tests that added or removed some."""
        want = {node[0]: node for node in nodes}
        have = {n["metadata"]["name"] for n in self.request("GET", "/api/v1/nodes")["items"]}
        for name in sorted(have - want.keys()):
            self.delete_node(name, timeout=timeout)
        for name in sorted(want.keys() - have):
            self.add_node(*want[name], wait=False)
        self.wait_nodes_ready(list(want), timeout)

    def wait_nodes_ready(self, names, timeout: float = 60) -> None:
        def ready(name):
            conds = self.request("GET", f"/api/v1/nodes/{name}").get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        self.wait(f"nodes {', '.join(names)} Ready (KWOK)", lambda: all(ready(n) for n in names), timeout)

    # -- start and stop -------------------------------------------------------------------------
    def running(self) -> list[str]:
        return [name for name in COMPONENTS if self._live_pid(name)]

    def up(self, nodes=DEFAULT_NODES, timeout: float = 180, attempts: int = 3, log=None) -> "ControlPlane":
        """Starts the cluster afresh and creates `nodes`; returns once everything is ready."""
        if self.running():
            raise ClusterError(f"a cluster is already running in {self.dir} ({', '.join(self.running())}); stop it first")
        sources = self._sources or find_binaries(log)
        started = time.monotonic()
        for attempt in range(1, attempts + 1):
            try:
                self._start(sources, timeout)
                break
            except PortTaken as e:
                self.down()
                if attempt == attempts:
                    raise
                print(f"{e}; starting again with other ports", file=log or sys.stderr)
            except BaseException:
                self.down()
                raise
        try:
            t = time.monotonic()
            for name, gpus, rdma in nodes:
                self.add_node(name, gpus, rdma, wait=False)
            self.wait_nodes_ready([n[0] for n in nodes], timeout)
            self.timings["nodes"] = time.monotonic() - t
        except BaseException:
            self.down()
            raise
        self.timings["total"] = time.monotonic() - started
        return self

    def down(self, timeout: float = 20) -> None:
        """Stops every component this directory's pid files name (process groups), newest first."""
        for name in reversed(COMPONENTS):
            pid = self._live_pid(name)
            if pid:
                self._kill_group(name, pid, timeout)
            (self.dir / f"{name}.pid").unlink(missing_ok=True)
        self._procs.clear()

    def _start(self, sources: dict[str, Path], timeout: float) -> None:
        self._clean()
        for sub in ("bin", "logs", "pki", "kubeconfigs"):
            (self.dir / sub).mkdir(parents=True)
        for name, path in sources.items():
            (self.binaries / name).symlink_to(Path(path).resolve())
        etcd_port, peer_port, api_port, cm_port, sched_port = free_ports(5)
        server = f"https://127.0.0.1:{api_port}"
        tokens = {user: secrets.token_hex(16) for user in ("admin", "controller-manager", "scheduler", "kwok")}
        self._state = {"server": server, "token": tokens["admin"]}
        (self.dir / "state.json").write_text(json.dumps(self._state, indent=1))
        self._pki()
        # token,user,uid,"groups": kwok acts for every fake kubelet, so it is an admin too.
        (self.dir / "tokens.csv").write_text(
            f'{tokens["admin"]},admin,admin,"system:masters"\n'
            f'{tokens["controller-manager"]},system:kube-controller-manager,system:kube-controller-manager\n'
            f'{tokens["scheduler"]},system:kube-scheduler,system:kube-scheduler\n'
            f'{tokens["kwok"]},kwok,kwok,"system:masters"\n'
        )
        self.write_kubeconfig(self.kubeconfig, "admin", tokens["admin"])
        for user in ("controller-manager", "scheduler", "kwok"):
            self.write_kubeconfig(self.dir / "kubeconfigs" / user, user, tokens[user])
        pki, kc = self.dir / "pki", self.dir / "kubeconfigs"

        t = time.monotonic()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self._run("etcd", [
            "--name=default", f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}", "--unsafe-no-fsync=true", "--log-level=warn",
        ])
        self.wait("etcd", lambda: json.loads(_get(f"{etcd_url}/health"))["health"] == "true", timeout)
        self.timings["etcd"] = time.monotonic() - t

        t = time.monotonic()
        self._run("kube-apiserver", [
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={self.dir / 'tokens.csv'}",
            # What the controller-manager and scheduler expect to find for delegated authentication.
            f"--requestheader-client-ca-file={pki / 'ca.crt'}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--authorization-mode=Node,RBAC", "--anonymous-auth=false",
            "--enable-admission-plugins=ExtendedResourceToleration",
            # For a real node's kubelet: `kubectl logs` and `exec` go through it.
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
            # Endpoints may not name a loopback address, and nothing here is reachable at another one.
            "--endpoint-reconciler-type=none",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            # Who deleted or changed what, for a test that must find out why a pod went.
            f"--audit-policy-file={self._audit_policy()}", f"--audit-log-path={self.dir / 'logs' / 'audit.log'}",
            "--audit-log-maxsize=50", "--audit-log-maxbackup=1",
        ])
        self.wait("kube-apiserver /readyz", lambda: self.request("GET", "/readyz", timeout=3) == "ok", timeout)
        self.timings["kube-apiserver"] = time.monotonic() - t

        t = time.monotonic()
        for name, port, args in (
            ("kube-controller-manager", cm_port, [
                f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
                "--use-service-account-credentials=true",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}", f"--cluster-signing-key-file={pki / 'ca.key'}",
            ]),
            ("kube-scheduler", sched_port, []),
        ):
            who = name.removeprefix("kube-")
            self._run(name, [
                f"--kubeconfig={kc / who}", f"--authentication-kubeconfig={kc / who}",
                f"--authorization-kubeconfig={kc / who}", "--bind-address=127.0.0.1", f"--secure-port={port}",
                f"--cert-dir={self.dir / 'certs' / who}", "--leader-elect=false", *args,
            ])
        self._run("kwok", [
            f"--kubeconfig={kc / 'kwok'}", f"--config={HERE / 'kwok-stages.yaml'}",
            "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={'='.join(KWOK_ANNOTATION)}",
            "--node-lease-duration-seconds=40", f"--cidr={POD_CIDR}", f"--node-ip={NODE_IP}",
        ])
        # Their own health endpoints serve self-signed certificates; this only asks "are you up".
        unverified = ssl._create_unverified_context()
        for name, port in (("kube-controller-manager", cm_port), ("kube-scheduler", sched_port)):
            self.wait(f"{name} /healthz", lambda: _get(f"https://127.0.0.1:{port}/healthz", unverified) == "ok",
                       timeout)
        # The service-account controller is running once the default namespace has its account.
        self.wait("default ServiceAccount", lambda: self._exists("/api/v1/namespaces/default/serviceaccounts/default"),
                   timeout)
        self.timings["controllers"] = time.monotonic() - t

    def _audit_policy(self) -> Path:
        """The API server's audit policy: every delete, and the writes of StatefulSets and Kueue's
        Workloads with their bodies (a scale to zero, a Workload made again); nothing else."""
        path = self.dir / "audit-policy.yaml"
        path.write_text(json.dumps({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata", "verbs": ["delete", "deletecollection"]},
                      {"level": "Request", "verbs": ["create", "patch", "update"],
                       "resources": [{"group": "apps", "resources": ["statefulsets"]},
                                     {"group": "kueue.x-k8s.io", "resources": ["workloads"]}]},
                      {"level": "None"}]}))
        return path

    def _run(self, name: str, args: list[str]) -> None:
        with open(self.dir / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [str(self.binaries / name), *args], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.dir, start_new_session=True, preexec_fn=None if self.detached else die_with_parent,
            )
        self._procs[name] = proc
        (self.dir / f"{name}.pid").write_text(str(proc.pid))

    def wait(self, what: str, ready, timeout: float = 60) -> None:
        """Polls ready() until it returns true; fails early, with the log, if a component exits."""
        def check():
            try:
                return ready()
            except (OSError, ValueError, KeyError, urllib.error.URLError):
                return False

        def components_alive():
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    tail = self._log_tail(name)
                    error = PortTaken if "address already in use" in tail else ClusterError
                    raise error(f"{name} exited ({proc.returncode}) while waiting for {what}; "
                                f"{self.dir / 'logs' / name}.log ends with:\n{tail}")

        try:
            wait_for(what, check, timeout, interval=0.2, failed=components_alive)
        except TimeoutError:
            tails = "\n".join(f"--- {n}:\n{self._log_tail(n, 10)}" for n in self._procs)
            raise ClusterError(f"{what} not ready after {timeout:.0f}s; logs in {self.dir / 'logs'}:\n{tails}") from None

    def _exists(self, path: str) -> bool:
        try:
            self.request("GET", path)
            return True
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return False
            raise

    def _log_tail(self, name: str, lines: int = 25) -> str:
        log = self.dir / "logs" / f"{name}.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""

    def _live_pid(self, name: str) -> int | None:
        """The component's pid if that process is alive and really is the component we started."""
        try:
            pid = int((self.dir / f"{name}.pid").read_text())
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, ValueError):
            return None
        proc = self._procs.get(name)
        if proc is not None and proc.poll() is not None:
            return None
        return pid if argv0 == str(self.binaries / name) else None

    def _kill_group(self, name: str, pid: int, timeout: float) -> None:
        proc = self._procs.get(name)
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if proc is not None:
                    proc.poll()  # reap our own child so that it does not linger as a zombie
                try:
                    os.killpg(pid, 0)
                except ProcessLookupError:
                    return
                if proc is None and _is_zombie(pid):
                    return  # exited; its parent (init) reaps it
                time.sleep(0.05)
        raise ClusterError(f"{name} (process group {pid}) did not stop")

    def _clean(self) -> None:
        for name in OWNED:
            path = self.dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _pki(self) -> None:
        """A CA, the API server's serving certificate signed by it, and the service-account key."""
        pki = self.dir / "pki"

        def openssl(*args):
            subprocess.run(["openssl", *args], cwd=pki, check=True, capture_output=True)

        # The extensions that strict verification (Python 3.13's default, inside the images) requires
        # of a CA and of the certificates it signs.
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                "-days", "3650", "-subj", "/CN=weightsync-local-ca",
                "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                "-addext", "subjectKeyIdentifier=hash")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
                "-subj", "/CN=kube-apiserver")
        names = ["DNS:localhost", "IP:127.0.0.1", "IP:10.96.0.1", "DNS:kubernetes", "DNS:kubernetes.default",
                 "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local"]
        (pki / "apiserver.ext").write_text(f"subjectAltName={','.join(names)}\nextendedKeyUsage=serverAuth\n{SIGNED}")
        openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", "apiserver.crt", "-days", "3650", "-extfile", "apiserver.ext")
        openssl("genrsa", "-out", "sa.key", "2048")
        openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")
        self.client_certificate("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")

    def client_certificate(self, name: str, user: str, group: str | None = None) -> tuple[Path, Path]:
        """A client certificate for `user` (in `group`) signed by the cluster's CA: pki/NAME.crt
        and pki/NAME.key, returned in that order."""
        pki = self.dir / "pki"
        subject = f"/CN={user}" + (f"/O={group}" if group else "")
        (pki / f"{name}.ext").write_text(f"extendedKeyUsage=clientAuth\n{SIGNED}")
        for args in (["req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                      "-subj", subject],
                     ["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                      "-out", f"{name}.crt", "-days", "3650", "-extfile", f"{name}.ext"]):
            subprocess.run(["openssl", *args], cwd=pki, check=True, capture_output=True)
        return pki / f"{name}.crt", pki / f"{name}.key"

    def write_kubeconfig(self, path: Path, user: str, token: str | None = None,
                         certificate: tuple[Path, Path] | None = None, server: str | None = None) -> None:
        """A kubeconfig for `user`, who authenticates with a bearer token or a (certificate, key)."""
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        credentials = (f"    token: {token}\n" if token else
                       f"    client-certificate: {certificate[0]}\n    client-key: {certificate[1]}\n")
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: weightsync-local\n  cluster:\n    server: {server or self.server}\n"
            f"    certificate-authority-data: {ca}\n"
            f"users:\n- name: {user}\n  user:\n{credentials}"
            f"contexts:\n- name: weightsync-local\n  context:\n    cluster: weightsync-local\n    user: {user}\n"
            "current-context: weightsync-local\n"
        )
        path.chmod(0o600)


def _get(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, context=context, timeout=5) as resp:
        return resp.read().decode()


def probe(url: str) -> bool:
    """An HTTP probe as the kubelet sends it: whether a GET of `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--dir", default=".cluster", help="state, logs and kubeconfig (default: .cluster)")
    args = parser.parse_args(argv)
    cp = ControlPlane(args.dir, detached=True)
    if args.action == "up":
        cp.up()
        t = cp.timings
        print(f"control plane ready in {t['total']:.1f}s (etcd {t['etcd']:.1f}s, kube-apiserver "
              f"{t['kube-apiserver']:.1f}s, controllers {t['controllers']:.1f}s, nodes {t['nodes']:.1f}s)")
        print(f"API server {cp.server}; logs in {cp.dir / 'logs'}\n"
              f"  export KUBECONFIG={cp.kubeconfig}\n  kubectl get nodes\n"
              f"stop it with: make cluster-down")
    elif args.action == "down":
        cp.down()
        print(f"stopped the cluster in {cp.dir}")
    else:
        running = cp.running()
        print(f"running: {', '.join(running)}" if running else "not running")
        return 0 if running else 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ClusterError as e:  # what is missing or wrong, on one line: no traceback for a prerequisite
        print(f"controlplane.py: {e}", file=sys.stderr)
        sys.exit(1)
