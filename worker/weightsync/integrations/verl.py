"""weightsync as verl's checkpoint engine "weightsync" (verl 0.9.1's verl.checkpoint_engine): a verl
run whose actor and rollout workers are apart moves each new version through weightsync by naming
it in its configuration (examples/integrations/verl-weightsync.yaml):

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.job=/path/to/job.yaml

verl imports this module on every worker (custom_backend_module), which registers the engine with
verl's own CheckpointEngineRegistry, and makes one engine per worker: the actor workers' with
is_master (rank 0's True), the rollout workers' without, all with engine_kwargs.weightsync. Per
update verl calls prepare() on every worker, build_topology() once in its driver with what they
returned, init_process_group() on every worker with its share of the topology, send_weights() on
every actor worker (each with the whole version, gathered) beside receive_weights() on every
rollout worker, and finalize() on every worker. weightsync answers each as its own job would:

- prepare: actor rank 0's first one starts the job's controller in its process
  (ranks.LocalController: the controller pod's code) from the WeightTransferJob file `job` (its
  model, transfer and network; each role's replicas x procsPerPod are the worker counts); every
  prepare returns RankMetadata, what build_topology needs and nothing secret.
- build_topology: the M-to-N layout. Actor worker i is trainer rank i, rollout worker j inference
  rank j; M and N must be the job's, or it refuses on one line. The controller plans the bytes over
  those ranks once they joined, by holder: every actor worker is handed the whole version, so each
  sends about 1/M of it, to every rollout worker at once.
- init_process_group: the first joins every worker, on `device`, and returns once all joined and
  the controller published the plan (as a process group's init does); a later one must name the
  same rank. Buffers are registered once, for the run, as weightsync's ranks keep them. An actor
  worker then keeps of each version only the tensors its share of the plan overlaps.
- send_weights: one version, `global_steps` its step; returns once every rollout worker took it,
  verified, with figures for verl's metrics.
- receive_weights: the next verified version, refused (and the job failed) where it was published
  at another global step; yields views of the staging buffer, as verl's own engines yield views
  of theirs.
- finalize: ends the update; the next must start with prepare. Each call out of this order is
  refused on one line naming the call that comes first.

The job ends as the workers' processes exit (atexit, or close() before): each actor worker closes
its rank, each rollout worker waits for the end, and actor rank 0 for its controller, each within
the job's spec.transfer.timeoutSeconds. Where Ray kills the workers instead, the job goes with
them, every version it delivered verified already. The token comes from WEIGHTSYNC_TOKEN or `token_file`
(ranks.job_token), never from the configuration. verl's bucket_size is not weightsync's: the
controller plans one bucket size for every rank, spec.transfer.bucketMB.

The job's controller is always this in-process one: a job that an operator or `weightsync run`
runs cannot hold verl's rollout workers (its external inference ranks are vLLM servers with
weightsync's backend), so a worker with WEIGHTSYNC_CONTROLLER in its environment is refused.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Generator, Mapping

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

from weightsync.integrations.ranks import Address, LocalController, RolloutRank, TrainerRank, job_token
from weightsync.job import INFERENCE, TRAINER, JoinEnv, load_job
from weightsync.rendezvous.protocol import who
from weightsync.runtime.rank import log

BACKEND = "weightsync"
IDLE, PREPARED, READY, MOVED = "idle", "prepared", "ready", "moved"  # one update's steps, in verl's order
NEXT = {IDLE: "prepare", PREPARED: "init_process_group", READY: "send_weights/receive_weights", MOVED: "finalize"}
ORDER = "verl's order per update is prepare, build_topology, init_process_group, send_weights or receive_weights, finalize"


@dataclass(frozen=True)
class RankMetadata:
    """What prepare() returns for build_topology: actor rank 0's says where the job is."""

    master: bool
    address: Address | None = None  # actor rank 0's: the job's controller
    trainers: int | None = None  # actor rank 0's: the job's trainer and inference ranks
    inference: int | None = None


