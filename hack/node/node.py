#!/usr/bin/env python3
"""A real node for the local cluster (hack/cluster/controlplane.py): containerd with its CRI
plugin, the kubelet and kube-proxy built from the same Kubernetes Go modules as the control plane,
CNI's bridge, and CoreDNS as the cluster's DNS, so that pods run as containers from the project's
own images (hack/node/images.py) next to KWOK's fake GPU/RDMA nodes.

How it fits on one machine, and why:
- Pods live on a bridge of their own (BRIDGE, POD_SUBNET); the node's address is the bridge's,
  so nothing but this machine and the namespaces containerd makes carries pod traffic.
- The API server listens on 127.0.0.1 only, which no pod can reach. socat relays the node's
  address to it, and the `kubernetes` Service's EndpointSlice names that relay, so pods reach the
  API through the Service as in any cluster (the API server's certificate names 10.96.0.1).
- The machine's cgroups are v1: the kubelet runs with the cgroupfs driver and failCgroupV1 off.
  Processes here may not lower their OOM score, so containerd restricts the scores it sets.
- The kubelet sets kernel.panic, kernel.panic_on_oops and vm.overcommit_memory, and pod traffic
  needs forwarding: every sysctl this changes is put back when the node stops.
- One node per machine (a lock): containerd's image store, the bridge and the kubelet's port are
  the machine's.

    python hack/node/node.py images                 # build the images into the node's store (make node-images)
    python hack/node/node.py up --dir .cluster      # after controlplane.py up --dir .cluster
    python hack/node/node.py down --dir .cluster
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from string import Template

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "cluster"))
import images as images_mod  # noqa: E402
from controlplane import (  # noqa: E402
    GPU_RESOURCE,
    KWOK_ANNOTATION,
    ControlPlane,
    die_with_parent,
    find_binaries,
    free_ports,
    stop_group,
    wait_for,
)

NODE_NAME = "node-0"
BRIDGE = "ws-cni0"
POD_SUBNET = "10.88.0.0/24"
NODE_IP = "10.88.0.1"
API_RELAY_PORT = 6443
KUBELET_PORT = 10250
DNS_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
CNI_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
PACKAGES = {"containerd": "containerd", "runc": "runc", "ctr": "containerd", "socat": "socat",
            "iptables": "iptables", "conntrack": "conntrack", "ip": "iproute2"}
# What the kubelet and the pod network change, restored by down().
SYSCTLS = ("kernel.panic", "kernel.panic_on_oops", "vm.overcommit_memory", "net.ipv4.ip_forward",
           "net.bridge.bridge-nf-call-iptables")
FORWARD_RULES = (("-i", BRIDGE), ("-o", BRIDGE))
KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT")
LOCK = Path("/run/weightsync-node.lock")


class NodeError(RuntimeError):
    pass


def unavailable() -> str | None:
    """Why a real node cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "a real node (containerd, the kubelet, a pod network) needs root"
    missing = sorted({pkg for tool, pkg in PACKAGES.items() if shutil.which(tool) is None})
    missing += ["containernetworking-plugins"] if cni_bin() is None else []
    if missing:
        return f"missing Debian packages: {' '.join(missing)} (hack/node/install-packages.sh installs them)"
    if images_mod.unavailable():
        return images_mod.unavailable()
    if not Path("/proc/sys/net/bridge").exists():
        return "the kernel has no br_netfilter (Service traffic between pods on one bridge needs it)"
    return None


def cni_bin() -> Path | None:
    return next((d for d in CNI_DIRS if (d / "bridge").exists()), None)


def sysctl(name: str, value: str | None = None) -> str:
    path = Path("/proc/sys") / name.replace(".", "/")
    if value is not None:
        path.write_text(value)
    return path.read_text().strip()


