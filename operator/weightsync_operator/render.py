"""A WeightTransferJob's children as manifests: pure functions of the defaulted job, what the
operator decided for it once (network mode, default image, token) and where it stands (running,
finished). Ownership (kopf.adopt) and the API calls are the handlers' business."""

from __future__ import annotations

import base64
import copy
import hashlib
import os
from typing import Mapping

import weightsync
from weightsync.job import (
    CONTROLLER,
    DATA_PORT,
    GROUP,
    HEALTH_PORT,
    INFERENCE,
    LIVENESS,
    MASTER_PORT,
    PLURAL,
    POD_INDEX_LABEL,
    READINESS,
    ROLES,
    SHM_MOUNT,
    SPEC_KEY,
    SPEC_MOUNT,
    STARTUP,
    STORE_PORT,
    TMP_MOUNT,
    TOKEN_KEY,
    TOKEN_MOUNT,
    TRAINER,
    WRITABLE_ENV,
    Job,
    PodSite,
    PodTemplate,
    Probe,
    SpecError,
    ValueFrom,
    dump_document,
    master_addr,
    pod_env,
    pod_template_problems,
)
from weightsync.job.join import external_roles, join_env
from weightsync_operator.queueing import Placement
from weightsync_operator.security import container_security, pod_security

GPU_RESOURCE = "nvidia.com/gpu"
MULTUS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
SPEC_HASH_ANNOTATION = f"{GROUP}/spec-hash"
CONTAINER = "worker"
HEALTH_PORT_NAME = "health"
METRICS_PATH = "/metrics"  # served beside the probes (weightsync.runtime.health): the pod's Prometheus metrics
VLLM_PORT_NAME = "vllm"
WORKER_COMMAND = ["weightsync", "worker"]
MODES = ("rdma", "tcp")
# A role's fields that only place, size or pull its pods (spec_hash)
POD_ONLY_FIELDS = ("resources", "nodeSelector", "tolerations", "image")
# The image of jobs that name none: the chart sets it (value workerImage) in the operator's pod.
DEFAULT_WORKER_IMAGE_ENV = "WEIGHTSYNC_DEFAULT_WORKER_IMAGE"
FALLBACK_WORKER_IMAGE = f"ghcr.io/weightsync/worker:{weightsync.__version__}"


def default_worker_image() -> str:
    """The image of jobs created now that name none (recorded on each job when it is created)."""
    return os.environ.get(DEFAULT_WORKER_IMAGE_ENV) or FALLBACK_WORKER_IMAGE


def worker_image(job: Job, recorded: str | None = None) -> str:
    """The job's own image, else the default recorded when the job was created."""
    return job.image or recorded or default_worker_image()


def children(job: Job, mode: str, token: str, *, image: str | None = None, stopped: bool = False,
             running: bool = False, placements: Mapping[str, Placement] | None = None) -> list[dict]:
    """Every object the job owns, in creation order (what the pods mount comes before the pods).
    `image`: the default image recorded for the job; `stopped`: the controller reported
    completion, or the job is suspended, so the StatefulSets run no pods; `running`: the job runs,
    so no change of a pod template may replace its pods; `placements`: role -> where the job's
    Kueue admission puts its pods (queueing.py). A role the user runs (spec.<role>.external) gets no
    StatefulSet: its processes join with the Secret "<job>-join" instead."""
    external = external_roles(job)
    return [
        service(job),
        *([vllm_service(job)] if job.inference.runs_vllm else []),
        secret(job, token),
        *([join_secret(job, token)] if external else []),
        configmap(job),
        service_account(job),
        role(job),
        role_binding(job),
        *(statefulset(job, r, mode, image=image, stopped=stopped, running=running,
                      placement=(placements or {}).get(r))
          for r in ROLES if r not in external),
    ]


def _meta(job: Job, name: str, role: str | None = None) -> dict:
    return {"name": name, "namespace": job.namespace, "labels": job.labels(role)}


def spec_document(job: Job) -> str:
    """The ConfigMap content: the defaulted job, as the workers load it."""
    return dump_document(job.to_object())


def service(job: Job) -> dict:
    # Headless, and publishing addresses of pods that are not ready: ranks must resolve each
    # other while they rendezvous, which happens before any of them is ready.
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, job.service_name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": job.labels(),
            "ports": [
                {"name": "store", "port": STORE_PORT, "targetPort": STORE_PORT, "protocol": "TCP"},
                {"name": "data", "port": DATA_PORT, "targetPort": DATA_PORT, "protocol": "TCP"},
            ],
        },
    }


