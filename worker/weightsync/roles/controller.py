"""The controller (ordinal 0): hosts the rendezvous, computes the plan once (by holder when the
trainers hold shards: plan/holders.py), says "go" for every version once every trainer rank is ready
with it, checks that every inference rank applied exactly what the trainers sent, and reports.
The trainers decide how many versions there are (the built-in trainer as spec.training says, a
user's script as it publishes): the job's versions end once every trainer rank closed.

Inference ranks that restart are taken back at the next version (roster.py); when the trainers
are done, the final version is sent again to any that came back after it went out, so that the
job ends with every inference rank on it.

The rendezvous lives in this process only, so a controller that starts again cannot resume: it
finds its earlier start in the job's status, and fails the job saying so (reason
ControllerRestarted) rather than silently running it again from step 0.

With vLLM servers (spec.inference.engine vllm) the controller also drives each version's load: once
every receiver has the version received and verified (staged), it asks every server at once to
load it between two steps (vllm_backend/control.py), and fails the version naming the pod whose
server does not."""

from __future__ import annotations

import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Mapping

from weightsync.job import CONTROLLER, INFERENCE, TRAINER, Delta, Job, WorkerContext, external_roles, reasons
from weightsync.job.errors import JobFailed, failure_of
from weightsync.job.states import FAILED, SUCCEEDED
from weightsync.model.build import meta_layout
from weightsync.model.flat import FlatLayout, LayoutMismatch
from weightsync.plan.holders import Holdings
from weightsync.plan.job import bases, delta_in_effect, inference_needs, make_job_plan
from weightsync.plan.sliced_plan import needs_from_json
from weightsync.rendezvous.claims import Claims
from weightsync.rendezvous.join_phase import TrainersRestart
from weightsync.rendezvous.messages import Admission, RankInfo, Round, SentReport
from weightsync.rendezvous.protocol import HEARTBEAT, Keys, control_key, update_proof, who
from weightsync.rendezvous.resume import resume
from weightsync.rendezvous.roster import Deadline, Host
from weightsync.rendezvous.store.table import StoreError
from weightsync.roles.receivers import Receivers, counts, states
from weightsync.roles.records import Reporter
from weightsync.roles.scaling import ScaleWatch
from weightsync.runtime import health
from weightsync.runtime.faults import pause_point
from weightsync.runtime.metrics import ControllerMetrics
from weightsync.runtime.rank import JOIN_TIMEOUT, linger, log
from weightsync.transfer.receive import reference_digests, reference_for
from weightsync.transport import capabilities_of
from weightsync.vllm_backend.control import ControlError, Server, Session, Unreachable, UpdateTimes
from weightsync.vllm_backend.guard import MIDDLEWARE

SILENT_LIMIT = 8.0  # seconds without a heartbeat after which a rank counts as dead or frozen
# a trainer's: its silence fails the job (an inference rank's only makes it away until it rejoins),
# so it is given the time a training step or a checkpoint's save may hold a busy machine's CPU
TRAINER_SILENT_LIMIT = 20.0
BYE_TIMEOUT = 30.0
# seconds for an external vLLM server that joined (its model loaded) to serve: vLLM profiles, sizes
# its KV cache and compiles after the weight-transfer engine is built
SERVE_TIMEOUT = 900.0
REPORT_SLACK = 10.0  # seconds for a trainer to report a round after its own deadlines ran out

ME = "controller"


class RoundDropped(RuntimeError):
    """A trainer rank stopped while a version was on its way, in a job whose trainers resume: the
    version is dropped (its bytes half sent, none verified) and the trainers resume."""

    def __init__(self, rnd: Round, why: TrainersRestart):
        self.round, self.why = rnd, why
        super().__init__(f"{why}, while {rnd.name} was on its way")