def run(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, text=True, **kw)
    if check and out.returncode != 0:
        raise NodeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def remove_kubelet_chains() -> None:
    """The chains the kubelet adds (and never removes): KUBE-FIREWALL, which drops traffic to
    127.0.0.0/8 from other addresses, its canaries, and the hint kube-proxy reads."""
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            rules = run(tool, "-t", table, "-S", check=False).stdout.splitlines()
            chains = {r.split()[1] for r in rules if r.startswith("-N ") and r.split()[1] in KUBELET_CHAINS}
            for rule in rules:
                words = shlex.split(rule)
                if words[0] == "-A" and "-j" in words and words[words.index("-j") + 1] in chains:
                    run(tool, "-t", table, "-D", *words[1:])
            for chain in chains:
                run(tool, "-t", table, "-F", chain)
                run(tool, "-t", table, "-X", chain)


def take_node_lock(name: str = NODE_NAME):
    """The machine's one real node: its lock file, held open (and locked) by the caller, or a
    NodeError that says which node holds it."""
    lock = open(LOCK, "w")  # noqa: SIM115 - held open while the node runs: it is the lock
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        lock.close()
        if e.errno in (errno.EAGAIN, errno.EACCES):
            raise NodeError(f"another real node runs on this machine (its tests hold {LOCK})") from None
        raise
    # `make cluster-up` leaves its node running after its process exits, lock released.
    needle = f"--hostname-override={name}".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (proc / "cmdline").read_bytes().split(b"\0"):
                lock.close()
                raise NodeError(f"a real node's kubelet runs on this machine (pid {proc.name}; "
                                "`make cluster-down` stops the one `make cluster-up` started)")
        except OSError:
            pass
    return lock