def vllm_service(job: Job) -> dict:
    """spec.inference.engine vllm: where clients reach the vLLM servers (their OpenAI API). Only
    ready pods are behind it: a server is ready once it serves a version weightsync delivered."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, job.vllm_service_name, INFERENCE),
        "spec": {
            "selector": job.labels(INFERENCE),
            "ports": [{"name": VLLM_PORT_NAME, "port": job.inference.vllm.port, "targetPort": VLLM_PORT_NAME, "protocol": "TCP"}],
        },
    }


def secret(job: Job, token: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(job, job.secret_name),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def join_secret(job: Job, token: str) -> dict:
    """What a process of an external role needs to join the job (job/join.py's three variables),
    for `envFrom: [{secretRef: {name: <job>-join}}]`: the controller's store at the address the
    job's own pods dial (its pod's name under the job's headless Service, which resolves for any
    pod of the cluster), the job's identity and its token, the token Secret's own."""
    values = join_env(job, job.controller_host, STORE_PORT, token.encode())
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(job, job.join_secret_name),
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(values.items())},
    }


def configmap(job: Job) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, job.configmap_name),
        "data": {SPEC_KEY: spec_document(job)},
    }


def service_account(job: Job) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(job, job.service_account_name, CONTROLLER),
        "automountServiceAccountToken": True,
    }


def role(job: Job) -> dict:
    """The controller pod may read its own job and patch its status: nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(job, job.service_account_name, CONTROLLER),
        "rules": [
            {"apiGroups": [GROUP], "resources": [PLURAL],
             "resourceNames": [job.name], "verbs": ["get"]},
            {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"],
             "resourceNames": [job.name], "verbs": ["get", "patch"]},
        ],
    }


def role_binding(job: Job) -> dict:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(job, job.service_account_name, CONTROLLER),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": job.service_account_name},
        "subjects": [{"kind": "ServiceAccount", "name": job.service_account_name, "namespace": job.namespace}],
    }


def statefulset(job: Job, role: str, mode: str, *, image: str | None = None, stopped: bool = False,
                running: bool = False, placement: Placement | None = None) -> dict:
    layout = job.layout
    # Until the job runs, a changed spec replaces its pods (they have not started the job yet: a
    # pod that cannot be scheduled takes the fixed template). Once it runs, the CRD refuses spec
    # changes but the inference pods' count (up to spec.inference.maxReplicas, which the layout
    # holds ranks for), and a template that changes anyway (a new operator version renders
    # differently) reaches only pods created later: the running ones are never replaced.
    strategy = {"type": "OnDelete"} if running else {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}
    template = pod_template(job, role, mode, image)
    if placement is not None:  # Kueue's admission: its flavors' node labels win, their tolerations add
        pod = template["spec"]
        if placement.node_selector:
            pod["nodeSelector"] = {**pod.get("nodeSelector", {}), **placement.node_selector}
        if placement.tolerations:
            pod["tolerations"] = [*pod.get("tolerations", []),
                                  *(dict(t) for t in placement.tolerations if t not in pod.get("tolerations", []))]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(job, job.child_name(role), role),
        "spec": {
            "replicas": 0 if stopped else job.running_pods(role),
            "ordinals": {"start": layout.first_ordinal(role)},
            "serviceName": job.service_name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": job.labels(role)},
            "updateStrategy": strategy,
            "template": template,
        },
    }


