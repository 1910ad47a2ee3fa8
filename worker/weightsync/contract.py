"""The job contract, in one place.

Parsing, defaulting and validating a WeightTransferJob (with the CRD's own schema, defaults and
CEL rules, so the local runner refuses what the API server refuses), the ordinal -> role/rank
layout, the names of every child object, and the environment variables and files a pod receives.
The operator renders from this module; the worker and the local runner read from it.
Nothing here imports torch or the Kubernetes client.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from .crdschema import apply_defaults, cel_rules, openapi_schema, schema_problems, unknown_fields
from .sizes import size_problems

GROUP = "weightsync.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "WeightTransferJob"
PLURAL = "weighttransferjobs"

CONTROLLER, TRAINER, INFERENCE = "controller", "trainer", "inference"
ROLES = (CONTROLLER, TRAINER, INFERENCE)
WORKER_ROLES = (TRAINER, INFERENCE)

LABEL_JOB = f"{GROUP}/job"
LABEL_ROLE = f"{GROUP}/role"
# Set by the StatefulSet controller on every pod; the downward API hands it to the worker.
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"

STORE_PORT = 29500  # the controller's rendezvous store
DATA_PORT = 29600  # an inference process listens on DATA_PORT + its local rank
HEALTH_PORT = 29700  # every pod answers its probes here: /healthz (liveness), /readyz (readiness)
# spec.trainer.command: the port of torch.distributed's store among the trainer ranks (torchrun's,
# on trainer rank 0's pod, MASTER_ADDR); the job's own rendezvous is the controller's store.
MASTER_PORT = 29800

# What the operator mounts into every pod, and where.
SPEC_KEY = "job.yaml"  # ConfigMap key: the defaulted job the workers read
TOKEN_KEY = "token"  # Secret key: the per-job secret every connection proves it knows
SPEC_MOUNT = "/etc/weightsync/spec"
TOKEN_MOUNT = "/etc/weightsync/token"
SHM_MOUNT = "/dev/shm"
# The one writable directory of a pod (an emptyDir): the root filesystem is read-only.
TMP_MOUNT = "/tmp"
# Where the worker and its libraries write (home, caches), all under TMP_MOUNT.
WRITABLE_ENV = {
    "HOME": "/tmp",
    "XDG_CACHE_HOME": "/tmp/.cache",
    "HF_HOME": "/tmp/huggingface",
    "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor",
    "TRITON_CACHE_DIR": "/tmp/triton",
    "VLLM_CACHE_ROOT": "/tmp/vllm",
    "PYTHONDONTWRITEBYTECODE": "1",
}
# The worker image's user (Dockerfile.worker): pods that need no root run as it.
WORKER_UID = 10001

# What the operator decides once, when it first handles a job, recorded on the job itself: the
# job's controller pod may write only the job's status, so it can change none of these.
ANNOTATION_NETWORK_MODE = f"{GROUP}/network-mode"  # rdma or tcp
ANNOTATION_NETWORK_REASON = f"{GROUP}/network-reason"
ANNOTATION_WORKER_IMAGE = f"{GROUP}/worker-image"  # the default image when the job was created
ANNOTATION_TOKEN_SHA256 = f"{GROUP}/token-sha256"  # proves a restored Secret holds the same token


class Env:
    """Names of the environment variables a worker pod receives."""

    JOB = "WEIGHTSYNC_JOB"
    NAMESPACE = "WEIGHTSYNC_NAMESPACE"
    ORDINAL = "WEIGHTSYNC_ORDINAL"  # downward API: the pod-index label
    POD_NAME = "WEIGHTSYNC_POD_NAME"
    POD_IP = "WEIGHTSYNC_POD_IP"  # the address other ranks dial
    CONTROLLER_HOST = "WEIGHTSYNC_CONTROLLER_HOST"
    STORE_PORT = "WEIGHTSYNC_STORE_PORT"
    DATA_PORT = "WEIGHTSYNC_DATA_PORT"
    SPEC_FILE = "WEIGHTSYNC_SPEC_FILE"
    TOKEN_FILE = "WEIGHTSYNC_TOKEN_FILE"
    NETWORK_MODE = "WEIGHTSYNC_NETWORK_MODE"  # the resolved mode: rdma or tcp
    COLOCATED = "WEIGHTSYNC_COLOCATED"  # "1": every pod on this machine's same GPUs (`weightsync run --share-gpus`)
    REPORT_TO_KUBERNETES = "WEIGHTSYNC_REPORT_TO_KUBERNETES"  # "1": the controller patches job status
    # Without Kubernetes (`weightsync run`): the file that stands in for the job's status
    # subresource, so that a controller that starts again finds what the one before it reported.
    STATUS_FILE = "WEIGHTSYNC_STATUS_FILE"
    HEALTH_PORT = "WEIGHTSYNC_HEALTH_PORT"
    # spec.inference.engine vllm: the address of the pod's vLLM server that a rank tells the
    # controller (which drives its updates), and the Python that runs vLLM (`weightsync run`:
    # another environment than weightsync's own; in a vLLM image, the image's)
    VLLM_SERVER = "WEIGHTSYNC_VLLM_SERVER"
    VLLM_PYTHON = "WEIGHTSYNC_VLLM_PYTHON"
    VLLM_PORT = "WEIGHTSYNC_VLLM_PORT"  # `weightsync run`: a local pod's own port (in a cluster, spec.inference.vllm.port)


@dataclass(frozen=True)
class Probe:
    """A kubelet probe of a pod's health endpoint (an httpGet), as the operator renders it and as
    the local runner probes its pods: `failure_threshold` failures in a row, each a wrong answer
    or none within `timeout_seconds`, one every `period_seconds`."""

    path: str
    period_seconds: int
    timeout_seconds: int
    failure_threshold: int

    @property
    def deadline(self) -> float:
        """The longest from a pod that stops answering to its last failed probe: the first failing
        probe comes up to one period after it froze, the others one period apart, and the last
        waits out its timeout."""
        return self.period_seconds * self.failure_threshold + self.timeout_seconds


# Liveness: a pod that stops answering (its process stopped, or starved of CPU time for long)
# is killed and restarted within LIVENESS.deadline (25 s); one whose rank process stopped,
# health.STALE_AFTER (10 s) later. Four failures 5 s apart, each given 5 s to answer: a busy node
# (two cores running a whole job were measured holding the controller's answer past 2 s) must not
# get a live pod killed, least of all the controller, whose restart ends the job. The stamps come
# from a thread of their own: a long step, a collective or a garbage collection does not hold
# them up.
LIVENESS = Probe("/healthz", period_seconds=5, timeout_seconds=5, failure_threshold=4)
# Readiness: every rank said it is ready (health.ready()) and is alive. Checked as often as
# liveness; three failures in a row, as the kubelet's default, so that one slow answer does not
# flip the pod (and the job's Ready condition) back and forth.
READINESS = Probe("/readyz", period_seconds=5, timeout_seconds=2, failure_threshold=3)


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


# ---------------------------------------------------------------- the job, its layout, its names


@dataclass(frozen=True)
class Layout:
    """Global ordinals: 0 is the controller, 1..T the trainer pods, T+1..T+I the inference pods.
    Ranks count processes within a role: trainer pod with ordinal o runs trainer ranks
    (o-1)*P .. (o-1)*P+P-1, and likewise for inference from ordinal T+1. Inference ranks form
    model replicas of consecutive ranks, `tensor_parallel[i]` of them for the i-th replica
    (spec.inference.tensorParallelSizes, or tensorParallel for every replica); empty: every
    inference rank is a whole replica."""

    trainers: int
    trainer_procs: int
    inferences: int
    inference_procs: int
    tensor_parallel: tuple[int, ...] = ()

    @classmethod
    def from_spec(cls, spec: Mapping) -> "Layout":
        inference = spec["inference"]
        world = inference["replicas"] * inference["procsPerPod"]
        sizes = inference.get("tensorParallelSizes") or [inference["tensorParallel"]] * (world // inference["tensorParallel"])
        return cls(spec["trainer"]["replicas"], spec["trainer"]["procsPerPod"],
                   inference["replicas"], inference["procsPerPod"], tuple(sizes))

    def tp_group(self, inference_rank: int) -> range:
        """The inference ranks of the model replica `inference_rank` holds a tensor-parallel shard of."""
        first = 0
        for size in self.tensor_parallel:
            if inference_rank < first + size:
                return range(first, first + size)
            first += size
        return range(inference_rank, inference_rank + 1)

    @property
    def sliced(self) -> bool:
        """Whether some inference rank holds tensor-parallel slices rather than the whole model."""
        return any(size > 1 for size in self.tensor_parallel)

    @property
    def pods(self) -> int:
        return 1 + self.trainers + self.inferences

    def replicas(self, role: str) -> int:
        return {CONTROLLER: 1, TRAINER: self.trainers, INFERENCE: self.inferences}[role]

    def procs_per_pod(self, role: str) -> int:
        return {CONTROLLER: 1, TRAINER: self.trainer_procs, INFERENCE: self.inference_procs}[role]

    def first_ordinal(self, role: str) -> int:
        return {CONTROLLER: 0, TRAINER: 1, INFERENCE: 1 + self.trainers}[role]

    def ordinals(self, role: str) -> range:
        start = self.first_ordinal(role)
        return range(start, start + self.replicas(role))

    def role_of(self, ordinal: int) -> str:
        for role in ROLES:
            if ordinal in self.ordinals(role):
                return role
        raise ValueError(f"ordinal {ordinal} is outside this job (0..{self.pods - 1})")

    def ranks_of(self, ordinal: int) -> range:
        """The role ranks of the processes a pod runs."""
        role = self.role_of(ordinal)
        procs = self.procs_per_pod(role)
        first = (ordinal - self.first_ordinal(role)) * procs
        return range(first, first + procs)

    def world_size(self, role: str) -> int:
        return self.replicas(role) * self.procs_per_pod(role)

    def ordinal_of_rank(self, role: str, rank: int) -> int:
        return self.first_ordinal(role) + rank // self.procs_per_pod(role)


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


# ---------------------------------------------------------------- network settings


def network_env(spec: Mapping, mode: str) -> dict[str, str]:
    """NCCL and UCCL settings for a resolved network mode (rdma or tcp)."""
    if mode == "rdma":
        rdma = spec["network"]["rdma"]
        env = {
            "NCCL_IB_DISABLE": "0",
            "NCCL_IB_GID_INDEX": str(rdma["gidIndex"]),
            "NCCL_NET_GDR_LEVEL": rdma["gdrLevel"],
            "NCCL_IB_TC": str(rdma["trafficClass"]),
            "NCCL_IB_SL": str(rdma["serviceLevel"]),
            "UCCL_P2P_RDMA_GID_INDEX": str(rdma["gidIndex"]),
            "UCCL_P2P_RDMA_TC": str(rdma["trafficClass"]),
            "UCCL_P2P_RDMA_SL": str(rdma["serviceLevel"]),
        }
        if rdma.get("hcas"):
            env["NCCL_IB_HCA"] = ",".join(rdma["hcas"])
            env["UCCL_P2P_RDMA_DEV"] = ",".join(rdma["hcas"])
        return env
    if mode == "tcp":
        ifname = spec["network"]["tcp"]["socketIfname"]
        env = {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": ifname}
        # Gloo takes only interface names: it has no "^" exclusion syntax. Without the variable it
        # binds the address the pod's hostname resolves to, which is the pod IP.
        if not ifname.startswith("^"):
            env["GLOO_SOCKET_IFNAME"] = ifname
        return env
    raise ValueError(f"network mode must be resolved to rdma or tcp, not {mode!r}")


# ---------------------------------------------------------------- a user's trainer command


def trainer_command(spec: Mapping) -> list[str]:
    """spec.trainer.command and its args; empty for the built-in trainer."""
    trainer = spec["trainer"]
    return [*trainer["command"], *trainer.get("args", [])] if trainer.get("command") else []


def master_addr(job: "Job") -> str:
    """Where a command's trainer ranks meet (torchrun's MASTER_ADDR): trainer rank 0's pod, by its
    name in the job's headless Service."""
    return f"{job.pod_name(job.layout.first_ordinal(TRAINER))}.{job.service_name}.{job.namespace}.svc"


