"""The ordinal -> role/rank layout of a job: which pod runs which role and which ranks, and how
inference ranks group into tensor-parallel model replicas. Every part of weightsync derives roles
and ranks from here, never from start-up order or timing.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTROLLER, TRAINER, INFERENCE = "controller", "trainer", "inference"
ROLES = (CONTROLLER, TRAINER, INFERENCE)


@dataclass(frozen=True)
class Layout:
    """Global ordinals: 0 is the controller, 1..T the trainer pods, T+1..T+I the inference pods.
    Ranks count processes within a role: trainer pod with ordinal o runs trainer ranks
    (o-1)*P .. (o-1)*P+P-1, and likewise for inference from ordinal T+1. Inference ranks form
    model replicas of consecutive ranks, `tensor_parallel[i]` of them for the i-th replica
    (spec.inference.tensorParallelSizes, or tensorParallel for every replica); empty: every
    inference rank is a whole replica. The job's own is Job.layout, from its spec's sections.

    With `servers` (spec.inference.engine vllm) every inference pod runs one server that is one
    model replica, its tensor-parallel workers the pod's ranks: the i-th inference pod runs the
    ranks of the i-th replica (tensor_parallel[i] of them, so pods may run different numbers of
    ranks), and inference_procs is the most any pod runs (its data ports, its GPUs)."""

    trainers: int
    trainer_procs: int
    inferences: int
    inference_procs: int
    tensor_parallel: tuple[int, ...] = ()
    servers: bool = False

    def __post_init__(self):
        if self.servers and len(self.tensor_parallel) != self.inferences:
            raise ValueError(f"{self.inferences} inference servers need one tensor-parallel degree each, "
                             f"not {len(self.tensor_parallel)}")

    def tp_group(self, inference_rank: int) -> range:
        """The inference ranks of the model replica `inference_rank` holds a tensor-parallel shard of."""
        first = 0
        for size in self.tensor_parallel:
            if inference_rank < first + size:
                return range(first, first + size)
            first += size
        return range(inference_rank, inference_rank + 1)

    @property
    def tp_groups(self) -> tuple[range, ...]:
        """The model replicas of more than one inference rank (tensor-parallel), in rank order."""
        starts = [sum(self.tensor_parallel[:i]) for i in range(len(self.tensor_parallel))]
        return tuple(range(s, s + size) for s, size in zip(starts, self.tensor_parallel) if size > 1)

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
        """The role ranks of the processes a pod runs (a server's pod: those of its workers)."""
        role = self.role_of(ordinal)
        if role == INFERENCE and self.servers:
            index = ordinal - self.first_ordinal(role)
            first = sum(self.tensor_parallel[:index])
            return range(first, first + self.tensor_parallel[index])
        procs = self.procs_per_pod(role)
        first = (ordinal - self.first_ordinal(role)) * procs
        return range(first, first + procs)

    def world_size(self, role: str) -> int:
        if role == INFERENCE and self.servers:
            return sum(self.tensor_parallel)
        return self.replicas(role) * self.procs_per_pod(role)

    def ordinal_of_rank(self, role: str, rank: int) -> int:
        if role == INFERENCE and self.servers:
            if not 0 <= rank < self.world_size(role):
                raise ValueError(f"inference rank {rank} is outside this job (0..{self.world_size(role) - 1})")
            first = 0
            for index, size in enumerate(self.tensor_parallel):
                if rank < first + size:
                    return self.first_ordinal(role) + index
                first += size
        return self.first_ordinal(role) + rank // self.procs_per_pod(role)

