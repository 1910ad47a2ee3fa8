"""What the controller makes of the ranks that joined: the plan (once every rank agrees on its
model and transport), and the checks that a rank joining the running job later, or a trainer that
resumes, matches it. A disagreement fails the job naming the rank to fix (RanksDisagree)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from weightsync.job import INFERENCE, TRAINER, Job, Layout, external_roles, reasons
from weightsync.job.errors import JobFailed
from weightsync.model.flat import FlatLayout, LayoutMismatch
from weightsync.plan.holders import Holdings
from weightsync.plan.job import inference_needs, make_job_plan
from weightsync.plan.segments import Plan
from weightsync.plan.sliced_plan import SlicedPlan, needs_from_json
from weightsync.rendezvous.join_phase import Deadline
from weightsync.rendezvous.messages import Admission, RankInfo
from weightsync.rendezvous.protocol import who
from weightsync.transport import capabilities_of

Admitted = Mapping[tuple[str, int], Admission]  # {(role, rank): what it joined with}


@dataclass(frozen=True)
class Planned:
    """The job's plan and what it was made from: what a rank that rejoins, or a trainer that
    resumes, must match."""

    plan: Plan | SlicedPlan
    transport: str  # the one every rank chose
    admitted: Admitted  # what every rank joined with

    def needs(self, layout: Layout, rank: int):
        """What an inference rank is planned to need (its slices, as JSON); None: the whole version."""
        return needs_of(layout, self.admitted, rank) if layout.sliced else None

    def check_rejoin(self, layout: Layout, rank: int, meta: str, info: RankInfo) -> None:
        """An inference rank that joins the running job must hold the same model, use the same
        transport and need the slices planned for it."""
        check_rejoin(self.plan.layout, self.transport, lambda r: self.needs(layout, r), rank, meta, info)

    def check_resumed(self, rank: int, got: Admission) -> None:
        """A trainer rank that resumed must hold the same model, use the same transport and hold
        the shards it joined with."""
        check_rejoin(self.plan.layout, self.transport, lambda _: None, rank, got.meta, got.info)
        if got.info.holds != self.admitted[(TRAINER, rank)].info.holds:
            raise JobFailed(f"{who(TRAINER, rank)} resumed holding other shards than it joined with (pod "
                            f"{got.info.pod}): each rank must hold its own as before", reasons.RANKS_DISAGREE)


def external_deadlines(job: Job) -> dict[str, Deadline]:
    """The roles whose ranks the user starts, each with how long its ranks have to join."""
    seconds, setting = float(job.trainer.attach_timeout_seconds), "spec.trainer.attachTimeoutSeconds"
    world = job.layout.world_size(TRAINER)
    how = {TRAINER: f"RANK 0..{world - 1}, WORLD_SIZE={world}" if world > 1 else "RANK=0, WORLD_SIZE=1",
           INFERENCE: "and WEIGHTSYNC_VLLM_SERVER: every vLLM server's worker claims an inference rank"}
    return {role: Deadline(seconds, setting, how[role]) for role in external_roles(job)}


def make_plan(job: Job, admitted: Admitted) -> Planned:
    """The plan from the trainers' layout, after checking every rank agrees on layout and transport."""
    reference = same_models(job, admitted)
    transports = {a.info.transport for a in admitted.values()}
    if len(transports) != 1:
        chosen = ", ".join(f"{who(role, rank)}: {a.info.transport} ({a.info.why})" for (role, rank), a in admitted.items())
        raise JobFailed(f"the ranks chose different transports: {chosen}", reasons.RANKS_DISAGREE)
    holdings = {rank: a.info.holds for (role, rank), a in admitted.items() if role == TRAINER and a.info.holds is not None}
    trainers = job.layout.world_size(TRAINER)
    held = [Holdings.from_json(holdings[t]) if t in holdings else Holdings.whole(reference) for t in range(trainers)]
    transport = transports.pop()

    def slices_of(rank: int):
        needs = needs_of(job.layout, admitted, rank)
        if needs is None:
            raise KeyError(f"{who(INFERENCE, rank)} did not say which slices it needs")
        return needs_from_json(rank, needs)

    try:
        needs = inference_needs(job.layout, reference, slices_of)
        can = capabilities_of(transport)
        plan = make_job_plan(reference, held, job.layout.world_size(INFERENCE), job.transfer.bucket_bytes, needs,
                             transport=transport, scatters=can.scatters, range_limit=can.range_limit)
    except (KeyError, ValueError) as e:
        what = "the slices the inference ranks need" if job.layout.sliced else "the version"
        raise JobFailed(f"{what} cannot be planned from what the trainer ranks hold: {e}",
                        reasons.RANKS_DISAGREE) from None
    return Planned(plan, transport, admitted)


