"""A WeightTransferJob as weightsync reads it.

Parsing, defaulting and validating a job (with the CRD's own schema, defaults and CEL rules, so
the local runner refuses what the API server refuses), the Job that holds its typed sections
(sections.py, role_sections.py), and the names of every child object, label and annotation.
Nothing here imports torch or the Kubernetes client.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from weightsync.job.errors import SpecError
from weightsync.job.role_sections import Inference, Pods, Trainer
from weightsync.job.schema import apply_defaults, cel_rules, openapi_schema, schema_problems, unknown_fields
from weightsync.job.sections import Model, Network, Training, Transfer
from weightsync.job.sizes import size_problems
from weightsync.job.topology import CONTROLLER, INFERENCE, TRAINER, Layout
from weightsync.job.yamlfile import read_document

GROUP = "weightsync.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "WeightTransferJob"
PLURAL = "weighttransferjobs"

LABEL_JOB = f"{GROUP}/job"
LABEL_ROLE = f"{GROUP}/role"
# A job labelled with it waits for Kueue's admission in a cluster (the operator's queueing.py)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Set by the StatefulSet controller on every pod; the downward API hands it to the worker.
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"

# What the operator decides once, when it first handles a job, recorded on the job itself: the
# job's controller pod may write only the job's status, so it can change none of these.
ANNOTATION_NETWORK_MODE = f"{GROUP}/network-mode"  # rdma or tcp
ANNOTATION_NETWORK_REASON = f"{GROUP}/network-reason"
ANNOTATION_WORKER_IMAGE = f"{GROUP}/worker-image"  # the default image when the job was created
ANNOTATION_TOKEN_SHA256 = f"{GROUP}/token-sha256"  # proves a restored Secret holds the same token


def schema() -> dict:
    """The schema of the job contract's version of the CRD."""
    return openapi_schema(VERSION)


def load_job(source: str | os.PathLike | Mapping, namespace: str = "default", *, strict: bool = True) -> "Job":
    """Read a WeightTransferJob (a path or a parsed object), apply the CRD's defaults and refuse
    it, with every problem named, where the API server would. `strict` refuses unknown fields as
    a create or apply does; a job the API server already stored (the spec a pod mounts) is read
    without it, as the API server reads stored objects, so that a worker image older than the CRD
    does not refuse fields it has no use for."""
    obj = copy.deepcopy(dict(source)) if isinstance(source, Mapping) else read_job_file(source)
    if not isinstance(obj, dict):
        raise SpecError([f"expected one {KIND} object, got a YAML {type(obj).__name__}"])
    problems = []
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") != KIND:
        problems.append(f"apiVersion/kind: expected {API_VERSION} {KIND}, got {obj.get('apiVersion')} {obj.get('kind')}")
    obj.setdefault("metadata", {})
    if not isinstance(obj["metadata"], dict):
        problems.append("metadata: must be an object with a name")
    elif not obj["metadata"].get("name"):
        problems.append("metadata.name: required")
    if problems:
        raise SpecError(problems)
    rules = schema()
    unknown = unknown_fields(rules, obj, "") if strict else []
    obj = apply_defaults(rules, obj)
    problems = unknown + schema_problems(rules, obj) or cel_rules(rules, obj, "") or _model_problems(obj["spec"]["model"])
    if problems:
        raise SpecError(problems)
    return Job(name=obj["metadata"]["name"], namespace=obj["metadata"].get("namespace") or namespace, spec=obj["spec"])


def read_job_file(path: str | os.PathLike) -> Any:
    """The one YAML document of a job file, read as kubectl reads it, or a SpecError that says
    what is wrong with the file (yamlfile.py)."""
    return read_document(path, KIND)


def _model_problems(model: Mapping) -> list[str]:
    """Sizes no model can have, in spec.model.config as written (the worker checks the resolved
    transformers config as well)."""
    config = model.get("config")
    return size_problems(config, "spec.model.config") if isinstance(config, dict) else []


def _read() -> Any:
    """A field of Job read from its spec (so equal specs make equal jobs)."""
    return field(init=False, repr=False, compare=False)