def run(ctx: WorkerContext, metrics: ControllerMetrics | None = None) -> int:
    """The job, to its end; `metrics`: where its figures go for the pod's /metrics."""
    layout = ctx.job.layout
    trainers, inferences = layout.world_size(TRAINER), layout.world_size(INFERENCE)
    timeout = ctx.job.transfer.timeout
    metrics = metrics or ControllerMetrics()
    reporter = Reporter(ctx.job, ctx.report_to_kubernetes, metrics=metrics)
    status = reporter.status()
    if (status.get("completion") or {}).get("state"):
        log(ME, f"started again after the job ended ({status['completion']['state']}); nothing to do")
        linger(ctx, ME)
        return 0
    starts = (status.get("controller") or {}).get("starts", 0) + 1
    reporter.started(starts)
    host = Host(ctx.store_port, ctx.token, layout, silent_limit=min(timeout, SILENT_LIMIT),
                trainer_silent_limit=min(timeout, TRAINER_SILENT_LIMIT),
                away_limit=ctx.job.inference.away_grace_seconds, min_available=ctx.job.inference.min_available,
                running=ctx.job.inference.running_ranks, say=lambda m: log(ME, m), address=ctx.pod_ip,
                job=ctx.job.identity)
    host.publish_job(ctx.job, ctx.network_mode)  # what external ranks read instead of a spec file
    if ctx.job.inference.external:  # the servers' workers claim their ranks (rendezvous/claims.py)
        host.claims = Claims(layout, ctx.job.identity, host.trainer_layout, lambda m: log(ME, m))
    watch = Receivers(host, reporter.receivers)  # status.receivers, once the ranks joined
    scale = None  # the inference pods' count, where it may change while the job runs
    if ctx.job.inference.max_replicas is not None and reporter.api is not None:
        scale = ScaleWatch(host, reporter.inference_replicas, ctx.job.inference.ranks_of_pods, lambda m: log(ME, m))
        scale.start()
    health.ready()
    if starts > 1:
        last = (status.get("transfer") or {}).get("version")
        where = f"after version {last}" if last is not None else "before the first version"
        return _fail(ctx, host, reporter, JobFailed(
            f"the controller started again (start {starts}) {where}: the rendezvous it hosted, and with it the "
            "plan and every rank's progress, is gone, so the job cannot resume; create the job again to rerun it",
            reasons.CONTROLLER_RESTARTED), 0, None, watch)
    scalable = f" (of {inferences} it may scale to)" if host.running < inferences else ""
    log(ME, f"rendezvous on {ctx.pod_ip}:{ctx.store_port}: waiting for {trainers} trainer and {host.running} inference "
            f"ranks{scalable}")
    external = _external(ctx.job)
    host.external = set(external)
    for role, limit in external.items():
        log(ME, f"the {role} ranks are external: start them with the job's join variables ({limit.how}) within "
                f"{limit.seconds:.0f}s ({limit.setting})")
    reached: set[int] = set()  # the versions verified on at least one inference rank
    loss = None
    try:
        admitted = host.admit(JOIN_TIMEOUT, external)
        plan, transport = _plan(ctx, admitted)
        host.check_rejoin = partial(_check_rejoin, plan.layout, transport,
                                    partial(_needs, layout, admitted) if layout.sliced else lambda rank: None)
        joined = {rank: got for (role, rank), got in admitted.items() if role == INFERENCE}
        host.publish_plan(plan.to_json(), {rank: got.endpoint for rank, got in joined.items()},
                          {rank: got.info for rank, got in joined.items()})
        log(ME, f"transport {transport}; plan:\n{plan.table()}")
        watch.update(force=True)
        watch.start()
        delta_on, why = delta_in_effect(ctx.job.transfer.delta, transport, capabilities_of(transport).patches,
                                        plan.sliced)
        log(ME, why)
        delta = Delta(delta_on, ctx.job.transfer.delta.full_every)
        host.resumable = ctx.job.trainer.resumes
        version, whole = 0, -1  # whole: the first version after the trainers resumed
        last: tuple[int, int | None] | None = None  # the last version delivered, and its step
        while True:
            try:
                if not host.next_version(version):  # until every trainer rank closed
                    break
            except TrainersRestart as e:
                _resume(ctx, host, reporter, (plan, transport, admitted), version, last, e)
                whole = version
                continue
            published = time.monotonic()  # every trainer rank is ready with it
            rnd = host.start_round(version, bases=partial(bases, delta if version != whole else Delta(False, 1),
                                                          version, 0))
            try:
                sent, applied = _round(ctx, host, reporter, plan, rnd, transport, timeout)
            except RoundDropped as e:
                host.set(Keys.dropped(version), str(e.why))  # its receivers take none of it
                log(ME, f"{e}: {rnd.name} is dropped (its bytes are half sent, none was verified), and the inference "
                        "ranks keep the version they serve")
                version += 1  # never a number reused for other bytes
                _resume(ctx, host, reporter, (plan, transport, admitted), version, last, e.why)
                whole = version
                continue
            except TrainersRestart as e:  # an inference rank failed, blamed on a trainer that stopped
                raise JobFailed(f"{e}, while {rnd.name} was on its way", reasons.TRAINER_RESTARTED) from None
            if sent[0].loss is not None:
                loss = sent[0].loss
            if applied:  # a round whose receivers were all away delivered nothing
                metrics.publish_to_serving.observe(time.monotonic() - published)
                _reached(reached, version, metrics)
                last = (version, sent[0].step)
            if version >= 2:
                host.forget(version - 2)
            version += 1
        if not version:
            raise JobFailed("every trainer rank closed without publishing a version", reasons.NO_VERSIONS)
        final, again = version - 1, 0
        while host.behind(final):  # ranks that came back after the final version
            host.wait_back(final)
            if not host.behind(final):  # the last of them was dropped meanwhile
                break
            again += 1
            rnd = host.start_round(final, again, bases=partial(bases, delta, final, again))
            if _round(ctx, host, reporter, plan, rnd, transport, timeout)[1]:
                _reached(reached, final, metrics)
        pause_point(CONTROLLER, 0, "delivered", final)
    except (JobFailed, TimeoutError, ValueError, StoreError) as e:  # a ValueError or StoreError of a bug too
        return _fail(ctx, host, reporter, e, len(reached), loss, watch)
    finally:
        if scale is not None:
            scale.stop()
    watch.stop()  # every inference rank's last state, before the ranks leave
    delivered = len(reached)
    message = f"{delivered} versions delivered to and verified on {host.running} inference ranks"
    if host.rejoins():
        message += f" ({host.rejoins()} rejoins)"
    host.end(SUCCEEDED, message)
    # the goodbyes before the completion: once it is reported, the operator removes the job's pods,
    # this one and its store with them, and a rank still waiting on the store would fail
    missing = host.wait_byes(BYE_TIMEOUT)
    if missing:
        log(ME, f"no goodbye within {BYE_TIMEOUT:.0f}s from {', '.join(missing)}")
    reporter.completion(SUCCEEDED, message, delivered, failed_verifications=0, final_loss=_rounded(loss))
    linger(ctx, ME)
    return 0


