"""spec.<role>.podTemplate: what a user adds to a role's pods, and what of the pods stays the job's.

GPU clusters need volumes (a checkpoint on a PVC for spec.model.path), environment variables
(NCCL_DEBUG, VLLM_*, HF_HOME), affinity, topology spread, priority classes and labels of their own;
JobSet and LeaderWorkerSet take them as a pod template, and so does a job's role. The template is
partial: the CRD's schema lists only the fields a user may add (the API server prunes or, with
strict field validation, refuses the rest, naming the field), and its CEL rules refuse the names
the job sets itself. The reserved names below are those rules' own; the operator's render checks
them again (pod_template_problems), so a template that reached it past an older CRD is still
refused, never merged over the job's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

CONTAINER = "worker"  # the one container of every pod (the operator's render names it)

# Labels the job and its StatefulSets select and name pods by.
RESERVED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "apps.kubernetes.io/pod-index",
                   "statefulset.kubernetes.io/pod-name", "controller-revision-hash")
RESERVED_LABEL_PREFIXES = ("weightsync.io/",)
# Annotations the operator sets: the spec hash, where the pod serves its metrics, the Multus networks.
RESERVED_ANNOTATIONS = ("k8s.v1.cni.cncf.io/networks",)
RESERVED_ANNOTATION_PREFIXES = ("weightsync.io/", "prometheus.io/")
# The job's own volumes and where its container mounts them (pod.py's SPEC_MOUNT, TOKEN_MOUNT,
# TMP_MOUNT, SHM_MOUNT).
RESERVED_VOLUMES = ("spec", "token", "tmp", "dshm")
# Volume sources the chart's admission policy refuses in the operator's pods: no host path, no
# Secret but the job's token (a Secret's keys reach the container through env instead).
REFUSED_VOLUME_SOURCES = ("hostPath", "secret", "projected")
RESERVED_MOUNT_PATHS = ("/tmp", "/tmp/", "/etc/weightsync/spec", "/etc/weightsync/token", "/dev/shm")
# Variables the job sets from its spec: the pod's contract, the network's settings (pod.network_env,
# from spec.network) and where a trainer command's ranks meet (pod.TORCHRUN_VARS). The writable
# places (pod.WRITABLE_ENV: HOME, HF_HOME, the caches) are defaults a template's env replaces.
RESERVED_ENV_PREFIX = "WEIGHTSYNC_"
NETWORK_ENV = ("NCCL_IB_DISABLE", "NCCL_IB_GID_INDEX", "NCCL_NET_GDR_LEVEL", "NCCL_IB_TC", "NCCL_IB_SL", "NCCL_IB_HCA",
               "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "UCCL_P2P_RDMA_GID_INDEX", "UCCL_P2P_RDMA_TC",
               "UCCL_P2P_RDMA_SL", "UCCL_P2P_RDMA_DEV")
TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                "LOCAL_WORLD_SIZE")

# The template's pod fields that only place its pods or pull their image, by their Kubernetes
# names; volumes are read by the processes (a mounted checkpoint), so they are not among them.
SCHEDULING_FIELDS = ("nodeSelector", "affinity", "tolerations", "topologySpreadConstraints", "priorityClassName",
                     "schedulerName", "runtimeClassName", "imagePullSecrets")


@dataclass(frozen=True)
class EnvVar:
    """One variable of the worker container's env, as a Kubernetes EnvVar: a value, or where
    Kubernetes takes it from when the pod starts (valueFrom, passed through as written)."""

    name: str
    value: str | None = None
    value_from: Mapping[str, Any] | None = None

    def manifest(self) -> dict:
        return {"name": self.name, "valueFrom": dict(self.value_from)} if self.value_from is not None \
            else {"name": self.name, "value": self.value or ""}


@dataclass(frozen=True, kw_only=True)
class PodTemplate:
    """spec.<role>.podTemplate, read from the spec: Kubernetes objects inside it (volumes,
    affinity, tolerations, envFrom, volumeMounts) pass through to the pods as written."""

    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    volumes: tuple[Mapping[str, Any], ...] = ()
    scheduling: Mapping[str, Any] = field(default_factory=dict)
    """The pod's SCHEDULING_FIELDS the template sets, by their Kubernetes names."""
    env: tuple[EnvVar, ...] = ()
    """The worker container's variables, after the job's own."""
    env_from: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    resources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The worker container's resources (instead of spec.<role>.resources: the CRD refuses both)."""

    @classmethod
    def read(cls, template: Mapping | None) -> "PodTemplate":
        template = template or {}
        meta, spec = template.get("metadata") or {}, template.get("spec") or {}
        worker = next((c for c in spec.get("containers") or () if c.get("name") == CONTAINER), {})
        return cls(labels=dict(meta.get("labels") or {}), annotations=dict(meta.get("annotations") or {}),
                   volumes=tuple(spec.get("volumes") or ()),
                   scheduling={k: spec[k] for k in SCHEDULING_FIELDS if spec.get(k)},
                   env=tuple(EnvVar(v["name"], v.get("value"), v.get("valueFrom")) for v in worker.get("env") or ()),
                   env_from=tuple(worker.get("envFrom") or ()), volume_mounts=tuple(worker.get("volumeMounts") or ()),
                   resources=dict(worker.get("resources") or {}))

    @property
    def empty(self) -> bool:
        return self == PodTemplate()

    def unresolved_env(self) -> list[str]:
        """Where the worker container's variables come from the cluster (valueFrom, envFrom): what
        a run without Kubernetes cannot resolve, one line each."""
        return ([f"env {v.name}: valueFrom ({', '.join(v.value_from)}) needs Kubernetes to resolve it"
                 for v in self.env if v.value_from is not None]
                + [f"envFrom[{i}] ({', '.join(source)}) needs Kubernetes to resolve it"
                   for i, source in enumerate(self.env_from)])

    def cluster_only(self) -> list[str]:
        """The template's fields that only pods in a cluster have (labels, volumes, scheduling,
        resources), by their paths in the template."""
        fields = [("metadata.labels", self.labels), ("metadata.annotations", self.annotations),
                  ("spec.volumes", self.volumes), *((f"spec.{k}", v) for k, v in self.scheduling.items()),
                  ("spec.containers[worker].volumeMounts", self.volume_mounts),
                  ("spec.containers[worker].resources", self.resources)]
        return [path for path, value in fields if value]