# What torchrun reads and what it gives the processes it starts; the pod sets them (the others
# are pod-owned as well: a shell's values never reach a pod).
TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                 "LOCAL_WORLD_SIZE")


def torchrun_env(job: "Job", ordinal: int, addr: str, port: int) -> dict[str, str]:
    """The environment a trainer pod's command gets to meet its peers, as torchrun expects it:
    its arguments as PET_* variables (so that a plain `torchrun train.py` starts procsPerPod
    processes and joins the other pods, static rendezvous at addr:port), and, where the pod runs
    one rank, RANK and LOCAL_RANK as torchrun would set them (a plain `python train.py` then calls
    init_process_group() with env://). WORLD_SIZE counts processes, NODE_RANK pods."""
    layout = job.layout
    pods, procs = layout.replicas(TRAINER), layout.procs_per_pod(TRAINER)
    node = ordinal - layout.first_ordinal(TRAINER)
    env = {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(layout.world_size(TRAINER)),
           "NODE_RANK": str(node), "GROUP_RANK": str(node), "LOCAL_WORLD_SIZE": str(procs),
           "PET_NNODES": str(pods), "PET_NPROC_PER_NODE": str(procs), "PET_NODE_RANK": str(node),
           "PET_MASTER_ADDR": addr, "PET_MASTER_PORT": str(port)}
    if procs == 1:
        env.update(RANK=str(node), LOCAL_RANK="0")
    return env