def _external(job: Job) -> dict[str, Deadline]:
    """The roles whose ranks the user starts, each with how long its ranks have to join."""
    seconds, setting = float(job.trainer.attach_timeout_seconds), "spec.trainer.attachTimeoutSeconds"
    world = job.layout.world_size(TRAINER)
    how = {TRAINER: f"RANK 0..{world - 1}, WORLD_SIZE={world}" if world > 1 else "RANK=0, WORLD_SIZE=1",
           INFERENCE: "and WEIGHTSYNC_VLLM_SERVER: every vLLM server's worker claims an inference rank"}
    return {role: Deadline(seconds, setting, how[role]) for role in external_roles(job)}


def _round(ctx: WorkerContext, host: Host, reporter: Reporter, plan, rnd: Round, transport: str,
           timeout: float) -> tuple[list[SentReport], int]:
    """One round: wait for the trainers' reports, publish the reference digest, wait for every
    receiver still there to apply it, check the digests; report it. Returns the trainers' reports
    and how many inference ranks applied the version."""
    start = time.monotonic()
    # A trainer may spend its timeout dialling a receiver and its timeout again on a send that
    # makes no progress before it reports the receiver lost: wait for that report, not past it.
    try:
        sent = host.collect_sent(rnd, 2 * timeout + REPORT_SLACK)
    except TrainersRestart as e:  # a trainer stopped before every byte of the round was sent
        raise RoundDropped(rnd, e) from None
    sent_at = time.monotonic()
    pause_point(CONTROLLER, 0, "verifying", rnd.version)
    reference = reference_digests(plan, sent, rnd.receivers)
    carried = any(s.checksums or s.receiver_checksums for s in sent)  # nothing: the round reached no one
    if not host.has(Keys.ref(rnd.version)):
        if carried:  # the first sending that reached a rank: what its receivers, and every repeat, check
            host.set(Keys.ref(rnd.version), reference)
    else:
        first = host.get(Keys.ref(rnd.version)).decode()
        for r in rnd.receivers:
            was, now = reference_for(first, r), reference_for(reference, r)
            if was is not None and was != now:
                raise JobFailed(f"the trainers sent {rnd.name} to {who(INFERENCE, r)} with digest {now[:16]}, not the "
                                f"{was[:16]} they sent the first time", reasons.VERIFICATION_FAILED)
    verified_at = time.monotonic()
    loads = _load_on_servers(ctx, host, rnd, timeout) if ctx.job.inference.runs_vllm else None
    loaded_at = time.monotonic()
    applied = host.collect_applied(rnd, timeout)
    seconds = time.monotonic() - start
    for r, got in sorted(applied.items()):
        want = reference_for(reference, r) or ""
        if got["digest"] != want:
            host.store.add(Keys.VERIFY_FAILURES, 1)
            raise JobFailed(f"{who(INFERENCE, r)} applied version {rnd.version} with digest {got['digest'][:16]}, "
                            f"but the trainers sent {want[:16]}", reasons.VERIFICATION_FAILED)
        if got.get("refused"):
            log(ME, f"{who(INFERENCE, r)} could not apply {got['refused']} patch(es) of {rnd.name} ({got['why_refused']}); "
                    "the trainers sent those buckets whole")
    host.holding(rnd.version, applied)
    reporter.metrics.states(counts(states(host.seats, rnd.version)))
    if rnd.again or host.rejoins():
        reporter.rejoins({INFERENCE: host.rejoins(), TRAINER: host.resumes})
    loss, step = sent[0].loss, sent[0].step
    changed, compared = sum(s.changed for s in sent), sum(s.compared for s in sent)
    extra = {"changed": round(changed / compared, 6)} if compared else {}
    if loads is not None:
        extra["stall_seconds"] = round(loads.slowest.stall, 4)
    extra["phases"] = _phases(sent_at - start, verified_at - sent_at, loads, applied, start + seconds - loaded_at)
    record = reporter.transfer(rnd.version, step, sum(plan.bytes_for(r) for r in applied), seconds, transport, loss,
                               wire_bytes=sum(s.wire_bytes for s in sent), delta_ranks=len(rnd.bases),
                               version_bytes=plan.version_bytes, inference_ranks=len(applied), again=rnd.again, **extra)
    host.set(Keys.done(rnd.version, rnd.again), record)
    return sent, len(applied)


