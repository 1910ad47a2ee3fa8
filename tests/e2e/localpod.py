"""Running a pod that the API server holds as a local process, the way a kubelet would run its one
container, for a cluster whose nodes are KWOK's (they schedule pods and report them Running, but
run nothing).

What the process gets is read from the stored Pod and nothing else: its command and args (over
the image's ENTRYPOINT/CMD, read from the project's Dockerfile), its environment with every
`valueFrom` resolved (downward API fields, Secret and ConfigMap keys read through the API), and
its volumes mounted at their mount paths: ConfigMaps, Secrets, the downward API, memory-backed
emptyDirs, and the projected ServiceAccount token (a TokenRequest bound to the pod, as the kubelet
makes one) with the cluster's CA, so that in-cluster configuration works as in a real pod.

The process runs in its own mount and UTS namespace (as a container does): /etc is an overlay of
the host's, so mounts under /etc and the pod's /etc/hosts stay private; /run (so also /var/run),
/tmp and /dev/shm are fresh tmpfs mounts of its own. Where a real pod and this runner must differ, they differ here:
- The pod's IP: KWOK hands out addresses that are not routable on this machine, so the pod gets
  a loopback address of its own (127.a.b.c) instead, for status.podIP and for what it binds;
  a command-line address 0.0.0.0 (all of the pod's interfaces) becomes that address.
- Cluster DNS: the pod's /etc/hosts maps the names the job's headless Service would resolve
  (`<pod>.<service>.<namespace>.svc[.cluster.local]`) to those loopback addresses; only the
  address resolution is replaced, the names are the ones the operator wrote.
- The API server: KUBERNETES_SERVICE_HOST/PORT name the local API server (the kubelet would
  name the `kubernetes` Service's cluster IP).
- The process runs as this test's user, with the host's Python environment as its image.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.parse
from pathlib import Path

import dockerfiles
from controlplane import die_with_parent, stop_group

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
# Mount paths this runner can provide without touching the host's own filesystem.
PRIVATE_ROOTS = ("/etc/", "/run/", "/var/run/", "/dev/shm")
BIN = Path(sys.executable).parent


class PodError(RuntimeError):
    """A pod this runner cannot run as the kubelet would; the message says what is missing."""


def image_code_under_tmp() -> list[str]:
    """Where the installed worker and operator code lives (the image's files here), where the pod's
    own /tmp would hide it: an editable install from a checkout under /tmp."""
    import weightsync
    import weightsync_operator

    roots = {str(Path(m.__file__).resolve().parents[2]) for m in (weightsync, weightsync_operator)}
    return sorted(r for r in roots if r.startswith("/tmp/"))


def mount_namespaces_work() -> str | None:
    """None when this machine lets us make private mount namespaces, else why not."""
    proc = subprocess.run(["unshare", "--mount", "--uts", "--propagation", "private", "true"],
                          capture_output=True, text=True)
    return None if proc.returncode == 0 else f"unshare --mount --uts failed: {proc.stderr.strip()}"


class LocalPod:
    def __init__(self, cluster, pod: dict, ip: str, hosts: dict[str, str], workdir: Path,
                 dockerfile: str):
        if len(pod["spec"]["containers"]) != 1:
            raise PodError(f"pod {pod['metadata']['name']} has {len(pod['spec']['containers'])} containers; one is supported")
        self.cluster, self.pod, self.ip, self.hosts = cluster, pod, ip, hosts
        self.name = pod["metadata"]["name"]
        self.namespace = pod["metadata"]["namespace"]
        self.container = pod["spec"]["containers"][0]
        self.dockerfile = dockerfile
        self.dir = workdir / self.name
        self.dir.mkdir(parents=True)
        self.log = self.dir / "log"
        self.proc: subprocess.Popen | None = None

    # -- what the kubelet would resolve -----------------------------------------------------------
    def field(self, path: str) -> str:
        """A downward API fieldRef."""
        meta, spec = self.pod["metadata"], self.pod["spec"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            value = (meta.get(m.group(1)) or {}).get(m.group(2))
            if value is None:
                raise PodError(f"pod {self.name} has no {m.group(1)[:-1]} {m.group(2)!r} (fieldRef {path})")
            return value
        fields = {
            "metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
            "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.podIP": self.ip, "status.podIPs": self.ip, "status.hostIP": self.ip,
        }
        if path not in fields:
            raise PodError(f"fieldRef {path} is not supported by this runner")
        return fields[path]

    def _get(self, kind: str, name: str) -> dict:
        return self.cluster.request("GET", f"/api/v1/namespaces/{self.namespace}/{kind}/{name}")

    def _key(self, ref: dict, kind: str) -> str | None:
        try:
            obj = self._get(kind, ref["name"])
        except urllib.error.HTTPError as e:
            if e.code == 404 and ref.get("optional"):
                return None
            raise PodError(f"{kind[:-1]} {ref['name']} for pod {self.name}: {e.code} {e.reason}") from None
        data = obj.get("data") or {}
        if ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise PodError(f"{kind[:-1]} {ref['name']} has no key {ref['key']!r}")
        return base64.b64decode(data[ref["key"]]).decode() if kind == "secrets" else data[ref["key"]]

    def environment(self) -> dict[str, str]:
        """The process environment: the image's ENV, what the kubelet adds, the container's env."""
        api = urllib.parse.urlsplit(self.cluster.server)
        out = {
            "PATH": f"{BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            **dockerfiles.env(self.dockerfile),
            "HOSTNAME": self.name,
            # The image's home directory does not exist here; the pod's own /tmp stands in for it.
            "HOME": "/tmp",
            "KUBERNETES_SERVICE_HOST": api.hostname,
            "KUBERNETES_SERVICE_PORT": str(api.port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(api.port),
        }
        for source in self.container.get("envFrom") or []:
            kind = "configmaps" if "configMapRef" in source else "secrets"
            ref = source.get("configMapRef") or source["secretRef"]
            data = self._get(kind, ref["name"]).get("data") or {}
            for key, value in data.items():
                out[source.get("prefix", "") + key] = base64.b64decode(value).decode() if kind == "secrets" else value
        for var in self.container.get("env") or []:
            if "value" in var:
                # $(NAME) refers to a variable defined before it.
                out[var["name"]] = _expand(var["value"], out)
                continue
            source = var.get("valueFrom") or {}
            if "fieldRef" in source:
                value = self.field(source["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in source:
                value = self._key(source["configMapKeyRef"], "configmaps")
            elif "secretKeyRef" in source:
                value = self._key(source["secretKeyRef"], "secrets")
            elif not source:
                value = ""
            else:
                raise PodError(f"env {var['name']} of pod {self.name}: {list(source)} is not supported by this runner")
            if value is not None:
                out[var["name"]] = value
        return out

    def _token(self, source: dict) -> str:
        """A TokenRequest for the pod's ServiceAccount, bound to the pod, as the kubelet makes it."""
        account = self.pod["spec"].get("serviceAccountName") or "default"
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": [source["audience"]] if source.get("audience") else [],
            "expirationSeconds": source.get("expirationSeconds", 3607),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.pod["metadata"]["uid"]},
        }}
        answer = self.cluster.request(
            "POST", f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token", request)
        return answer["status"]["token"]

    def _write(self, root: Path, path: str, content: str | bytes, mode: int | None) -> None:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.encode() if isinstance(content, str) else content)
        target.chmod(mode if mode is not None else 0o644)

    def _items(self, root: Path, data: dict, items: list | None, mode: int | None, decode: bool) -> None:
        chosen = items or [{"key": k, "path": k} for k in data]
        for item in chosen:
            if item["key"] not in data:
                raise PodError(f"pod {self.name}: volume item {item['key']!r} is missing from its source")
            value = base64.b64decode(data[item["key"]]) if decode else data[item["key"]]
            self._write(root, item["path"], value, item.get("mode", mode))

    def volume(self, volume: dict) -> tuple[Path, str]:
        """Materialises one volume; returns (directory, how to mount it: bind or tmpfs)."""
        root = self.dir / "volumes" / volume["name"]
        root.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in volume:
            # Empty at the start and gone with the pod: a fresh tmpfs, whatever its medium.
            return root, "tmpfs"
        if "configMap" in volume:
            cm = volume["configMap"]
            self._items(root, self._get("configmaps", cm["name"]).get("data") or {}, cm.get("items"),
                        cm.get("defaultMode"), False)
        elif "secret" in volume:
            sec = volume["secret"]
            self._items(root, self._get("secrets", sec["secretName"]).get("data") or {}, sec.get("items"),
                        sec.get("defaultMode"), True)
        elif "downwardAPI" in volume:
            for item in volume["downwardAPI"]["items"]:
                self._write(root, item["path"], self.field(item["fieldRef"]["fieldPath"]), item.get("mode"))
        elif "projected" in volume:
            mode = volume["projected"].get("defaultMode")
            for source in volume["projected"]["sources"]:
                if "serviceAccountToken" in source:
                    sat = source["serviceAccountToken"]
                    self._write(root, sat["path"], self._token(sat), mode)
                elif "configMap" in source:
                    cm = source["configMap"]
                    self._items(root, self._get("configmaps", cm["name"]).get("data") or {}, cm.get("items"), mode, False)
                elif "secret" in source:
                    sec = source["secret"]
                    self._items(root, self._get("secrets", sec["name"]).get("data") or {}, sec.get("items"), mode, True)
                elif "downwardAPI" in source:
                    for item in source["downwardAPI"]["items"]:
                        self._write(root, item["path"], self.field(item["fieldRef"]["fieldPath"]), item.get("mode", mode))
                else:
                    raise PodError(f"projected source {list(source)} of pod {self.name} is not supported by this runner")
        else:
            kinds = [k for k in volume if k != "name"]
            raise PodError(f"volume {volume['name']} of pod {self.name} ({kinds}) is not supported by this runner")
        return root, "bind"

    def argv(self, env: dict[str, str]) -> list[str]:
        """command/args over the image's ENTRYPOINT/CMD, with Kubernetes' rules and $(VAR) expansion
        from the container's environment `env`."""
        command = self.container.get("command")
        args = self.container.get("args")
        if command:
            argv = command + (args or [])
        else:
            argv = dockerfiles.exec_form(self.dockerfile, "ENTRYPOINT") + (
                args if args is not None else dockerfiles.exec_form(self.dockerfile, "CMD"))
        if not argv:
            raise PodError(f"pod {self.name} has no command and {self.dockerfile} no ENTRYPOINT")
        expanded = [_expand(a, env) for a in argv]
        # 0.0.0.0 is every interface of the pod's own network; here the pod has one address.
        return [a.replace("0.0.0.0", self.ip) for a in expanded]

    # -- running it --------------------------------------------------------------------------------
    def start(self) -> subprocess.Popen:
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        hosts = ["127.0.0.1 localhost", f"{self.ip} {self.name}"]
        hosts += [f"{ip} {' '.join(names)}" for ip, names in self._host_lines().items()]
        (self.dir / "hosts").write_text("\n".join(hosts) + "\n")
        lines = [
            "set -eu",
            f"mkdir -p {self.dir}/etc-upper {self.dir}/etc-work",
            f"mount -t overlay overlay -o lowerdir=/etc,upperdir={self.dir}/etc-upper,workdir={self.dir}/etc-work /etc",
            f"cp {self.dir}/hosts /etc/hosts",
            "mount -t tmpfs -o mode=0755 tmpfs /run",
            f"hostname {shlex.quote(self.name)}",
        ]
        mounted: dict[str, list[str]] = {}
        for mount in self.container.get("volumeMounts") or []:
            target = mount["mountPath"].rstrip("/")
            # Under /etc and /run the mount point is made in the pod's private overlay or tmpfs;
            # elsewhere only an existing directory is mounted over, so the host gains nothing.
            if not (target.startswith(PRIVATE_ROOTS) or os.path.isdir(target)) or target.startswith("/tmp/"):
                raise PodError(f"pod {self.name} mounts {target}: this runner mounts only under "
                               f"{', '.join(PRIVATE_ROOTS)} or over an existing directory other than /tmp/*")
            if mount["name"] not in volumes:
                raise PodError(f"pod {self.name} mounts volume {mount['name']}, which it does not define")
            source, how = self.volume(volumes[mount["name"]])
            if mount.get("subPath"):
                source = source / mount["subPath"]
            steps = [f"mkdir -p {shlex.quote(target)}" if source.is_dir() else
                     f"mkdir -p {shlex.quote(os.path.dirname(target))}; touch {shlex.quote(target)}"]
            if how == "tmpfs":
                steps.append(f"mount -t tmpfs tmpfs {shlex.quote(target)}")
            else:
                steps.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(target)}")
                if mount.get("readOnly"):
                    steps.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
            mounted[target] = steps
        # A container has its own /dev/shm (64 MiB unless the pod mounts one) and its own /tmp.
        mounted.setdefault("/dev/shm", ["mount -t tmpfs -o size=64m tmpfs /dev/shm"])
        own_tmp = mounted.pop("/tmp", ["mount -t tmpfs tmpfs /tmp"])
        for steps in mounted.values():
            lines += steps
        # This runner's files live under the host's /tmp: the pod's /tmp covers it last. Code of
        # the "image" that lives there too is set aside in the pod's /run and put back on top.
        hidden = image_code_under_tmp()
        for i, root in enumerate(hidden):
            lines += [f"mkdir -p /run/image-code-{i}", f"mount --bind {shlex.quote(root)} /run/image-code-{i}"]
        lines += own_tmp
        for i, root in enumerate(hidden):
            lines += [f"mkdir -p {shlex.quote(root)}", f"mount --bind /run/image-code-{i} {shlex.quote(root)}"]
        lines += ["cd /tmp", 'exec "$@"']
        script = self.dir / "start.sh"
        script.write_text("\n".join(lines) + "\n")
        env = self.environment()
        argv = self.argv(env)
        (self.dir / "command.json").write_text(json.dumps(argv))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--uts", "--propagation", "private", "bash", str(script), *argv],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent)
        return self.proc

    def _host_lines(self) -> dict[str, list[str]]:
        by_ip: dict[str, list[str]] = {}
        for name, ip in self.hosts.items():
            by_ip.setdefault(ip, []).append(name)
        return by_ip

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10) -> int | None:
        """SIGTERM, then SIGKILL after the grace period, to the pod's whole process group: whatever
        the container left behind goes with it, as with a container."""
        return None if self.proc is None else stop_group(self.proc, grace)

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _expand(value: str, env: dict[str, str]) -> str:
    """$(NAME) replaced by NAME's value, as the kubelet expands env values, command and args;
    an unknown name stays as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def service_hosts(pods: dict[str, dict], ips: dict[str, str]) -> dict[str, str]:
    """The names cluster DNS gives pods behind a headless Service (`<hostname>.<subdomain>.
    <namespace>.svc[.cluster.local]`, as a StatefulSet sets hostname and subdomain), by pod name
    in `pods`, mapped to each pod's local address in `ips`."""
    out = {}
    for name, pod in pods.items():
        spec = pod["spec"]
        if not (spec.get("hostname") and spec.get("subdomain")):
            raise PodError(f"pod {name} sets no hostname and subdomain: no Service gives it a DNS name")
        base = f"{spec['hostname']}.{spec['subdomain']}.{pod['metadata']['namespace']}"
        for suffix in ("", ".svc", ".svc.cluster.local"):
            out[base + suffix] = ips[name]
    return out