def pod_template(job: Job, role: str, mode: str, image: str | None = None) -> dict:
    if mode not in MODES:
        raise ValueError(f"network mode must be resolved to one of {MODES} before rendering, not {mode!r}")
    pods = job.pods(role)
    template = pods.pod_template
    problems = pod_template_problems(job.spec[role].get("podTemplate"), job.spec[role],
                                              job.trainer.env if role == TRAINER else {})
    if problems:
        raise SpecError([f"spec.{role}.{p}" for p in problems])
    worker = role != CONTROLLER
    rdma = worker and mode == "rdma"
    host_network = on_host_network(job, role, mode)
    procs = job.layout.procs_per_pod(role)

    volumes = [
        {"name": "spec", "configMap": {"name": job.configmap_name}},
        {"name": "token", "secret": {"secretName": job.secret_name}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [
        {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
        {"name": "token", "mountPath": TOKEN_MOUNT, "readOnly": True},
        {"name": "tmp", "mountPath": TMP_MOUNT},
    ]
    # RDMA registers pinned buffers, and NCCL (and vLLM, between its server, engine and workers)
    # moves data between the processes of one pod through /dev/shm; the container runtime's
    # default /dev/shm is 64 MiB.
    if rdma or (worker and procs > 1) or (role == INFERENCE and job.inference.runs_vllm):
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": SHM_MOUNT})
    volumes += [copy.deepcopy(dict(v)) for v in template.volumes]
    mounts += [copy.deepcopy(dict(m)) for m in template.volume_mounts]

    container = {
        "name": CONTAINER,
        "image": pods.image or worker_image(job, image),
        "imagePullPolicy": job.image_pull_policy,
        "command": list(WORKER_COMMAND),
        "env": with_template_env(env(job, role, mode), template),
        "ports": ports(job, role, health=not host_network),
        "volumeMounts": mounts,
        "securityContext": container_security(rdma),
    }
    if not host_network:
        container["startupProbe"] = probe(STARTUP)
        container["livenessProbe"] = probe(LIVENESS)
        container["readinessProbe"] = probe(READINESS)
    if template.env_from:
        container["envFrom"] = copy.deepcopy(list(template.env_from))
    res = resources(job, role, mode)
    if res:
        container["resources"] = res

    pod: dict = {
        "securityContext": pod_security(rdma),
        "containers": [container],
        "volumes": volumes,
        "enableServiceLinks": False,
    }
    if worker:
        pod["automountServiceAccountToken"] = False
    else:
        pod["serviceAccountName"] = job.service_account_name
        pod["automountServiceAccountToken"] = True
    if host_network:
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    placed = copy.deepcopy(dict(template.scheduling))
    if pods.node_selector or "nodeSelector" in placed:
        pod["nodeSelector"] = {**pods.node_selector, **placed.pop("nodeSelector", {})}
    if pods.tolerations or "tolerations" in placed:
        pod["tolerations"] = [*copy.deepcopy(list(pods.tolerations)), *placed.pop("tolerations", [])]
    pulls = [*job.image_pull_secrets, *(s["name"] for s in placed.pop("imagePullSecrets", []))]
    if pulls:
        pod["imagePullSecrets"] = [{"name": name} for name in dict.fromkeys(pulls)]
    pod.update(placed)  # affinity, topologySpreadConstraints, priorityClassName, schedulerName, runtimeClassName

    annotations = {**template.annotations, SPEC_HASH_ANNOTATION: spec_hash(job)}
    if rdma and job.network.rdma.networks:
        annotations[MULTUS_ANNOTATION] = job.network.rdma.networks
    if not host_network:  # where the pod serves its metrics, for a Prometheus that discovers pods by annotation
        annotations.update({"prometheus.io/scrape": "true", "prometheus.io/port": str(HEALTH_PORT),
                            "prometheus.io/path": METRICS_PATH})
    return {"metadata": {"labels": {**template.labels, **job.labels(role)}, "annotations": annotations}, "spec": pod}


def with_template_env(base: list[dict], template: PodTemplate) -> list[dict]:
    """The job's variables, then the podTemplate's: one that names a default of the job's
    (WRITABLE_ENV: HOME, HF_HOME, the caches) takes its place; the others, which the CRD
    keeps clear of the job's names, follow in the template's order."""
    env = {var["name"]: var for var in base}
    for var in template.env:
        env[var.name] = var.manifest()  # in place of a default; a new name goes last
    return list(env.values())


def spec_hash(job: Job) -> str:
    """What every role's pods read of the spec, hashed into their template: pods of every role
    must read the same spec, so a change rolls all of them. Except the fields that only place,
    size or pull a role's pods (POD_ONLY_FIELDS): its own template carries them, so an edit of
    one replaces that role's pods alone; so do a podTemplate's metadata, scheduling fields and
    container resources, while its volumes and env, which the processes read, are hashed. Fixing
    the resources of a Pending job's trainers thus leaves the controller, and the rendezvous it
    hosts, alone. So does scaling the inference pods under spec.inference.maxReplicas: their
    layout is maxReplicas', whatever their count."""
    spec = copy.deepcopy(dict(job.spec))
    spec.pop("imagePullSecrets", None)
    spec.pop("suspend", None)  # a suspended job runs no pods, and a resumed one new pods anyway
    if job.inference.max_replicas is not None:  # the layout is maxReplicas' whatever the pods' count
        spec["inference"].pop("replicas", None)
    for role in ROLES:
        section = spec.get(role) or {}
        for name in POD_ONLY_FIELDS:
            section.pop(name, None)
        # What the processes read of a podTemplate stays: its volumes, env, envFrom and mounts.
        template = (section.pop("podTemplate", None) or {}).get("spec") or {}
        read = {"volumes": template.get("volumes"),
                "containers": [{k: c[k] for k in ("name", "env", "envFrom", "volumeMounts") if c.get(k)}
                               for c in template.get("containers") or () if set(c) & {"env", "envFrom", "volumeMounts"}]}
        if any(read.values()):
            section["podTemplate"] = {"spec": {k: v for k, v in read.items() if v}}
    return hashlib.sha256(dump_document(spec).encode()).hexdigest()[:16]


def env(job: Job, role: str, mode: str) -> list[dict]:
    """The pod's environment (pod_env), as its template gives it: one template for every
    pod of the role, so each learns its ordinal, name and address through the downward API."""
    site = PodSite(
        namespace=ValueFrom.field("metadata.namespace"),
        ordinal=ValueFrom.field(f"metadata.labels['{POD_INDEX_LABEL}']"),
        pod_name=ValueFrom.field("metadata.name"),
        pod_ip=ValueFrom.field("status.podIP"),
        controller_host=job.controller_host,
        store_port=STORE_PORT,
        data_port=DATA_PORT,
        health_port=0 if on_host_network(job, role, mode) else HEALTH_PORT,
        spec_file=f"{SPEC_MOUNT}/{SPEC_KEY}",
        token_file=f"{TOKEN_MOUNT}/{TOKEN_KEY}",
        master_addr=master_addr(job),
        master_port=MASTER_PORT,
        report_to_kubernetes=True,
        writable=WRITABLE_ENV,
    )
    return [{"name": name, "valueFrom": copy.deepcopy(dict(value.source))} if isinstance(value, ValueFrom)
            else {"name": name, "value": value} for name, value in pod_env(job, role, mode, site).items()]


def on_host_network(job: Job, role: str, mode: str) -> bool:
    """Worker pods of rdma jobs may share the node's network. Those get no health port and no
    probes: every pod on a node would need the same port, so pods of one job could not share a
    node; their frozen ranks are still found by the controller's heartbeats."""
    return role != CONTROLLER and mode == "rdma" and job.network.rdma.host_network


def ports(job: Job, role: str, health: bool = True) -> list[dict]:
    health = [{"name": HEALTH_PORT_NAME, "containerPort": HEALTH_PORT, "protocol": "TCP"}] if health else []
    if role == CONTROLLER:
        return [{"name": "store", "containerPort": STORE_PORT, "protocol": "TCP"}, *health]
    if role == INFERENCE:
        server = ([{"name": VLLM_PORT_NAME, "containerPort": job.inference.vllm.port, "protocol": "TCP"}]
                  if job.inference.runs_vllm else [])
        return [*({"name": f"data-{i}", "containerPort": DATA_PORT + i, "protocol": "TCP"}
                  for i in range(job.layout.procs_per_pod(role))), *server, *health]
    if job.trainer.command:
        return [{"name": "torch", "containerPort": MASTER_PORT, "protocol": "TCP"}, *health]
    return health


def probe(spec: Probe) -> dict:
    """A kubelet probe of the worker's health endpoint (weightsync.runtime.health), with the numbers the
    local runner probes with too."""
    return {"httpGet": {"path": spec.path, "port": HEALTH_PORT_NAME, "scheme": "HTTP"},
            "periodSeconds": spec.period_seconds, "timeoutSeconds": spec.timeout_seconds,
            "failureThreshold": spec.failure_threshold}


def resources(job: Job, role: str, mode: str) -> dict:
    """The role's resources from the spec, plus the GPUs its processes need and, for rdma, the
    RDMA device: each only where the spec does not name that resource itself. The controller
    asks for neither."""
    pods = job.pods(role)
    given = pods.resources or pods.pod_template.resources  # the CRD refuses both
    out = {k: dict(given[k]) for k in ("limits", "requests") if given.get(k)}
    if role == CONTROLLER:
        return out
    extra = {}
    if pods.gpus:
        extra[GPU_RESOURCE] = str(pods.gpus)
    if mode == "rdma":
        rdma = job.network.rdma
        extra[rdma.resource_name] = str(rdma.resource_count)
    for name, count in extra.items():
        if any(name in out.get(k, {}) for k in ("limits", "requests")):
            continue
        # Extended resources cannot be overcommitted: requests must equal limits.
        out.setdefault("limits", {})[name] = count
        out.setdefault("requests", {})[name] = count
    return out