def _reached(reached: set[int], version: int, metrics: ControllerMetrics) -> None:
    """`version` was verified on an inference rank: a version delivered, the first time."""
    if version not in reached:
        reached.add(version)
        metrics.delivered(version)


@dataclass(frozen=True)
class ServerLoads:
    """How a round's load into the vLLM servers went, as the controller saw it."""

    staging: float  # seconds from the reference digest to every receiver staged (received and verified)
    prepare: float | None  # with loadAhead, the slowest worker's load into its second copy, before the pause
    slowest: UpdateTimes  # each call's and the stall's longest over the servers


def _load_on_servers(ctx: WorkerContext, host: Host, rnd: Round, timeout: float) -> ServerLoads:
    """Once every receiver of the round has it staged, every vLLM server loads it at once; returns
    how long the staging took and each server's calls. A server that answers that it did not load
    it fails the job; one that stopped answering goes out of the round if its ranks went away with
    it (killed, preempted: they rejoin and get the next round in full), else it fails the job."""
    began = time.monotonic()
    staged = host.collect_staged(rnd, timeout)
    staging = time.monotonic() - began
    pause_point(CONTROLLER, 0, "staged", rnd.version)
    proof = update_proof(ctx.token, ctx.job.identity, rnd.version)
    key = control_key(ctx.token, ctx.job.identity)
    seats = {r: host.seats[r] for r in staged}
    # one update per server: a tensor-parallel server's workers are several ranks, and vLLM's update
    # has every worker load its own staged version; {server: its ranks}, named by the first
    servers: dict[str, list[int]] = {}
    for rank in sorted(seats):
        servers.setdefault(seats[rank].info.server, []).append(rank)

    def failed(rank: int, e: ControlError) -> JobFailed:
        return JobFailed(f"{who(INFERENCE, rank)} (pod {seats[rank].info.pod}) did not load {rnd.name} "
                         f"into its vLLM server: {e}", reasons.SERVER_LOAD_FAILED)

    def load(rank: int) -> UpdateTimes | Unreachable:
        try:
            server = Server(seats[rank].info.server, key)
            if ctx.job.inference.external:  # a server the user started joined as vLLM built it, before it served
                server.wait_up(SERVE_TIMEOUT)
                if server.open_to_clients():  # its control routes, which relabel and reset, would be any client's
                    raise ControlError(f"{server.url} answers its control routes to any client: start it with "
                                       f"--middleware {MIDDLEWARE} (docs/jobs.md, vLLM)")
            workers = servers[server.url]
            return server.update(rnd.version, proof, timeout, Session.of([staged[r] for r in workers]))
        except Unreachable as e:
            return e  # judged on this thread, which keeps the roster: its ranks may be gone with it
        except ControlError as e:
            raise failed(rank, e) from None

    firsts = [ranks[0] for ranks in servers.values()]
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        loads = dict(zip(firsts, pool.map(load, firsts)))
    for rank, got in loads.items():
        if isinstance(got, Unreachable):
            if not host.gone(servers[seats[rank].info.server], 2 * host.silent_limit + 2 * HEARTBEAT):
                raise failed(rank, ControlError(f"{got}; its workers beat on, so the server is alive")) from None
            log(ME, f"the vLLM server of {who(INFERENCE, rank)} stopped answering while it loaded {rnd.name} "
                    f"({got}) and its ranks went away: {rnd.name} goes on without them")
    times = [t for t in loads.values() if isinstance(t, UpdateTimes)]
    ahead = [got["prepare_seconds"] for got in staged.values() if got.get("prepare_seconds") is not None]
    return ServerLoads(staging, max(ahead) if ahead else None, UpdateTimes.slowest(times))