def prepare_images(log=None) -> float:
    """Builds the images and loads them into the node's image store (in the cache), so that a
    node's start finds them there: what `make node-images` runs before the tests, where a build
    has no test's time limit to fit in and no test waits on it. A containerd of its own runs on
    that store meanwhile, under the node's lock; returns the seconds it took."""
    log = log or sys.stderr
    started = time.monotonic()
    images = images_mod.Images.default()
    with take_node_lock(), tempfile.TemporaryDirectory(prefix="weightsync-images-") as state:
        containerd = Containerd(images_mod.NODE_CACHE / "containerd", Path(state) / "containerd")
        containerd.root.mkdir(parents=True, exist_ok=True)
        containerd.state.mkdir()
        config = Path(state) / "containerd.toml"
        config.write_text(containerd.config(images.pause))
        with open(Path(state) / "containerd.log", "ab") as out:
            proc = subprocess.Popen(["containerd", f"--config={config}"], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
        try:
            wait_for("the image store's containerd", lambda: run(
                "ctr", f"--address={containerd.socket}", "version", check=False).returncode == 0, 30)
            with images_mod.Docker(images_mod.NODE_CACHE / "docker", log) as docker:
                ids = images_mod.build(docker, images, lambda: find_binaries(log, ("coredns",))["coredns"], log)
                images_mod.load(docker, ids, containerd, images_mod.NODE_CACHE / "loaded.json", log)
        finally:
            stop_group(proc)
    return time.monotonic() - started


class Containerd:
    """The node's containerd: images kept in the cache between runs, state in the node's dir."""

    def __init__(self, root: Path, state: Path):
        self.root, self.state = root, state
        self.socket = state / "containerd.sock"

    def ctr(self, *args: str, stdin=None) -> str:
        return run("ctr", f"--address={self.socket}", "--namespace=k8s.io", *args, stdin=stdin).stdout

    @staticmethod
    def normalize(tag: str) -> str:
        """An image name as containerd stores it (Docker's short names in full)."""
        name = tag if "/" in tag.split(":")[0] else f"library/{tag}"
        return name if "." in name.split("/")[0] or ":" in name.split("/")[0] else f"docker.io/{name}"

    def config(self, pause: str) -> str:
        return f"""version = 2
root = "{self.root}"
state = "{self.state}"
[grpc]
  address = "{self.socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{self.normalize(pause)}"
  # Processes on this machine may not lower their OOM score: without this every sandbox fails.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin()}"
    conf_dir = "{self.state.parent / 'cni'}"
"""


class RealNode:
    """The node NODE_NAME, joined to `cluster`; its state, logs and pid files in `dir`."""

    def __init__(self, cluster: ControlPlane, directory: Path, binaries: dict[str, Path] | None = None,
                 images: images_mod.Images | None = None, cache: Path = images_mod.NODE_CACHE,
                 detached: bool = False):
        self.cluster = cluster
        self.dir = Path(directory).resolve()
        self.binaries = binaries
        self.images = images or images_mod.Images.default()
        self.cache = cache
        self.detached = detached
        self.name = NODE_NAME
        self.containerd = Containerd(self.cache / "containerd", self.dir / "containerd")
        self.kubeconfig = self.dir / "kubeconfig"
        self.timings: dict[str, float] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._lock = None
        saved = self.dir / "sysctls.json"
        self._sysctls = json.loads(saved.read_text()) if saved.exists() else {}

    # -- start -------------------------------------------------------------------------------------
    def up(self, timeout: float = 180, log=None) -> "RealNode":
        log = log or sys.stderr
        why = unavailable()
        if why:
            raise NodeError(why)
        self._take_lock()
        started = time.monotonic()
        try:
            binaries = self.binaries or find_binaries(log)
            self._prepare()
            t = time.monotonic()
            self._run("containerd", ["containerd", f"--config={self.dir / 'containerd.toml'}"])
            self._wait("containerd", lambda: run("ctr", f"--address={self.containerd.socket}", "version",
                                                  check=False).returncode == 0, 30)
            self.timings["containerd"] = time.monotonic() - t

            t = time.monotonic()
            with images_mod.Docker(self.cache / "docker", log) as docker:
                ids = images_mod.build(docker, self.images, lambda: binaries["coredns"], log)
                images_mod.load(docker, ids, self.containerd, self.cache / "loaded.json", log)
            self.timings["images"] = time.monotonic() - t

            t = time.monotonic()
            api_port = self.cluster.server.rsplit(":", 1)[1]
            self._run("api-relay", ["socat", f"TCP-LISTEN:{API_RELAY_PORT},bind={NODE_IP},reuseaddr,fork",
                                    f"TCP:127.0.0.1:{api_port}"])
            self._kubernetes_endpoints()
            self._run("kubelet", [str(binaries["kubelet"]), f"--config={self.dir / 'kubelet.yaml'}",
                                  f"--kubeconfig={self.kubeconfig}", f"--hostname-override={self.name}",
                                  f"--node-ip={NODE_IP}", f"--root-dir={self.dir / 'kubelet'}",
                                  f"--cert-dir={self.dir / 'kubelet-pki'}", "--v=1"])
            self._wait(f"node {self.name} Ready", self._ready, timeout)
            self.timings["kubelet"] = time.monotonic() - t

            t = time.monotonic()
            self._run("kube-proxy", [str(binaries["kube-proxy"]), f"--config={self.dir / 'kube-proxy.yaml'}"])
            self._cluster_dns(timeout)
            self.timings["dns"] = time.monotonic() - t
            self._cordon_fake_cpu_nodes()
        except BaseException:
            self.down()
            raise
        self.timings["total"] = time.monotonic() - started
        return self

    def _take_lock(self) -> None:
        self._lock = take_node_lock(self.name)

    def _prepare(self) -> None:
        """Directories, credentials, configuration files, the bridge and its firewall rules."""
        for sub in ("logs", "cni", "containerd", "kubelet", "kubelet-pki", "pod-logs"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.containerd.root.mkdir(parents=True, exist_ok=True)
        if not self._sysctls:
            self._sysctls = {name: sysctl(name) for name in SYSCTLS}
            (self.dir / "sysctls.json").write_text(json.dumps(self._sysctls, indent=1))
        cluster = self.cluster
        kubelet_cert = cluster.client_certificate(f"kubelet-{self.name}", f"system:node:{self.name}", "system:nodes")
        cluster.write_kubeconfig(self.kubeconfig, f"system:node:{self.name}", certificate=kubelet_cert)
        proxy_cert = cluster.client_certificate("kube-proxy", "system:kube-proxy")
        cluster.write_kubeconfig(self.dir / "kube-proxy.kubeconfig", "system:kube-proxy", certificate=proxy_cert)

        (self.dir / "containerd.toml").write_text(self.containerd.config(self.images.pause))
        (self.dir / "cni" / "10-weightsync.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "weightsync", "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
                 "ipam": {"type": "host-local", "subnet": POD_SUBNET, "gateway": NODE_IP,
                          "dataDir": str(self.dir / "cni" / "ipam"), "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ]}, indent=1))
        healthz, proxy_healthz, proxy_metrics = free_ports(3)
        (self.dir / "kubelet.yaml").write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": NODE_IP, "port": KUBELET_PORT, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": healthz,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(cluster.ca_file)}},
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{self.containerd.socket}",
            "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
            "clusterDomain": CLUSTER_DOMAIN, "clusterDNS": [DNS_IP],
            # Pods of dnsPolicy Default get no nameserver: nothing here resolves outside the cluster.
            "resolvConf": "",
            "podCIDR": POD_SUBNET, "podLogsDir": str(self.dir / "pod-logs"),
            # A test machine's disk is shared: evict nothing and collect no image for lack of space.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False, "registerNode": True,
        }, indent=1))
        (self.dir / "kube-proxy.yaml").write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.dir / "kube-proxy.kubeconfig")},
            "mode": "iptables", "hostnameOverride": self.name, "clusterCIDR": POD_SUBNET,
            "healthzBindAddress": f"127.0.0.1:{proxy_healthz}", "metricsBindAddress": f"127.0.0.1:{proxy_metrics}",
            "nodePortAddresses": [f"{NODE_IP}/32"],
            # Leave the machine's conntrack sysctls and route_localnet as they are.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
            "iptables": {"localhostNodePorts": False},
        }, indent=1))
        (self.dir / "kube-proxy.healthz").write_text(str(proxy_healthz))

        if run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
            run("ip", "link", "delete", BRIDGE)  # left by a node that did not stop
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{NODE_IP}/{POD_SUBNET.split('/')[1]}", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")
        sysctl("net.ipv4.ip_forward", "1")
        sysctl("net.bridge.bridge-nf-call-iptables", "1")
        # dockerd, where it runs, sets the FORWARD policy to DROP, and bridged frames pass FORWARD.
        for rule in FORWARD_RULES:
            if run("iptables", "-C", "FORWARD", *rule, "-j", "ACCEPT", check=False).returncode != 0:
                run("iptables", "-I", "FORWARD", *rule, "-j", "ACCEPT")

    def _kubernetes_endpoints(self) -> None:
        """The `kubernetes` Service's endpoint: the relay on the node's address."""
        path = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
        slice_ = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                  "metadata": {"name": "kubernetes-real-node",
                               "labels": {"kubernetes.io/service-name": "kubernetes",
                                          "endpointslice.kubernetes.io/managed-by": "weightsync.io-real-node"}},
                  "addressType": "IPv4",
                  "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}}],
                  "ports": [{"name": "https", "port": API_RELAY_PORT, "protocol": "TCP"}]}
        self._delete(f"{path}/kubernetes-real-node")
        self.cluster.request("POST", path, slice_)

    def _ready(self) -> bool:
        node = self.cluster.request("GET", f"/api/v1/nodes/{self.name}")
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions", []))

    def _cluster_dns(self, timeout: float) -> None:
        manifest = Template((HERE / "coredns.yaml").read_text()).substitute(
            image=self.images.coredns, node=self.name, dns_ip=DNS_IP, domain=CLUSTER_DOMAIN)
        self.cluster.kubectl("apply", "-f", "-", input=manifest)
        self.cluster.kubectl("rollout", "status", "-n", "kube-system", "deployment/coredns", f"--timeout={int(timeout)}s",
                             timeout=timeout + 10)

    def _cordon_fake_cpu_nodes(self) -> None:
        """KWOK's nodes without GPUs run nothing: while this node runs, pods that need no GPU come
        here (GPU nodes are tainted for pods that ask for none). Uncordoned by down()."""
        nodes = self.cluster.request("GET", "/api/v1/nodes")["items"]
        fake_cpu = [n["metadata"]["name"] for n in nodes
                    if n["metadata"].get("annotations", {}).get(KWOK_ANNOTATION[0]) == KWOK_ANNOTATION[1]
                    and GPU_RESOURCE not in n["status"].get("allocatable", {}) and not n["spec"].get("unschedulable")]
        (self.dir / "cordoned.json").write_text(json.dumps(fake_cpu))
        for name in fake_cpu:
            self._schedulable(name, False)

    def _schedulable(self, name: str, schedulable: bool) -> None:
        self.cluster.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"unschedulable": not schedulable}},
                             content_type="application/merge-patch+json")

    # -- stop --------------------------------------------------------------------------------------
    def down(self, timeout: float = 60) -> None:
        """Stops everything up() started and puts the machine back as it was: pods, containers,
        mounts, the bridge, firewall rules, sysctls. Safe to call on a half-started node."""
        errors = []

        def step(what, fn, *args):
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - keep going: everything else must still be undone
                errors.append(f"{what}: {e}")

        cordoned = self.dir / "cordoned.json"
        for name in json.loads(cordoned.read_text()) if cordoned.exists() else []:
            step(f"uncordon {name}", self._schedulable, name, True)
        cordoned.unlink(missing_ok=True)
        if self._live_pid("kubelet"):
            step("draining pods", self._drain, timeout)
        kube_proxy = self._binary("kube-proxy")
        for name in ("kube-proxy", "kubelet", "api-relay"):
            step(f"stopping {name}", self._stop, name)
        if kube_proxy:
            step("kube-proxy --cleanup", run, str(kube_proxy), "--cleanup")
        step("the kubelet's iptables chains", remove_kubelet_chains)
        step("leftover containers", self._kill_containers)
        step("stopping containerd", self._stop, "containerd")
        step("containerd's shims", self._kill_shims)
        step("mounts", self._unmount)
        step("bridge", lambda: run("ip", "link", "delete", BRIDGE, check=False))
        for rule in FORWARD_RULES:
            step("firewall", lambda r=rule: run("iptables", "-D", "FORWARD", *r, "-j", "ACCEPT", check=False))
        for name, value in self._sysctls.items():
            step(f"sysctl {name}", sysctl, name, value)
        (self.dir / "sysctls.json").unlink(missing_ok=True)
        step("node object", self._delete, f"/api/v1/nodes/{self.name}")
        step("endpoints", self._delete, "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/kubernetes-real-node")
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if errors:
            raise NodeError("stopping the real node: " + "; ".join(errors))

    def _drain(self, timeout: float) -> None:
        """Cordons the node and deletes its pods, so that the kubelet stops their containers."""
        self._schedulable(self.name, False)
        selector = f"spec.nodeName={self.name}"
        for pod in self.cluster.request("GET", f"/api/v1/pods?fieldSelector={selector}")["items"]:
            meta = pod["metadata"]
            self._delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")
        wait_for(f"pods of {self.name} stopped",
                 lambda: not self.cluster.request("GET", f"/api/v1/pods?fieldSelector={selector}")["items"], timeout)

    @staticmethod
    def _kill_containers() -> None:
        """Whatever still runs in the pods' cgroups (a node stopped without draining)."""
        for procs in Path("/sys/fs/cgroup/pids/kubepods").rglob("cgroup.procs"):
            for pid in procs.read_text().split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass

    def _kill_shims(self) -> None:
        """containerd leaves its shims running when it stops."""
        needle = str(self.containerd.socket).encode()
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and needle in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), 9)
            except (OSError, ProcessLookupError):
                pass

    def _unmount(self) -> None:
        """What the kubelet and containerd mounted under the node's directory (volumes, rootfs)."""
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for target in sorted((m for m in mounts if m.startswith(str(self.dir) + "/") or
                              m.startswith("/run/netns/cni-")), key=len, reverse=True):
            run("umount", "-l", target, check=False)

    # -- processes ---------------------------------------------------------------------------------
    def _run(self, name: str, argv: list[str]) -> None:
        with open(self.dir / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=self.dir, start_new_session=True,
                                    preexec_fn=None if self.detached else die_with_parent)
        self._procs[name] = proc
        (self.dir / f"{name}.pid").write_text(json.dumps([proc.pid, argv[0]]))

    def _live_pid(self, name: str) -> int | None:
        try:
            pid, argv0 = json.loads((self.dir / f"{name}.pid").read_text())
            alive = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode() == argv0
        except (OSError, ValueError):
            return None
        return pid if alive else None

    def _binary(self, name: str) -> Path | None:
        if self.binaries:
            return self.binaries.get(name)
        try:
            return Path(json.loads((self.dir / f"{name}.pid").read_text())[1])
        except (OSError, ValueError):
            return None

    def _stop(self, name: str) -> None:
        pid = self._live_pid(name)
        if pid:
            proc = self._procs.get(name)
            if proc is None:
                os.killpg(pid, 15)
                wait_for(f"{name} stopped", lambda: not self._live_pid(name), 30, interval=0.2)
            else:
                stop_group(proc, grace=20)
        (self.dir / f"{name}.pid").unlink(missing_ok=True)
        self._procs.pop(name, None)

    def _wait(self, what: str, ready, timeout: float) -> None:
        def alive():
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise NodeError(f"{name} exited ({proc.returncode}) while waiting for {what}; "
                                    f"{self.dir / 'logs' / name}.log ends with:\n{self.log_tail(name)}")

        def check():
            try:
                return ready()
            except (OSError, ValueError, KeyError, NodeError):
                return False

        try:
            wait_for(what, check, timeout, interval=0.5, failed=alive)
        except TimeoutError:
            tails = "\n".join(f"--- {n}:\n{self.log_tail(n, 10)}" for n in self._procs)
            raise NodeError(f"{what}: not after {timeout:.0f}s; logs in {self.dir / 'logs'}:\n{tails}") from None

    def log_tail(self, name: str, lines: int = 25) -> str:
        log = self.dir / "logs" / f"{name}.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""

    def _delete(self, path: str) -> None:
        try:
            self.cluster.request("DELETE", path)
        except OSError as e:
            if getattr(e, "code", None) != 404:
                raise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("up", "down", "images"))
    parser.add_argument("--dir", default=".cluster", help="the control plane's directory (default: .cluster)")
    args = parser.parse_args(argv)
    if args.action == "images":
        why = unavailable()
        if why:
            print(f"images: not built, so the real-pod tests will skip: {why}", file=sys.stderr)
            return 0
        print(f"images: built and in the node's image store in {prepare_images():.0f}s", file=sys.stderr)
        return 0
    cluster = ControlPlane(args.dir)
    node = RealNode(cluster, cluster.dir / "node", detached=True)
    if args.action == "up":
        node.up()
        t = node.timings
        print(f"real node {node.name} ready in {t['total']:.1f}s (images {t['images']:.1f}s, kubelet {t['kubelet']:.1f}s, "
              f"cluster DNS {t['dns']:.1f}s); its logs in {node.dir / 'logs'}")
    else:
        node.down()
        print(f"stopped the real node in {node.dir}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NodeError as e:  # what is missing or wrong, on one line: no traceback for a prerequisite
        print(f"node.py: {e}", file=sys.stderr)
        sys.exit(1)
