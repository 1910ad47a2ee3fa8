"""The plan of a job's versions: which of the three planners its ranks call for.

- Every trainer rank holds every tensor whole (the built-in trainer, DDP) and every inference
  rank needs the whole version: plan.make_plan, contiguous segments that cut through tensors,
  few and large buckets.
- Trainer ranks hold shards (FSDP2, HSDP) and every inference rank needs the whole version:
  shards.plan_by_holder, every row sent by a rank that holds it, in buckets that bundle runs of
  several tensors where the transport's receivers scatter a frame (tcp).
- Some inference ranks hold tensor-parallel slices: slicepath.SlicedPlan over what every trainer
  rank holds and every inference rank needs; a whole replica (TP degree 1) beside them needs
  every tensor whole.

The controller decides with what the ranks declared when they joined; `weightsync plan job.yaml`
with what the spec implies. Both come here, so the two never disagree. No torch here.
"""

from __future__ import annotations

from typing import Callable, Sequence

from weightsync.job import INFERENCE, Layout
from weightsync.model.flat import FlatLayout
from weightsync.plan.segments import Plan, make_plan
from weightsync.plan.holders import Holdings, plan_by_holder
from weightsync.plan.sliced import SlicedPlan, needs_everything
from weightsync.plan.slices import RankSlices
from weightsync.transport import RANGE_LIMITS, SCATTERING


def inference_needs(job: Layout, layout: FlatLayout, slices_of: Callable[[int], RankSlices]) -> tuple[RankSlices, ...] | None:
    """What every inference rank needs of a version, or None when every rank needs it whole: a
    rank of a tensor-parallel replica its own slices (`slices_of(rank)`), a rank that is a whole
    replica every tensor whole."""
    if not job.sliced:
        return None
    return tuple(slices_of(r) if len(job.tp_group(r)) > 1 else needs_everything(layout, r)
                 for r in range(job.world_size(INFERENCE)))


def make_job_plan(layout: FlatLayout, holdings: Sequence[Holdings], inferences: int, bucket_bytes: int,
                  needs: Sequence[RankSlices] | None = None, transport: str = "tcp") -> Plan | SlicedPlan:
    """The plan for trainer ranks holding `holdings` (one per rank) and `inferences` inference
    ranks that need `needs` (None: the whole version each), over `transport` (whether a bucket
    may bundle runs of several tensors). ValueError, naming the tensor, where what the trainers
    hold does not cover what the inference ranks need exactly, or where `transport` cannot move
    a bucket of bucket_bytes."""
    limit = RANGE_LIMITS.get(transport)
    if limit is not None and bucket_bytes > limit:
        raise ValueError(f"{bucket_bytes}-byte buckets are too large for the {transport} transport, which moves at most "
                         f"{limit} bytes at a time: lower spec.transfer.bucketMB")
    if needs is not None:
        if len(needs) != inferences:
            raise ValueError(f"{len(needs)} inference ranks said what they need; the job has {inferences}")
        plan = SlicedPlan(layout, tuple(holdings), tuple(needs), bucket_bytes)
        plan.buckets_of(0)  # the whole plan, computed and checked now
        return plan
    if all(h.is_whole(layout) for h in holdings):
        return make_plan(layout, len(holdings), inferences, bucket_bytes)
    return plan_by_holder(layout, dict(enumerate(holdings)), inferences, bucket_bytes, bundle=transport in SCATTERING)


def fsdp_holdings(layout: FlatLayout, trainers: int, shard: int) -> list[Holdings]:
    """What `trainers` ranks hold under FSDP2's fully_shard over `shard` of them (HSDP: replicas of
    that sharding, rank = replica x shard + index; shard 1 is DDP): torch.chunk's dim-0 rows."""
    if shard < 1 or trainers % shard:
        raise ValueError(f"the FSDP degree {shard} must divide the job's {trainers} trainer ranks (the rest are replicas)")
    return [Holdings.fsdp(layout, shard, t % shard) for t in range(trainers)]
