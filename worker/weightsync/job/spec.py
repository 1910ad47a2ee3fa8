"""A WeightTransferJob as weightsync reads it.

Parsing, defaulting and validating a job (with the CRD's own schema, defaults and CEL rules, so
the local runner refuses what the API server refuses), its typed sections, and the names of every
child object, label and annotation. Nothing here imports torch or the Kubernetes client.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from weightsync.job.schema import apply_defaults, cel_rules, openapi_schema, schema_problems, unknown_fields
from weightsync.job.sizes import size_problems
from weightsync.job.topology import Layout

GROUP = "weightsync.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "WeightTransferJob"
PLURAL = "weighttransferjobs"

LABEL_JOB = f"{GROUP}/job"
LABEL_ROLE = f"{GROUP}/role"
# Set by the StatefulSet controller on every pod; the downward API hands it to the worker.
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"

# What the operator decides once, when it first handles a job, recorded on the job itself: the
# job's controller pod may write only the job's status, so it can change none of these.
ANNOTATION_NETWORK_MODE = f"{GROUP}/network-mode"  # rdma or tcp
ANNOTATION_NETWORK_REASON = f"{GROUP}/network-reason"
ANNOTATION_WORKER_IMAGE = f"{GROUP}/worker-image"  # the default image when the job was created
ANNOTATION_TOKEN_SHA256 = f"{GROUP}/token-sha256"  # proves a restored Secret holds the same token



class SpecError(ValueError):
    """A job that the API server would refuse; the message says what to fix, on one line (it is
    printed by the CLI and becomes a condition's message in a cluster)."""

    def __init__(self, problems: list[str]):
        self.problems = [re.sub(r"\s*\n\s*", " ", p) for p in problems]
        super().__init__("invalid WeightTransferJob: " + "; ".join(self.problems))


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


class KubectlLoader(yaml.SafeLoader):
    """YAML as kubectl reads it: `1e-5` is a number there (Go's YAML, like YAML 1.2), while
    PyYAML's YAML 1.1 makes it a string that the schema would then refuse."""


KubectlLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"),
                                    list("-+0123456789."))


def read_job_file(path: str | os.PathLike) -> Any:
    """The one YAML document of a job file, or a SpecError that says what is wrong with the file:
    it is missing or a directory, not YAML (with the line), or holds several documents."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SpecError([f"{path}: no such file"]) from None
    except IsADirectoryError:
        raise SpecError([f"{path}: is a directory; give the path of one {KIND} YAML file"]) from None
    except UnicodeDecodeError:
        raise SpecError([f"{path}: not a text file (YAML is UTF-8 text)"]) from None
    except OSError as e:
        raise SpecError([f"{path}: cannot be read: {e.strerror}"]) from None
    try:
        documents = [d for d in yaml.load_all(text, Loader=KubectlLoader) if d is not None]
    except yaml.YAMLError as e:
        raise SpecError([f"{path}: not valid YAML{_yaml_problem(e)}"]) from None
    if len(documents) != 1:
        raise SpecError([f"{path}: holds {len(documents)} YAML documents; put exactly one {KIND} in the file"
                         + (" (weightsync runs one job at a time)" if documents else "")])
    return documents[0]


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None) or str(e)
    if "'\\t'" in problem:
        return f"{where}: a tab; YAML indents with spaces only"
    context = getattr(e, "context", None)
    context_mark = getattr(e, "context_mark", None)
    if context and context_mark:
        context = f"{context} that starts at line {context_mark.line + 1}"
    return f"{where}: {problem}" + (f" ({context})" if context else "")


def _model_problems(model: Mapping) -> list[str]:
    """Sizes no model can have, in spec.model.config as written (the worker checks the resolved
    transformers config as well)."""
    config = model.get("config")
    return size_problems(config, "spec.model.config") if isinstance(config, dict) else []




@dataclass(frozen=True)
class Delta:
    """spec.transfer.delta: whether inference ranks that hold the previous version get only what
    changed, and every how many versions every rank gets a whole version anyway."""

    enabled: bool
    full_every: int

    @classmethod
    def from_spec(cls, spec: Mapping) -> "Delta":
        delta = spec["transfer"]["delta"]
        return cls(bool(delta["enabled"]), int(delta["fullEvery"]))


BUILTIN, VLLM = "builtin", "vllm"  # spec.inference.engine
VLLM_PORT = 8000  # spec.inference.vllm.port's default: vLLM's own


@dataclass(frozen=True)
class Serving:
    """spec.inference: which engine the inference ranks run. With vllm, every inference pod runs
    one vLLM OpenAI-compatible server on `port` (the job's Service serves it to clients), started
    with weightsync as its weight-transfer backend and the user's `args` after weightsync's own."""

    engine: str
    port: int
    args: tuple[str, ...]

    @classmethod
    def from_spec(cls, spec: Mapping) -> "Serving":
        inference = spec["inference"]
        vllm = inference.get("vllm") or {}
        return cls(inference.get("engine", BUILTIN), int(vllm.get("port", VLLM_PORT)), tuple(vllm.get("args", ())))

    @property
    def vllm(self) -> bool:
        return self.engine == VLLM


@dataclass(frozen=True)
class Job:
    name: str
    namespace: str
    spec: dict

    @property
    def layout(self) -> Layout:
        return Layout.from_spec(self.spec)

    @property
    def identity(self) -> str:
        """namespace/name: every rendezvous connection is bound to it (with the token)."""
        return f"{self.namespace}/{self.name}"

    @property
    def delta(self) -> Delta:
        return Delta.from_spec(self.spec)

    @property
    def serving(self) -> Serving:
        return Serving.from_spec(self.spec)

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