@CheckpointEngineRegistry.register(BACKEND)
class WeightsyncCheckpointEngine(CheckpointEngine):
    """One verl worker's weightsync rank (the module's docstring says how each call is answered).

    bucket_size: verl's update_weights_bucket_megabytes, in bytes (weightsync buckets by the job's
    spec.transfer.bucketMB). is_master: verl's, True on actor rank 0. job: the WeightTransferJob,
    a path or its object (actor rank 0 reads it). token_file: where the job's token is, where
    WEIGHTSYNC_TOKEN is not set. device: where an actor worker's tensors are and a rollout
    worker receives (default cuda where there is one, else cpu)."""

    def __init__(self, bucket_size: int, is_master: bool = False, job: str | Mapping | None = None,
                 token_file: str | None = None, device: str | None = None) -> None:
        if os.environ.get(JoinEnv.CONTROLLER):
            raise ValueError(f"{JoinEnv.CONTROLLER} is set in this verl worker, but verl's engine runs its own job's "
                             "controller on actor rank 0 (engine_kwargs.weightsync.job): unset the join variables in "
                             "verl's workers, keeping WEIGHTSYNC_TOKEN")
        if is_master and job is None:
            raise ValueError("engine_kwargs.weightsync.job is not set: actor rank 0 needs the WeightTransferJob file "
                             "(spec.model, spec.transfer, spec.network) of this run")
        self.bucket_size, self.is_master, self.job_source, self.token_file = bucket_size, is_master, job, token_file
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:  # this process's current one, for every thread
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.state = IDLE
        self.controller: LocalController | None = None
        self.topology: tuple | None = None  # (role, rank, address) of the first init_process_group
        self.rank: TrainerRank | RolloutRank | None = None
        self.step: int | None = None  # the last global_steps sent
        self.timeout = 0.0

    # ------------------------------------------------------------ verl's calls, in its order

    def prepare(self) -> RankMetadata:
        self._expect(IDLE, "prepare")
        if self.is_master and self.controller is None:
            job = load_job(self.job_source)
            self.controller = LocalController(job, job_token(self.token_file, create=True))
            if self.bucket_size != job.transfer.bucket_bytes:
                log(who(TRAINER, 0), f"verl's update_weights_bucket_megabytes ({self.bucket_size >> 20}) is not used: "
                                      f"the controller plans every rank's buckets of spec.transfer.bucketMB "
                                      f"({job.transfer.bucket_mb})")
        self.state = PREPARED
        if not self.is_master:
            return RankMetadata(master=False)
        layout = self.controller.ctx.job.layout
        return RankMetadata(True, self.controller.address, layout.world_size(TRAINER), layout.world_size(INFERENCE))

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[RankMetadata]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        m, n = actor_wg_world_size, rollout_world_size
        if len(metadata) != m + n:
            raise ValueError(f"build_topology got {len(metadata)} workers' metadata for {m} actor and {n} rollout "
                             "workers: pass every worker's prepare(), the actor workers' first")
        strangers = [i for i, d in enumerate(metadata) if not isinstance(d, RankMetadata)]
        if strangers:
            raise ValueError(f"worker {strangers[0]}'s metadata is not weightsync's: run every worker with "
                             f"checkpoint_engine.backend={BACKEND}")
        masters = [i for i, d in enumerate(metadata) if d.master]
        if masters != [0]:
            raise ValueError(f"the metadata of workers {masters} says master, and only actor rank 0's must (verl makes "
                             "its engine with is_master=True): pass the actor workers' metadata first")
        head = metadata[0]
        for what, given, want, role in (("actor_wg_world_size", m, head.trainers, TRAINER),
                                        ("rollout_world_size", n, head.inference, INFERENCE)):
            if given != want:
                raise ValueError(f"{what} is {given}, and job {head.address.job_id} has {want} {role} ranks "
                                 f"(spec.{role}.replicas x procsPerPod): make the job's count verl's worker count")
        actor = {"role": [TRAINER] * m, "rank": list(range(m)), "address": [head.address] * m}
        rollout = {"role": [INFERENCE] * n, "rank": list(range(n)), "address": [head.address] * n}
        return actor, rollout

    def init_process_group(self, role: str, rank: int, address: Address) -> None:
        self._expect(PREPARED, "init_process_group")
        if self.topology is not None:
            if self.topology != (role, rank, address):
                raise ValueError(f"this worker is {self.topology[0]} rank {self.topology[1]} of job "
                                 f"{self.topology[2].job_id}, and now {role} rank {rank} of {address.job_id}: weightsync "
                                 "keeps each worker's rank for the run; restart the run to change the workers")
            self.state = READY
            return
        if role == TRAINER and (rank == 0) != self.is_master:
            raise ValueError(f"trainer rank {rank} on a worker whose is_master is {self.is_master}: trainer rank 0 is actor "
                             "rank 0; pass build_topology's actor kwargs to the actor workers in their order")
        token = job_token(self.token_file)
        ctx = address.context(token, role, rank)
        self.timeout = ctx.job.transfer.timeout
        self.rank = (TrainerRank if role == TRAINER else RolloutRank)(ctx, rank, self.device)
        self.topology = (role, rank, address)
        atexit.register(self.close)
        self.state = READY

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        rank = self._moving(TRAINER, "send_weights")
        if global_steps is not None and self.step is not None and global_steps <= self.step:
            raise ValueError(f"global_steps {global_steps} after {self.step}: each version is one global step, "
                             "later than the last sent")
        version = rank.version()  # each tensor checked as it comes, and kept only where this rank sends of it
        if hasattr(weights, "__aiter__"):
            async for name, tensor in weights:
                version.add(name, tensor)
        else:  # on this thread, as verl's own engines walk it (each tensor's gather is a collective)
            for name, tensor in weights:
                version.add(name, tensor)
        published = await asyncio.to_thread(rank.publish, version, global_steps)
        self.step = global_steps if global_steps is not None else self.step
        self.state = MOVED
        return {"weightsync/version": published.version, "weightsync/sent_bytes": published.bytes,
                "weightsync/send_seconds": published.seconds, "weightsync/receivers": published.receivers}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        rank = self._moving(INFERENCE, "receive_weights")
        version, step = await asyncio.to_thread(rank.next_version, self.timeout)
        if global_steps is not None and step != global_steps:
            error = ValueError(f"version {version} was published at global step {step}, and verl asks this rollout "
                               f"worker for global step {global_steps}: every actor and rollout worker must update at "
                               "the same global_steps")
            rank.refuse(error)
            raise error
        for name, tensor in rank.tensors():
            yield name, tensor
        rank.took(version)
        self.state = MOVED

    def finalize(self) -> None:
        self._expect(MOVED, "finalize")
        self.state = IDLE

    # ------------------------------------------------------------ the run's end

    def close(self) -> None:
        """This worker's part of the job ends: an actor worker closes its rank (the job ends once
        every one did and every rollout worker holds the last version), a rollout worker waits for
        that end, actor rank 0 then for its controller; each within spec.transfer.timeoutSeconds."""
        rank, self.rank = self.rank, None
        if isinstance(rank, TrainerRank):
            closing = threading.Thread(target=rank.close, name="weightsync-close", daemon=True)
            closing.start()
            closing.join(self.timeout)
        elif isinstance(rank, RolloutRank):
            rank.wait(self.timeout)
        if self.controller is not None:
            self.controller.wait(self.timeout)

    # ------------------------------------------------------------ the order

    def _expect(self, state: str, call: str) -> None:
        if self.state != state:
            raise RuntimeError(f"{call} called where {NEXT[self.state]} comes next: {ORDER}")

    def _moving(self, role: str, call: str) -> TrainerRank | RolloutRank:
        self._expect(READY, call)
        if self.topology[0] != role:
            raise RuntimeError(f"{call} called on a {self.topology[0]} worker: verl calls send_weights on the actor "
                               "workers and receive_weights on the rollout workers")
        return self.rank