def pod_template_problems(template: Mapping | None, section: Mapping, command_env: Mapping = {}) -> list[str]:
    """What the CRD's rules refuse in a role's podTemplate (`section`: the role's spec section;
    `command_env`: spec.trainer.env's variables), as "podTemplate...: what to fix" lines."""
    template = template or {}
    meta, spec = template.get("metadata") or {}, template.get("spec") or {}
    problems = [f"podTemplate.metadata.labels: {k} is the job's own label" for k in meta.get("labels") or {}
                if k in RESERVED_LABELS or k.startswith(RESERVED_LABEL_PREFIXES)]
    problems += [f"podTemplate.metadata.annotations: {k} is the job's own annotation" for k in meta.get("annotations") or {}
                 if k in RESERVED_ANNOTATIONS or k.startswith(RESERVED_ANNOTATION_PREFIXES)]
    volumes = [v.get("name") for v in spec.get("volumes") or ()]
    problems += [f"podTemplate.spec.volumes: {name} is the job's own volume; give yours another name"
                 for name in volumes if name in RESERVED_VOLUMES]
    problems += [f"podTemplate.spec.volumes: {v.get('name')} is a {kind} volume, which the job's pods may not mount"
                 for v in spec.get("volumes") or () for kind in REFUSED_VOLUME_SOURCES if kind in v]
    clashing = sorted(set(spec.get("nodeSelector") or {}) & set(section.get("nodeSelector") or {}))
    problems += [f"podTemplate.spec.nodeSelector: {k} is set in the role's nodeSelector too" for k in clashing]
    for container in spec.get("containers") or ():
        if container.get("name") != CONTAINER:
            problems.append(f"podTemplate.spec.containers: {container.get('name')!r} is not the job's container "
                            f"(the pods run one, named {CONTAINER})")
            continue
        for var in container.get("env") or ():
            name = var.get("name", "")
            if name.startswith(RESERVED_ENV_PREFIX) or name in NETWORK_ENV or name in TORCHRUN_ENV:
                problems.append(f"podTemplate env: {name} is set by the job itself")
            elif name in command_env:
                problems.append(f"podTemplate env: {name} is set in spec.trainer.env too")
        for mount in container.get("volumeMounts") or ():
            if mount.get("name") not in volumes:
                problems.append(f"podTemplate volumeMounts: {mount.get('name')} is not a volume of podTemplate.spec.volumes")
            if mount.get("mountPath") in RESERVED_MOUNT_PATHS:
                problems.append(f"podTemplate volumeMounts: {mount.get('mountPath')} is the job's own mount")
        if container.get("resources") and section.get("resources"):
            problems.append("podTemplate resources: the role's resources are set in spec.<role>.resources too")
    return problems
