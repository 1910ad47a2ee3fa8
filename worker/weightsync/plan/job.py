"""The plan of a job's versions: which of the three planners its ranks call for, and who gets
each version as a delta.

- Every trainer rank holds every tensor whole (the built-in trainer, DDP) and every inference
  rank needs the whole version: segments.make_plan, contiguous segments that cut through tensors,
  few and large buckets.
- Trainer ranks hold shards (FSDP2, HSDP) and every inference rank needs the whole version:
  holders.plan_by_holder, every row sent by a rank that holds it, in buckets that bundle runs of
  several tensors where the transport's receivers scatter a frame (tcp).
- Some inference ranks hold tensor-parallel slices: sliced_plan.SlicedPlan over what every trainer
  rank holds and every inference rank needs; a whole replica (TP degree 1) beside them needs
  every tensor whole.

Who gets a version as a delta, and against which version, the controller alone decides. Before
every round it looks at what each receiver holds (roster.Seat.holds: the last version it applied
and verified, or None when it holds none: it is new, or its process started again and rejoined)
and names, in the round it announces with the go, the receivers that get the version as patches
and the version they are patched against. That is the version the trainers sent last and kept:
the one before, for a version's first sending (when the final version is sent again, to ranks
that do not hold it, they kept that one, so it goes whole). Every delta.fullEvery versions every
receiver gets a whole version, and a receiver that holds anything else always does. Trainers
patch only against the version they kept themselves, and a receiver that cannot apply a patch
gets the bucket whole in the same round, so a wrong word here costs bytes, never correctness.

The controller decides with what the ranks declared when they joined; `weightsync plan job.yaml`
with what the spec implies. Both come here, so the two never disagree. What the transport can do
comes as plain values from the caller (the planner sits below the transports). No torch here.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from weightsync.job import INFERENCE, Delta, Layout
from weightsync.model.flat import FlatLayout
from weightsync.plan.boxes import RankSlices
from weightsync.plan.holders import Holdings, plan_by_holder
from weightsync.plan.segments import Plan, make_plan
from weightsync.plan.sliced_plan import SlicedPlan, needs_everything


def inference_needs(job: Layout, layout: FlatLayout, slices_of: Callable[[int], RankSlices]) -> tuple[RankSlices, ...] | None:
    """What every inference rank needs of a version, or None when every rank needs it whole: a
    rank of a tensor-parallel replica its own slices (`slices_of(rank)`), a rank that is a whole
    replica every tensor whole."""
    if not job.sliced:
        return None
    return tuple(slices_of(r) if len(job.tp_group(r)) > 1 else needs_everything(layout, r)
                 for r in range(job.world_size(INFERENCE)))


def make_job_plan(layout: FlatLayout, holdings: Sequence[Holdings], inferences: int, bucket_bytes: int,
                  needs: Sequence[RankSlices] | None = None, *, transport: str = "tcp", scatters: bool = True,
                  range_limit: int | None = None) -> Plan | SlicedPlan:
    """The plan for trainer ranks holding `holdings` (one per rank) and `inferences` inference
    ranks that need `needs` (None: the whole version each), over the transport named `transport`,
    whose receivers land a range in several runs where it `scatters` (so a bucket may bundle runs
    of several tensors) and which moves at most `range_limit` bytes at a time (None: no limit).
    ValueError, naming the tensor, where what the trainers hold does not cover what the inference
    ranks need exactly, or where the transport cannot move a bucket of bucket_bytes."""
    if range_limit is not None and bucket_bytes > range_limit:
        raise ValueError(f"{bucket_bytes}-byte buckets are too large for the {transport} transport, which moves at most "
                         f"{range_limit} bytes at a time: lower spec.transfer.bucketMB")
    if needs is not None:
        if len(needs) != inferences:
            raise ValueError(f"{len(needs)} inference ranks said what they need; the job has {inferences}")
        plan = SlicedPlan(layout, tuple(holdings), tuple(needs), bucket_bytes)
        _ = plan.assignment, plan.local  # the whole assignment and every local layout, computed and checked now
        return plan
    if all(h.is_whole(layout) for h in holdings):
        return make_plan(layout, len(holdings), inferences, bucket_bytes)
    return plan_by_holder(layout, dict(enumerate(holdings)), inferences, bucket_bytes, bundle=scatters)


def fsdp_holdings(layout: FlatLayout, trainers: int, shard: int) -> list[Holdings]:
    """What `trainers` ranks hold under FSDP2's fully_shard over `shard` of them (HSDP: replicas of
    that sharding, rank = replica x shard + index; shard 1 is DDP): torch.chunk's dim-0 rows."""
    if shard < 1 or trainers % shard:
        raise ValueError(f"the FSDP degree {shard} must divide the job's {trainers} trainer ranks (the rest are replicas)")
    return [Holdings.fsdp(layout, shard, t % shard) for t in range(trainers)]


def delta_in_effect(delta: Delta, transport: str, patches: bool, sliced: bool = False) -> tuple[bool, str]:
    """Whether versions go as deltas over the transport named `transport`, which carries patches
    or not (`patches`), with a plan that is `sliced` or not, and why (every rank decides alike)."""
    if not delta.enabled:
        return False, "spec.transfer.delta.enabled is false: every version goes whole"
    if sliced:
        return False, ("spec.transfer.delta.enabled is true, but the inference ranks hold tensor-parallel slices, "
                       "which go whole: every version goes whole")
    if not patches:
        return False, (f"spec.transfer.delta.enabled is true, but the {transport} transport carries no patches: "
                       "every version goes whole")
    return True, f"delta versions on: each goes as a delta to the inference ranks that hold the one before; " \
                 f"every {delta.full_every}th version goes whole"


def bases(delta: Delta, version: int, again: int, holds: Mapping[int, int | None]) -> dict[int, int | None]:
    """For each receiver ({rank: the version it holds, or None}), the version its copy of
    `version` (sent again for the again-th time when again > 0) is a delta against, or None for
    a whole version."""
    kept = version if again else version - 1  # what the trainers sent last, and kept
    whole = not delta.enabled or (not again and version % delta.full_every == 0)
    return {r: None if whole or held != kept else held for r, held in holds.items()}
