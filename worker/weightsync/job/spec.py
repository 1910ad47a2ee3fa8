"""A WeightTransferJob as weightsync reads it.

Parsing, defaulting and validating a job (with the CRD's own schema, defaults and CEL rules, so
the local runner refuses what the API server refuses), its typed sections, and the names of every
child object, label and annotation. Nothing here imports torch or the Kubernetes client.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from weightsync.job.errors import SpecError
from weightsync.job.podtemplate import PodTemplate
from weightsync.job.schema import apply_defaults, cel_rules, openapi_schema, schema_problems, unknown_fields
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


# ---------------------------------------------------------------- the spec's typed sections
# Each section of the spec as a frozen dataclass, read once from the defaulted spec (Job, below):
# the CRD stays the one schema (types, defaults, limits, rules); these say what each value means
# to the code that reads it, and derive what several readers would otherwise compute each.


@dataclass(frozen=True)
class Lora:
    """spec.model.lora: a LoRA adapter over the base model, what every version carries."""

    rank: int
    """The adapter's rank r (PEFT's LoraConfig.r)."""
    alpha: float
    """PEFT's lora_alpha: each target weight W runs as W + (alpha / rank) B A."""
    target_modules: tuple[str, ...]
    """The last name of every linear layer that carries the adapter (PEFT's target_modules)."""
    name: str = "adapter"
    """The name a vLLM server serves the adapter under."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def targets(self, module_name: str) -> bool:
        """Whether the module of that name carries the adapter (its last name is a target)."""
        return module_name.rpartition(".")[2] in self.target_modules

    @classmethod
    def read(cls, lora: Mapping | None) -> "Lora | None":
        if lora is None:
            return None
        return cls(rank=int(lora["rank"]), alpha=float(lora["alpha"]), target_modules=tuple(lora["targetModules"]),
                   name=lora["name"])


@dataclass(frozen=True)
class Model:
    """spec.model: the causal LM every role holds. Exactly one of `config` and `path` is set."""

    config: Mapping[str, Any] | None = None
    """A transformers config (model_type plus its fields): weights are randomly initialised from
    spec.training.seed, nothing is downloaded."""
    path: str | None = None
    """An absolute path, inside every pod, to a checkpoint directory (config.json plus weights)."""
    dtype: str = "bfloat16"
    """The dtype inference ranks receive and run the weights in (float32, bfloat16, float16)."""
    quantization: str | None = None
    """The quantized format inference serves (int8: per-channel W8A8, vLLM's compressed-tensors
    layout; fp8: 128x128 block-scaled e4m3 with inverse scales, DeepSeek-V3's), in which the trainers
    send the linear layers' weights with their scales (model/quant.py); None: unquantized."""
    lora: Lora | None = None
    """Versions carry this LoRA adapter alone, over base weights every rank loads itself."""

    @classmethod
    def read(cls, model: Mapping) -> "Model":
        return cls(config=model.get("config"), path=model.get("path"), dtype=model["dtype"],
                   quantization=model.get("quantization"), lora=Lora.read(model.get("lora")))


@dataclass(frozen=True, kw_only=True)
class Pods:
    """What spec.controller, spec.trainer and spec.inference say about their role's pods. The
    Kubernetes fields (resources, nodeSelector, tolerations) are the operator's to pass through to
    the pod template as written."""

    replicas: int = 1
    """Pods of this role (the controller: always one)."""
    procs_per_pod: int = 1
    """Processes per pod (ranks), one per GPU on GPU nodes (the controller: one)."""
    gpus_per_proc: int = 0
    """GPUs each process uses; 0 runs on CPU (the controller: none)."""
    image: str | None = None
    """The role's own image; unset, spec.image (the controller always runs spec.image)."""
    resources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Kubernetes resource requirements (limits, requests) of each pod; the operator adds the GPUs
    and the RDMA device where these do not name them."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    """Kubernetes nodeSelector of the role's pods."""
    tolerations: tuple[Mapping[str, Any], ...] = ()
    """Kubernetes tolerations of the role's pods."""
    external: bool = False
    """The role's ranks are processes the user starts (job/join.py: what they need to join);
    weightsync starts none of its pods. The controller is never external."""
    pod_template: PodTemplate = PodTemplate()
    """spec.<role>.podTemplate: what the user adds to the role's pods (podtemplate.py)."""

    @property
    def gpus(self) -> int:
        """GPUs a pod asks for (nvidia.com/gpu), unless resources name them."""
        return self.procs_per_pod * self.gpus_per_proc

    @staticmethod
    def common(section: Mapping) -> dict[str, Any]:
        """The fields every role's section has, read from it."""
        return {"image": section.get("image"), "resources": section.get("resources") or {},
                "node_selector": section.get("nodeSelector") or {}, "tolerations": tuple(section.get("tolerations") or ()),
                "external": bool(section.get("external", False)),
                "pod_template": PodTemplate.read(section.get("podTemplate"))}


@dataclass(frozen=True)
class ValueFrom:
    """A variable's value that Kubernetes gives a pod when it starts (an EnvVarSource): what a
    user's spec.trainer.env takes from the cluster (a Secret, a ConfigMap), or what the pod learns
    about itself through the downward API (pod.pod_env)."""

    source: Mapping[str, Any]

    @classmethod
    def field(cls, path: str) -> "ValueFrom":
        """The downward API's value of a field of the pod's own object."""
        return cls({"fieldRef": {"apiVersion": "v1", "fieldPath": path}})


@dataclass(frozen=True, kw_only=True)
class Trainer(Pods):
    """spec.trainer: the trainer pods, which run the built-in trainer or the user's command."""

    command: tuple[str, ...] = ()
    """The user's training command (for example torchrun train.py), run in every trainer pod
    instead of the built-in trainer; it publishes versions through weightsync.attach(). Empty:
    the built-in trainer (spec.training)."""
    args: tuple[str, ...] = ()
    """Arguments appended to the command."""
    env: Mapping[str, str | ValueFrom] = field(default_factory=dict)
    """The command's own environment variables, after weightsync's, by name: a value, or where
    Kubernetes takes it from (valueFrom, passed through to the pod as written)."""
    attach_timeout_seconds: int = 1800
    """With a command: seconds from its start for every rank of the pod to call
    weightsync.attach(); a rank that has not by then fails the job, named."""

    @property
    def argv(self) -> list[str]:
        """The command and its arguments; empty for the built-in trainer."""
        return [*self.command, *self.args] if self.command else []

    @property
    def resumes(self) -> bool:
        """Whether a trainer rank whose process starts again resumes the running job: with the
        user's command in the trainer pods, whose script resumes from its own checkpoint (the
        built-in trainer keeps none; an external rank's second process is another claim of it)."""
        return bool(self.command) and not self.external

    @classmethod
    def read(cls, trainer: Mapping) -> "Trainer":
        return cls(replicas=trainer["replicas"], procs_per_pod=trainer["procsPerPod"], gpus_per_proc=trainer["gpusPerProc"],
                   command=tuple(trainer.get("command") or ()), args=tuple(trainer.get("args") or ()),
                   env={var["name"]: ValueFrom(var["valueFrom"]) if "valueFrom" in var else var.get("value", "")
                        for var in trainer.get("env") or ()},
                   attach_timeout_seconds=trainer["attachTimeoutSeconds"],
                   **Pods.common(trainer))


BUILTIN, VLLM = "builtin", "vllm"  # spec.inference.engine
ROLL_BACK, FAIL_JOB = "rollBack", "failJob"  # spec.inference.onLoadFailure
VLLM_PORT = 8000  # spec.inference.vllm.port's default: vLLM's own


@dataclass(frozen=True)
class Vllm:
    """spec.inference.vllm: with engine vllm, every inference pod runs one vLLM OpenAI-compatible
    server, started with weightsync as its weight-transfer backend."""

    port: int = VLLM_PORT
    """The port every server serves the OpenAI API on (and the job's Service "<name>-vllm")."""
    args: tuple[str, ...] = ()
    """The user's arguments for `vllm serve`, after weightsync's own."""
    load_ahead: bool = False
    """Load each verified version into a second copy of the weights while the server serves, so that
    the pause holds only a copy into the weights it runs on (one more copy of them in memory)."""
    expert_parallel: bool = False
    """A mixture of experts served with expert parallelism (vLLM's --enable-expert-parallel): each
    of a server's tensor-parallel workers holds whole experts, 1/N of them, and receives only those."""


@dataclass(frozen=True, kw_only=True)
class Inference(Pods):
    """spec.inference: the inference pods, how their ranks group into tensor-parallel model
    replicas, and the engine that serves the weights."""

    tensor_parallel: int = 1
    """The tensor-parallel degree of every model replica (consecutive inference ranks)."""
    tensor_parallel_sizes: tuple[int, ...] = ()
    """Instead of tensor_parallel, the degree of each model replica in inference rank order."""
    engine: str = BUILTIN
    """builtin (weightsync's own transformers model) or vllm (a vLLM server per pod)."""
    vllm: Vllm = Vllm()
    """The vLLM servers' settings (engine vllm)."""
    min_available: int | None = None
    """Inference ranks the job needs; None: all of them (needed)."""
    away_grace_seconds: int = 900
    """Seconds an inference rank may be away before it is dropped or the job fails."""
    max_version_lag: int = 0
    """Versions a vLLM server may be behind the fleet's latest and still serve its clients."""
    on_load_failure: str = ROLL_BACK
    """A load that fails part-way on one rank: rollBack (the job goes on, the rank behind) or failJob."""
    max_replicas: int | None = None
    """The most inference pods the job may scale to while it runs (spec.inference.maxReplicas):
    the rendezvous holds a rank for each of them, and `replicas` may change up to it. None:
    `replicas`, which then cannot change."""

    @property
    def capacity(self) -> int:
        """Inference pods the job's layout holds ranks for: maxReplicas, or replicas."""
        return self.max_replicas if self.max_replicas is not None else self.replicas

    def ranks_of_pods(self, pods: int) -> int:
        """The inference ranks of the first `pods` inference pods."""
        return sum(self.model_replicas[:pods]) if self.runs_vllm else pods * self.procs_per_pod

    @property
    def world_size(self) -> int:
        """Inference ranks the layout holds (of `capacity` pods): processes, or with engine vllm
        every server's tensor-parallel workers."""
        return self.ranks_of_pods(self.capacity)

    @property
    def running_ranks(self) -> int:
        """Inference ranks of the pods the job runs now (spec.inference.replicas)."""
        return self.ranks_of_pods(self.replicas)

    @property
    def model_replicas(self) -> tuple[int, ...]:
        """The tensor-parallel degree of each model replica, in inference rank order (with engine
        vllm: of each server, one per pod), for `capacity` pods."""
        if self.runs_vllm:
            return self.tensor_parallel_sizes or (self.tensor_parallel,) * self.capacity
        return self.tensor_parallel_sizes or \
            (self.tensor_parallel,) * (self.capacity * self.procs_per_pod // self.tensor_parallel)

    @property
    def gpus(self) -> int:
        """GPUs a pod asks for: with engine vllm one per tensor-parallel worker of its server
        (gpusPerProc is each worker's, 0 or 1), else procsPerPod x gpusPerProc."""
        if self.runs_vllm:
            return max(self.model_replicas) * self.gpus_per_proc
        return self.procs_per_pod * self.gpus_per_proc

    @property
    def runs_vllm(self) -> bool:
        return self.engine == VLLM

    @classmethod
    def read(cls, inference: Mapping) -> "Inference":
        vllm = inference.get("vllm") or {}
        return cls(replicas=inference["replicas"], procs_per_pod=inference["procsPerPod"],
                   gpus_per_proc=inference["gpusPerProc"], tensor_parallel=inference["tensorParallel"],
                   tensor_parallel_sizes=tuple(inference.get("tensorParallelSizes") or ()),
                   engine=inference.get("engine", BUILTIN),
                   vllm=Vllm(int(vllm.get("port", VLLM_PORT)), tuple(vllm.get("args", ())),
                             bool(vllm.get("loadAhead", False)), bool(vllm.get("expertParallel", False))),
                   min_available=inference.get("minAvailable"), away_grace_seconds=inference["awayGraceSeconds"],
                   max_version_lag=inference.get("maxVersionLag", 0),
                   on_load_failure=inference.get("onLoadFailure", ROLL_BACK),
                   max_replicas=inference.get("maxReplicas"),
                   **Pods.common(inference))


@dataclass(frozen=True)
class Training:
    """spec.training: the built-in trainer's loop (a user's command decides its own)."""

    steps: int = 100
    """Optimizer steps; 0 trains until the job is deleted."""
    learning_rate: float = 3.0e-4
    """AdamW's learning rate."""
    batch_size: int = 8
    """Sequences per trainer rank per step."""
    seq_len: int = 128
    """Tokens per sequence."""
    seed: int = 0
    """Seeds the model's initial weights (the same on every rank) and the training data."""

    @classmethod
    def read(cls, training: Mapping) -> "Training":
        return cls(training["steps"], training["learningRate"], training["batchSize"], training["seqLen"], training["seed"])


@dataclass(frozen=True)
class Delta:
    """spec.transfer.delta: whether inference ranks that hold the previous version get only what
    changed, and every how many versions every rank gets a whole version anyway."""

    enabled: bool
    """Send patches against the previous version (transport tcp) instead of whole versions."""
    full_every: int
    """Every this many versions, every inference rank gets a whole version, whatever it holds."""


@dataclass(frozen=True)
class Transfer:
    """spec.transfer: how each version travels from the trainer ranks to the inference ranks."""

    every_steps: int = 10
    """The built-in trainer publishes a version every this many optimizer steps (and once before
    training)."""
    bucket_mb: int = 64
    """The size of one transfer bucket in MiB; large tensors are split across buckets."""
    verify: str = "digest"
    """digest: every inference rank checks a digest of the whole version before applying it;
    none: only the per-bucket checksums, which are always checked."""
    transport: str = "auto"
    """auto, tcp, nccl, uccl or ipc (auto: resolved on each rank, transport.resolve_transport)."""
    timeout_seconds: int = 300
    """A peer silent for this long fails the job with its rank named."""
    delta: Delta = Delta(False, 10)
    """Delta versions."""

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb << 20

    @property
    def timeout(self) -> float:
        """timeout_seconds, as the deadlines that take it."""
        return float(self.timeout_seconds)

    @property
    def verify_digest(self) -> bool:
        return self.verify == "digest"

    @classmethod
    def read(cls, transfer: Mapping) -> "Transfer":
        delta = transfer["delta"]
        return cls(transfer["everySteps"], transfer["bucketMB"], transfer["verify"], transfer["transport"],
                   transfer["timeoutSeconds"], Delta(bool(delta["enabled"]), int(delta["fullEvery"])))


@dataclass(frozen=True)
class Rdma:
    """spec.network.rdma: what pods of an rdma job get (device, NIC settings, networks)."""

    resource_name: str = "rdma/rdma_shared_device_a"
    """The device-plugin resource that exposes the RDMA NICs."""
    resource_count: int = 1
    """How many of it every trainer and inference pod asks for."""
    hcas: tuple[str, ...] = ()
    """HCA names for NCCL_IB_HCA and UCCL_P2P_RDMA_DEV; empty lets the libraries choose."""
    gid_index: int = 3
    """RoCE GID index (3 is RoCEv2 over IPv4 on most NICs)."""
    gdr_level: str = "PHB"
    """NCCL_NET_GDR_LEVEL: the farthest GPU-NIC distance at which GPUDirect RDMA is used."""
    traffic_class: int = 104
    """RoCE traffic class, DSCP times 4."""
    service_level: int = 3
    """InfiniBand service level."""
    networks: str = ""
    """Multus networks (the k8s.v1.cni.cncf.io/networks annotation); empty for none."""
    host_network: bool = False
    """Trainer and inference pods share their node's network (and then have no probes)."""

    @classmethod
    def read(cls, rdma: Mapping) -> "Rdma":
        return cls(rdma["resourceName"], rdma["resourceCount"], tuple(rdma.get("hcas") or ()), rdma["gidIndex"],
                   rdma["gdrLevel"], rdma["trafficClass"], rdma["serviceLevel"], rdma["networks"], bool(rdma["hostNetwork"]))


@dataclass(frozen=True)
class Tcp:
    """spec.network.tcp: the settings of mode tcp."""

    socket_ifname: str = "^lo,docker0"
    """NCCL_SOCKET_IFNAME, and GLOO_SOCKET_IFNAME where it names interfaces (gloo takes no "^")."""


@dataclass(frozen=True)
class Network:
    """spec.network: the network mode the job asks for and each mode's settings."""

    mode: str = "auto"
    """auto, rdma or tcp; the operator resolves auto once, when the job is created (rdma where
    some node offers spec.network.rdma's resource, else tcp)."""
    rdma: Rdma = Rdma()
    """Settings of mode rdma."""
    tcp: Tcp = Tcp()
    """Settings of mode tcp."""

    @classmethod
    def read(cls, network: Mapping) -> "Network":
        return cls(network["mode"], Rdma.read(network["rdma"]), Tcp(network["tcp"]["socketIfname"]))


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
