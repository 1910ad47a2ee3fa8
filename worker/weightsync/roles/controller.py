"""The controller (ordinal 0): hosts the rendezvous, computes the plan once, says "go" for every
version, checks that every inference rank applied exactly what the trainers sent, and reports."""

from __future__ import annotations

import time

from ..contract import INFERENCE, TRAINER, WorkerContext
from ..flat import FlatLayout, LayoutMismatch
from ..plan import job_plan
from ..rendezvous import Host, ProofError, RankFailed, versions, who
from ..report import Reporter
from ..transfer import version_digest
from .common import JOIN_TIMEOUT, linger, log

SILENT_LIMIT = 15.0  # seconds without a heartbeat after which a rank counts as dead
BYE_TIMEOUT = 30.0

ME = "controller"


class JobFailed(RuntimeError):
    pass


def run(ctx: WorkerContext) -> int:
    spec = ctx.job.spec
    layout = ctx.job.layout
    trainers, inferences = layout.world_size(TRAINER), layout.world_size(INFERENCE)
    timeout = float(spec["transfer"]["timeoutSeconds"])
    reporter = Reporter(ctx.job, ctx.report_to_kubernetes)
    host = Host(ctx.store_port, ctx.token, layout, silent_limit=min(timeout, SILENT_LIMIT))
    log(ME, f"rendezvous on port {ctx.store_port}: waiting for {trainers} trainer and {inferences} inference ranks")
    delivered, loss = 0, None
    try:
        admitted = host.admit(JOIN_TIMEOUT)
        plan, transport = _plan(ctx, admitted)
        host.publish_plan(plan.to_json(), {rank: admitted[(INFERENCE, rank)][0] for rank in range(inferences)})
        log(ME, f"transport {transport}; plan:\n{plan.table()}")
        for version, step in versions(spec):
            host.wait_ranks([f"ready/{version}/{r}" for r in range(trainers)], f"the trainers to be ready for version {version}")
            host.set(f"go/{version}", "1")
            start = time.monotonic()
            host.wait_ranks([f"sent/{version}/{r}" for r in range(trainers)], f"the trainers to send version {version}",
                            timeout, poll_max=0.002)
            sent = [host.get_json(f"sent/{version}/{r}") for r in range(trainers)]
            reference = version_digest({int(o): c for s in sent for o, c in s["checksums"].items()})
            host.set(f"ref/{version}", reference)
            host.wait_ranks([f"applied/{version}/{r}" for r in range(inferences)],
                            f"the inference ranks to apply version {version}", timeout, poll_max=0.002)
            seconds = time.monotonic() - start
            for r in range(inferences):
                applied = host.get_json(f"applied/{version}/{r}")
                if applied["digest"] != reference:
                    host.store.add("verify_failures", 1)
                    raise JobFailed(f"{who(INFERENCE, r)} applied version {version} with digest {applied['digest'][:16]}, "
                                    f"but the trainers sent {reference[:16]}")
            if sent[0].get("loss") is not None:
                loss = sent[0]["loss"]
            record = reporter.transfer(version, step, plan.version_bytes * inferences, seconds, transport, loss,
                                       version_bytes=plan.version_bytes, inference_ranks=inferences)
            host.set(f"done/{version}", record)
            delivered += 1
    except (JobFailed, RankFailed, ProofError, LayoutMismatch, TimeoutError, ValueError) as e:
        return _fail(ctx, host, reporter, str(e), delivered, loss)
    message = f"{delivered} versions delivered to and verified on {inferences} inference ranks"
    host.end("Succeeded", message)
    reporter.completion("Succeeded", message, delivered, failed_verifications=0, final_loss=_rounded(loss))
    missing = host.wait_byes(BYE_TIMEOUT)
    if missing:
        log(ME, f"no goodbye within {BYE_TIMEOUT:.0f}s from {', '.join(missing)}")
    linger(ctx, ME)
    return 0


def _plan(ctx: WorkerContext, admitted: dict):
    """The plan from the trainers' layout, after checking every rank agrees on layout and transport."""
    reference = FlatLayout.from_json(admitted[(TRAINER, 0)][1])
    for (role, rank), (_, meta, _) in admitted.items():
        try:
            reference.check_matches(FlatLayout.from_json(meta), what=who(role, rank))
        except LayoutMismatch as e:
            raise LayoutMismatch(f"{who(role, rank)} holds a different model than trainer rank 0: {e}") from None
    transports = {info["transport"] for _, _, info in admitted.values()}
    if len(transports) != 1:
        chosen = ", ".join(f"{who(role, rank)}: {info['transport']} ({info['why']})" for (role, rank), (_, _, info) in admitted.items())
        raise JobFailed(f"the ranks chose different transports: {chosen}")
    return job_plan(ctx.job, reference), transports.pop()


def _fail(ctx: WorkerContext, host: Host, reporter: Reporter, message: str, delivered: int, loss) -> int:
    log(ME, f"the job failed: {message}")
    host.end("Failed", message)
    reporter.completion("Failed", message, delivered, failed_verifications=host.store.add("verify_failures", 0), final_loss=_rounded(loss))
    host.wait_byes(5.0)
    linger(ctx, ME)
    return 1


def _rounded(loss: float | None) -> float | None:
    return None if loss is None else round(loss, 6)