def same_models(job: Job, admitted: Admitted) -> FlatLayout:
    """Trainer rank 0's layout, once every rank's matches it. Where one differs, LayoutMismatch
    names the rank whose model is not spec.model's (the trainers' first: a trainer that attached
    another model, not the inference rank that built spec.model, is the one to fix)."""
    reference = FlatLayout.from_json(admitted[(TRAINER, 0)].meta)
    for (role, rank), admission in admitted.items():
        try:
            reference.check_matches(FlatLayout.from_json(admission.meta), what=who(role, rank))
        except LayoutMismatch as e:
            differs = f"{who(role, rank)} holds a different model than trainer rank 0: {e}"
            try:
                from weightsync.model.build import meta_layout  # torch: only to tell which model is wrong

                spec = meta_layout(job.model)
            except Exception as why:  # noqa: BLE001 - the blame cannot be narrowed; the mismatch still fails the job
                raise LayoutMismatch(f"{differs} (spec.model cannot be built here to tell which is wrong: {why})") from None
            for suspect in sorted(admitted, key=lambda r: (r[0] != TRAINER, r[1])):
                try:
                    spec.check_matches(FlatLayout.from_json(admitted[suspect].meta), what=who(*suspect), here="spec.model")
                except LayoutMismatch as wrong:
                    fix = "attach the model spec.model describes, in spec.model.dtype" if suspect[0] == TRAINER else \
                        "serve the model spec.model describes, in spec.model.dtype"
                    raise LayoutMismatch(f"{who(*suspect)} holds another model than spec.model: {wrong}; {fix}") from None
            raise LayoutMismatch(differs) from None
    return reference


def needs_of(layout: Layout, admitted: Admitted, rank: int):
    """What an inference rank of a tensor-parallel replica said it needs (its slices, as JSON). A
    rank that has not joined (its pod beyond spec.inference.replicas: the job may scale to it)
    needs what the rank at its place in a replica that joined needs: the replicas are alike
    (maxReplicas takes one tensorParallel), and it is checked when it joins."""
    got = admitted.get((INFERENCE, rank))
    if got is not None:
        return got.info.needs
    group = layout.tp_group(rank)
    for (role, other), got in sorted(admitted.items()):
        mate = layout.tp_group(other)
        if role == INFERENCE and len(mate) == len(group) and other - mate.start == rank - group.start:
            return got.info.needs
    return None


def check_rejoin(layout: FlatLayout, transport: str, needs: Callable[[int], object], rank: int, meta: str,
                 info: RankInfo) -> None:
    """A rank that joins the running job must hold the same model, use the same transport and
    need the slices planned for it (`needs(rank)`)."""
    layout.check_matches(FlatLayout.from_json(meta), what=f"the rejoining pod {info.pod}")
    if info.transport != transport:
        raise JobFailed(f"the rejoining pod {info.pod} chose the {info.transport} transport ({info.why}); "
                        f"the job runs on {transport}", reasons.RANKS_DISAGREE)
    planned = needs(rank)
    if planned is not None and info.needs != planned:
        raise JobFailed(f"{who(INFERENCE, rank)} (pod {info.pod}) needs other slices than the plan gave its place in "
                        "its tensor-parallel replica: every replica must shard the model alike", reasons.RANKS_DISAGREE)
