"""The sections of a job's spec that say what moves and how: spec.model (with its LoRA adapter),
spec.training (the built-in trainer's loop), spec.transfer (buckets, verification, transport,
delta versions) and spec.network (the network mode and its settings).

Each section is a frozen dataclass, read once from the defaulted spec (spec.Job): the CRD stays
the one schema (types, defaults, limits, rules); these say what each value means to the code that
reads it, and derive what several readers would otherwise compute each. The roles' own sections
(spec.controller, spec.trainer, spec.inference) are in role_sections.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


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
