"""What a pod of a job receives, and what its worker process reads back: environment variable
names, ports, mounts, probes, the network settings of a resolved mode, torchrun's environment for
a user's trainer command, and the WorkerContext a worker builds from all of these. A pod's
environment is made in one place, pod_env(): the operator renders it into every pod template, the
local runner gives it to its processes, each with what differs where the pod runs (PodSite).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Mapping

from weightsync.job.join import Join, JoinEnv
from weightsync.job.role_sections import ValueFrom
from weightsync.job.sections import Network
from weightsync.job.spec import Job, SpecError, load_job
from weightsync.job.token import read_token
from weightsync.job.topology import CONTROLLER, TRAINER

STORE_PORT = 29500  # the controller's rendezvous store
DATA_PORT = 29600  # an inference process listens on DATA_PORT + its local rank
HEALTH_PORT = 29700  # every pod answers its probes here: /healthz (liveness), /readyz (readiness)
# spec.trainer.command: the port of torch.distributed's store among the trainer ranks (torchrun's,
# on trainer rank 0's pod, MASTER_ADDR); the job's own rendezvous is the controller's store.
MASTER_PORT = 29800
MASTER_PORTS = 8  # ports from MASTER_PORT on that the trainers' torch.distributed rendezvous takes, one per resume

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


class Env:
    """Names of the environment variables a worker pod receives."""

    JOB = "WEIGHTSYNC_JOB"
    NAMESPACE = "WEIGHTSYNC_NAMESPACE"
    ORDINAL = "WEIGHTSYNC_ORDINAL"  # downward API: the pod-index label
    POD_NAME = "WEIGHTSYNC_POD_NAME"
    POD_IP = JoinEnv.POD_IP  # the address other ranks dial
    CONTROLLER_HOST = "WEIGHTSYNC_CONTROLLER_HOST"
    STORE_PORT = "WEIGHTSYNC_STORE_PORT"
    DATA_PORT = "WEIGHTSYNC_DATA_PORT"
    SPEC_FILE = "WEIGHTSYNC_SPEC_FILE"
    TOKEN_FILE = JoinEnv.TOKEN_FILE
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
    VLLM_SERVER = JoinEnv.VLLM_SERVER
    VLLM_PYTHON = "WEIGHTSYNC_VLLM_PYTHON"
    VLLM_LORA = "WEIGHTSYNC_VLLM_LORA"  # the name a vLLM server serves spec.model.lora's adapter under
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
# Startup: liveness begins once the pod answered once. Before it serves its probes, a pod's process
# imports torch and builds its model: on a busy node that took longer than liveness allows (four
# failures, 20 s), and the kubelet killed a controller still starting, which ends the job. Up to
# five minutes to answer, asked every 2 s, so that a pod that started is live within seconds.
STARTUP = Probe("/healthz", period_seconds=2, timeout_seconds=5, failure_threshold=150)
# Readiness: every rank said it is ready (health.ready()) and is alive. Checked as often as
# liveness; three failures in a row, as the kubelet's default, so that one slow answer does not
# flip the pod (and the job's Ready condition) back and forth.
READINESS = Probe("/readyz", period_seconds=5, timeout_seconds=2, failure_threshold=3)



# ---------------------------------------------------------------- network settings


def network_env(network: Network, mode: str) -> dict[str, str]:
    """NCCL and UCCL settings for a resolved network mode (rdma or tcp)."""
    if mode == "rdma":
        rdma = network.rdma
        env = {
            "NCCL_IB_DISABLE": "0",
            "NCCL_IB_GID_INDEX": str(rdma.gid_index),
            "NCCL_NET_GDR_LEVEL": rdma.gdr_level,
            "NCCL_IB_TC": str(rdma.traffic_class),
            "NCCL_IB_SL": str(rdma.service_level),
            "UCCL_P2P_RDMA_GID_INDEX": str(rdma.gid_index),
            "UCCL_P2P_RDMA_TC": str(rdma.traffic_class),
            "UCCL_P2P_RDMA_SL": str(rdma.service_level),
        }
        if rdma.hcas:
            env["NCCL_IB_HCA"] = ",".join(rdma.hcas)
            env["UCCL_P2P_RDMA_DEV"] = ",".join(rdma.hcas)
        return env
    if mode == "tcp":
        ifname = network.tcp.socket_ifname
        env = {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": ifname}
        # Gloo takes only interface names: it has no "^" exclusion syntax. Without the variable it
        # binds the address the pod's hostname resolves to, which is the pod IP.
        if not ifname.startswith("^"):
            env["GLOO_SOCKET_IFNAME"] = ifname
        return env
    raise ValueError(f"network mode must be resolved to rdma or tcp, not {mode!r}")


# ---------------------------------------------------------------- a user's trainer command


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


# ---------------------------------------------------------------- a pod's environment


Value = str | ValueFrom


@dataclass(frozen=True)
class PodSite:
    """What a pod's environment takes from where it runs. In a cluster (the operator's render),
    one template for every pod of a role: the pod learns its ordinal, name and address through the
    downward API and finds its files where its mounts put them. Under `weightsync run` (the local
    runner), a process of this machine with its own values, ports and files."""

    namespace: Value
    ordinal: Value
    pod_name: Value
    pod_ip: Value
    """The address other ranks dial."""
    controller_host: str
    store_port: int
    data_port: int
    """An inference process listens on data_port + its local rank."""
    health_port: int
    """Where the pod answers its probes; 0 for none."""
    spec_file: str
    token_file: str
    master_addr: str
    """spec.trainer.command: where its ranks meet (torchrun's MASTER_ADDR, trainer rank 0's pod)."""
    master_port: int
    report_to_kubernetes: bool
    """The controller patches the job's status through the Kubernetes API."""
    status_file: str | None = None
    """Without Kubernetes: the file that stands in for the job's status subresource."""
    writable: Mapping[str, str] = field(default_factory=dict)
    """Where the worker and its libraries write, on a read-only root filesystem (WRITABLE_ENV)."""


