"""The sections of a job's spec that say what each role's pods are: what spec.controller,
spec.trainer and spec.inference share (Pods), the trainer's command and its environment, and the
inference pods' grouping into tensor-parallel replicas with the engine that serves the weights.

Each section is a frozen dataclass, read once from the defaulted spec (spec.Job), as the sections
of sections.py are: the CRD stays the one schema; these say what each value means to the code
that reads it, and derive what several readers would otherwise compute each (an inference pod's
GPUs, the ranks of its pods).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from weightsync.job.podtemplate import PodTemplate


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
FINISH, KEEP = "finish", "keep"  # spec.inference.vllm.inflight
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
    inflight: str = FINISH
    """What a load does to the requests in flight: finish (they end on their version first) or keep
    (frozen, then resumed on the new version; vllm_backend/control.py)."""


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
                             bool(vllm.get("loadAhead", False)), bool(vllm.get("expertParallel", False)),
                             vllm.get("inflight", FINISH)),
                   min_available=inference.get("minAvailable"), away_grace_seconds=inference["awayGraceSeconds"],
                   max_version_lag=inference.get("maxVersionLag", 0),
                   on_load_failure=inference.get("onLoadFailure", ROLL_BACK),
                   max_replicas=inference.get("maxReplicas"),
                   **Pods.common(inference))
