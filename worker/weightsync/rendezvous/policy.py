"""What the controller decides for its roster (roster.py), given once when it builds its Host: how
long a rank may be silent or away, how many inference ranks the job needs and runs, whose ranks
the user starts, and whether the trainers resume. The roster only reads it: the ranks' states
change as the job runs, its policy does not."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    """The roster's rules for one job (each from its spec, as the controller reads it)."""

    silent_limit: float  # seconds without a heartbeat after which a rank counts as dead or frozen
    away_limit: float  # seconds an inference rank may be away before it is dropped (or fails the job)
    # a silent trainer rank fails the job, where a silent inference rank is only away until it
    # rejoins: trainers may have a longer limit (a step or a checkpoint that holds the CPU); None: silent_limit
    trainer_silent_limit: float | None = None
    # inference ranks the job cannot go on without (spec.inference.minAvailable); None: every running one
    min_available: int | None = None
    # the inference ranks of the pods it runs at first (spec.inference.replicas'); None: all of them.
    # The rest are parked until their pods start.
    running: int | None = None
    external: frozenset[str] = frozenset()  # the roles whose ranks the user starts (spec.<role>.external)
    # a trainer rank that stops is resumed from (spec.trainer.resumes: the user's script, which keeps
    # its own checkpoint) instead of failing the job
    resumable: bool = False
    # the built-in engine's tensor-parallel replicas of more than one rank, which go away and are taken
    # back as a whole: their forward passes are collectives over a process group formed at start-up
    # (a vLLM server's workers go with their server, which ends them all: vllm_backend)
    tp_replicas: tuple[range, ...] = ()

    def replica_of(self, rank: int) -> range | None:
        """The tensor-parallel replica (of more than one rank) inference rank `rank` belongs to."""
        return next((group for group in self.tp_replicas if rank in group), None)

    @property
    def trainer_silent(self) -> float:
        """Seconds without a heartbeat after which a trainer rank counts as dead or frozen."""
        return self.silent_limit if self.trainer_silent_limit is None else self.trainer_silent_limit