def _phases(transfer: float, verify: float, loads: ServerLoads | None, applied: dict[int, dict],
            after: float) -> dict[str, float]:
    """Where a round's seconds went (the round record's phases): the transfer (go to every
    trainer's report), the reference digest, with vLLM servers the staging, each control call,
    the workers' own load (the slowest) and the stall; then the wait for every rank's applied."""
    phases = {"transfer": transfer, "verify": verify}
    if loads is not None:
        phases["staging"] = loads.staging
        if loads.prepare is not None:
            phases["prepare"] = loads.prepare
        phases.update(loads.slowest.to_json())
        engine = [got["load_seconds"] for got in applied.values() if got.get("load_seconds") is not None]
        if engine:
            phases["load"] = max(engine)
    phases["applied"] = after
    return {k: round(v, 6) for k, v in phases.items()}


def _plan(ctx: WorkerContext, admitted: dict[tuple[str, int], Admission]):
    """The plan from the trainers' layout, after checking every rank agrees on layout and transport."""
    reference = same_models(ctx.job, admitted)
    transports = {a.info.transport for a in admitted.values()}
    if len(transports) != 1:
        chosen = ", ".join(f"{who(role, rank)}: {a.info.transport} ({a.info.why})" for (role, rank), a in admitted.items())
        raise JobFailed(f"the ranks chose different transports: {chosen}", reasons.RANKS_DISAGREE)
    holdings = {rank: a.info.holds for (role, rank), a in admitted.items() if role == TRAINER and a.info.holds is not None}
    trainers = ctx.job.layout.world_size(TRAINER)
    held = [Holdings.from_json(holdings[t]) if t in holdings else Holdings.whole(reference) for t in range(trainers)]
    transport = transports.pop()

    def slices_of(rank: int):
        needs = _needs(ctx.job.layout, admitted, rank)
        if needs is None:
            raise KeyError(f"{who(INFERENCE, rank)} did not say which slices it needs")
        return needs_from_json(rank, needs)

    try:
        needs = inference_needs(ctx.job.layout, reference, slices_of)
        can = capabilities_of(transport)
        plan = make_job_plan(reference, held, ctx.job.layout.world_size(INFERENCE),
                             ctx.job.transfer.bucket_bytes, needs, transport=transport,
                             scatters=can.scatters, range_limit=can.range_limit)
    except (KeyError, ValueError) as e:
        what = "the slices the inference ranks need" if ctx.job.layout.sliced else "the version"
        raise JobFailed(f"{what} cannot be planned from what the trainer ranks hold: {e}",
                        reasons.RANKS_DISAGREE) from None
    return plan, transport