@dataclass(frozen=True)
class Job:
    """A WeightTransferJob as weightsync reads it: its name, its defaulted spec, and the spec's
    typed sections, read from it once. The spec itself is what the ConfigMap holds; read a value
    from the sections (job.transfer.bucket_bytes, job.trainer.replicas), never from the spec."""

    name: str
    namespace: str
    spec: dict
    """The defaulted spec, as the CRD's schema shapes it."""
    model: Model = _read()
    controller: Pods = _read()
    trainer: Trainer = _read()
    inference: Inference = _read()
    training: Training = _read()
    transfer: Transfer = _read()
    network: Network = _read()
    image: str | None = _read()
    """spec.image: the image of every pod whose role names none; unset, the operator's default."""
    image_pull_policy: str = _read()
    image_pull_secrets: tuple[str, ...] = _read()
    """The names of the Secrets every pod pulls its image with."""
    layout: Layout = _read()
    """The ordinal -> role/rank layout."""

    def __post_init__(self) -> None:
        spec = self.spec
        trainer, inference = Trainer.read(spec["trainer"]), Inference.read(spec["inference"])
        sections = {
            "model": Model.read(spec["model"]),
            "controller": Pods(**Pods.common(spec["controller"])),  # one pod, one process, no GPU
            "trainer": trainer,
            "inference": inference,
            "training": Training.read(spec["training"]),
            "transfer": Transfer.read(spec["transfer"]),
            "network": Network.read(spec["network"]),
            "image": spec.get("image"),
            "image_pull_policy": spec["imagePullPolicy"],
            "image_pull_secrets": tuple(s["name"] for s in spec.get("imagePullSecrets") or ()),
            "layout": Layout(trainer.replicas, trainer.procs_per_pod, inference.capacity,
                             max(inference.model_replicas) if inference.runs_vllm else inference.procs_per_pod,
                             inference.model_replicas, servers=inference.runs_vllm),
        }
        for name, value in sections.items():
            object.__setattr__(self, name, value)

    def pods(self, role: str) -> Pods:
        """The section of a role (controller, trainer or inference)."""
        return {CONTROLLER: self.controller, TRAINER: self.trainer, INFERENCE: self.inference}[role]

    def running_pods(self, role: str) -> int:
        """The pods a role runs now: the layout's, but for inference spec.inference.replicas,
        which may be fewer than the layout holds ranks for (spec.inference.maxReplicas)."""
        return self.inference.replicas if role == INFERENCE else self.layout.replicas(role)

    @property
    def suspended(self) -> bool:
        """spec.suspend: the job runs no pods until it is false."""
        return bool(self.spec.get("suspend"))

    @property
    def identity(self) -> str:
        """namespace/name: every rendezvous connection is bound to it (with the token)."""
        return f"{self.namespace}/{self.name}"

    def to_object(self) -> dict:
        """The defaulted job as the workers read it (the ConfigMap's content)."""
        return {"apiVersion": API_VERSION, "kind": KIND,
                "metadata": {"name": self.name, "namespace": self.namespace}, "spec": self.spec}

    # children
    def child_name(self, role: str) -> str:
        return f"{self.name}-{role}"

    @property
    def service_name(self) -> str:
        return self.name

    @property
    def vllm_service_name(self) -> str:
        """spec.inference.engine vllm: the Service of the vLLM servers' OpenAI API."""
        return f"{self.name}-vllm"

    @property
    def secret_name(self) -> str:
        return f"{self.name}-token"

    @property
    def join_secret_name(self) -> str:
        """What an external rank needs to join (job/join.py's variables), for envFrom."""
        return f"{self.name}-join"

    @property
    def configmap_name(self) -> str:
        return f"{self.name}-spec"

    @property
    def service_account_name(self) -> str:
        """The controller pod's identity: allowed to patch this job's status, nothing else."""
        return f"{self.name}-controller"

    def pod_name(self, ordinal: int) -> str:
        return f"{self.child_name(self.layout.role_of(ordinal))}-{ordinal}"

    @property
    def controller_host(self) -> str:
        return f"{self.pod_name(0)}.{self.service_name}.{self.namespace}.svc"

    def labels(self, role: str | None = None) -> dict[str, str]:
        labels = {"app.kubernetes.io/name": "weightsync", "app.kubernetes.io/instance": self.name, LABEL_JOB: self.name}
        if role:
            labels[LABEL_ROLE] = role
        return labels