# ---------------------------------------------------------------- what a worker process reads


@dataclass(frozen=True)
class WorkerContext:
    """Everything a worker process learns from its pod: environment variables and mounted files."""

    job: Job
    ordinal: int
    role: str
    pod_ip: str
    controller_host: str
    store_port: int
    data_port: int
    network_mode: str
    token: bytes
    report_to_kubernetes: bool
    health_port: int = HEALTH_PORT
    colocated: bool = False  # every rank of the job on the same GPUs of this machine (transport auto may pick ipc)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "WorkerContext":
        def need(name: str) -> str:
            if not environ.get(name):
                raise SpecError([f"environment variable {name} is not set (the operator sets it in every pod)"])
            return environ[name]

        job = load_job(need(Env.SPEC_FILE), namespace=environ.get(Env.NAMESPACE, "default"), strict=False)
        ordinal = int(need(Env.ORDINAL))
        token = Path(need(Env.TOKEN_FILE)).read_bytes().strip()
        if len(token) < 16:
            raise SpecError([f"the job token in {environ[Env.TOKEN_FILE]} is shorter than 16 bytes"])
        return cls(
            job=job,
            ordinal=ordinal,
            role=job.layout.role_of(ordinal),
            pod_ip=environ.get(Env.POD_IP) or "127.0.0.1",
            controller_host=need(Env.CONTROLLER_HOST),
            store_port=int(environ.get(Env.STORE_PORT, STORE_PORT)),
            data_port=int(environ.get(Env.DATA_PORT, DATA_PORT)),
            network_mode=environ.get(Env.NETWORK_MODE, "tcp"),
            token=token,
            report_to_kubernetes=environ.get(Env.REPORT_TO_KUBERNETES) == "1",
            health_port=int(environ.get(Env.HEALTH_PORT, HEALTH_PORT)),
            colocated=environ.get(Env.COLOCATED) == "1",
        )

    @property
    def ranks(self) -> range:
        return self.job.layout.ranks_of(self.ordinal)