def same_models(job: Job, admitted: Mapping[tuple[str, int], Admission]) -> FlatLayout:
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


def _needs(layout, admitted: dict[tuple[str, int], Admission], rank: int):
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


def _resume(ctx: WorkerContext, host: Host, reporter: Reporter, planned, version: int,
            last: tuple[int, int | None] | None, why: TrainersRestart) -> None:
    """A trainer rank stopped between two versions: every trainer rank starts again, resumes from
    its checkpoint and attaches with the model, transport and shards it had (`planned`: the plan,
    the transport and what the ranks joined with); version `version` comes next."""
    plan, transport, admitted = planned
    serving = f"version {last[0]}" if last is not None else "no version yet"
    log(ME, f"{why}: the trainers resume from their checkpoint (resume {host.resumes + 1}); the inference ranks serve "
            f"{serving} meanwhile")

    def check(rank: int, got: Admission) -> None:
        _check_rejoin(plan.layout, transport, lambda _: None, rank, got.meta, got.info)  # its model and transport
        if got.info.holds != admitted[(TRAINER, rank)].info.holds:
            raise JobFailed(f"{who(TRAINER, rank)} resumed holding other shards than it joined with (pod "
                            f"{got.info.pod}): each rank must hold its own as before", reasons.RANKS_DISAGREE)

    resume(host, ctx.job.trainer.attach_timeout_seconds, version, *(last or (None, None)), check)
    reporter.rejoins({INFERENCE: host.rejoins(), TRAINER: host.resumes})
    log(ME, f"every trainer rank resumed; version {version} comes next, whole to every inference rank")


def _check_rejoin(layout: FlatLayout, transport: str, needs, rank: int, meta: str, info: RankInfo) -> None:
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


def _fail(ctx: WorkerContext, host: Host, reporter: Reporter, error: Exception, delivered: int, loss,
          watch: Receivers) -> int:
    reason, message = failure_of(error)
    if reason == reasons.CONTROLLER_ERROR:  # no failure of the job's: a bug, its traceback in the log
        traceback.print_exception(error)
    log(ME, f"the job failed: {message}")
    watch.stop()
    try:
        host.end(FAILED, message, reason)
    except StoreError as e:  # a full store takes no more keys: the completion below still says why
        log(ME, f"could not tell the ranks that the job ended: {e}")
    host.wait_byes(5.0)  # as for success: the ranks see the end before the pods go
    reporter.completion(FAILED, message, delivered, reason=reason,
                        failed_verifications=host.store.add(Keys.VERIFY_FAILURES, 0), final_loss=_rounded(loss))
    linger(ctx, ME)
    return 1


def _rounded(loss: float | None) -> float | None:
    return None if loss is None else round(loss, 6)