def pod_env(job: Job, role: str, mode: str, site: PodSite) -> dict[str, Value]:
    """The environment every pod of `role` gets, in a cluster and under `weightsync run` alike:
    the contract's variables (Env) with the values `site` gives, the settings of the resolved
    network `mode` and, in trainer pods that run spec.trainer.command, where its ranks meet and
    the command's own variables, last (where two share a name, the last one counts, as in a
    Kubernetes container's env)."""
    env: dict[str, Value] = {
        Env.JOB: job.name,
        Env.NAMESPACE: site.namespace,
        Env.ORDINAL: site.ordinal,
        Env.POD_NAME: site.pod_name,
        Env.POD_IP: site.pod_ip,
        Env.CONTROLLER_HOST: site.controller_host,
        Env.STORE_PORT: str(site.store_port),
        Env.DATA_PORT: str(site.data_port),
        Env.HEALTH_PORT: str(site.health_port),
        Env.SPEC_FILE: site.spec_file,
        Env.TOKEN_FILE: site.token_file,
        Env.NETWORK_MODE: mode,
        **site.writable,
    }
    if role == CONTROLLER:
        # The controller moves no weights: it reports the job's progress and needs no network settings.
        env[Env.REPORT_TO_KUBERNETES] = "1" if site.report_to_kubernetes else "0"
        if site.status_file:
            env[Env.STATUS_FILE] = site.status_file
    else:
        env.update(network_env(job.network, mode))
    if role == TRAINER and job.trainer.command:
        # The worker adds the rest of torchrun's variables for its pod (torchrun_env).
        env.update({"MASTER_ADDR": site.master_addr, "MASTER_PORT": str(site.master_port)})
        env.update(job.trainer.env)
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
    where: str | None = None  # an external rank: its host (in a cluster, the user's pod) and process, as logs name it

    @property
    def pod_name(self) -> str:
        """Where this rank runs, as the controller's lines and the job's status name it: its pod,
        or for an external rank the host and process the user started it in."""
        return self.where or self.job.pod_name(self.ordinal)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "WorkerContext":
        def need(name: str) -> str:
            if not environ.get(name):
                raise SpecError([f"environment variable {name} is not set (the operator sets it in every pod)"])
            return environ[name]

        job = load_job(need(Env.SPEC_FILE), namespace=environ.get(Env.NAMESPACE, "default"), strict=False)
        ordinal = int(need(Env.ORDINAL))
        token = read_token(need(Env.TOKEN_FILE))
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

    @classmethod
    def from_join(cls, join: Join, job: Job, role: str, rank: int, *, network_mode: str,
                  data_port: int = DATA_PORT) -> "WorkerContext":
        """The context of an external rank (job/join.py): a process the user started, which read
        `job` from the controller's store (rendezvous/external_rank.py) instead of mounted files. Its
        ordinal is the one of the pod that would hold `rank` had weightsync started it (the
        controller counts ranks, not pods); it dials out from its address on the route to the
        controller unless WEIGHTSYNC_POD_IP names another."""
        return cls(job=job, ordinal=job.layout.ordinal_of_rank(role, rank), role=role, pod_ip=join.local_address(),
                   controller_host=join.controller_host, store_port=join.store_port, data_port=data_port,
                   network_mode=network_mode, token=join.token, report_to_kubernetes=False, health_port=0,
                   where=f"{socket.gethostname()} (pid {os.getpid()})")

    @property
    def ranks(self) -> range:
        return self.job.layout.ranks_of(self.ordinal)
