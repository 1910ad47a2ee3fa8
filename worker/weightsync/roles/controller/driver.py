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
load it between two steps (loads.py). A rank whose load failed part-way (any engine) is counted
behind and receives the next version whole (spec.inference.onLoadFailure rollBack), or has failed
the job (failJob)."""

from __future__ import annotations

import time
import traceback
from functools import partial
from typing import Mapping

from weightsync.job import CONTROLLER, INFERENCE, TRAINER, Delta, WorkerContext, reasons
from weightsync.job.errors import JobFailed, failure_of
from weightsync.job.states import FAILED, SUCCEEDED
from weightsync.plan.job import bases, delta_in_effect
from weightsync.rendezvous.join_phase import Deadline, TrainersRestart
from weightsync.rendezvous.messages import Applied, Reference, Round, SentReport
from weightsync.rendezvous.plan_shares import publish_shares
from weightsync.rendezvous.policy import Policy
from weightsync.rendezvous.proofs import control_key
from weightsync.rendezvous.protocol import who
from weightsync.rendezvous.resume import resume
from weightsync.rendezvous.roster import Host
from weightsync.rendezvous.store.table import StoreError
from weightsync.roles.controller.admissions import Admissions
from weightsync.roles.controller.loads import load_on_servers, phases
from weightsync.roles.controller.planning import Planned, external_deadlines, make_plan
from weightsync.roles.controller.receivers import Receivers, counts, states
from weightsync.roles.controller.records import Reporter
from weightsync.roles.controller.scaling import ScaleWatch
from weightsync.runtime import health
from weightsync.runtime.faults import pause_point
from weightsync.runtime.metrics import ControllerMetrics
from weightsync.runtime.rank import JOIN_TIMEOUT, linger, log
from weightsync.transfer.receive import reference_digests
from weightsync.transport import capabilities_of
from weightsync.vllm_backend.control import Steps

SILENT_LIMIT = 8.0  # seconds without a heartbeat after which a rank counts as dead or frozen
# a trainer's: its silence fails the job (an inference rank's only makes it away until it rejoins),
# so it is given the time a training step or a checkpoint's save may hold a busy machine's CPU
TRAINER_SILENT_LIMIT = 20.0
BYE_TIMEOUT = 30.0
REPORT_SLACK = 10.0  # seconds for a trainer to report a round after its own deadlines ran out

ME = "controller"


class RoundDropped(RuntimeError):
    """A trainer rank stopped while a version was on its way, in a job whose trainers resume: the
    version is dropped (its bytes half sent, none verified) and the trainers resume."""

    def __init__(self, rnd: Round, why: TrainersRestart):
        self.round, self.why = rnd, why
        super().__init__(f"{why}, while {rnd.name} was on its way")


def run(ctx: WorkerContext, metrics: ControllerMetrics | None = None, driven: Mapping[str, Steps] | None = None) -> int:
    """The job, to its end; `metrics`: where its figures go for the pod's /metrics; `driven`: the
    vLLM servers this process drives otherwise than over HTTP, by the name their workers claimed
    under (a controller run in its trainer's process: integrations/ranks.LocalController)."""
    reporter = Reporter(ctx.job, ctx.report_to_kubernetes, metrics=metrics or ControllerMetrics())
    status = reporter.status()
    if (status.get("completion") or {}).get("state"):
        log(ME, f"started again after the job ended ({status['completion']['state']}); nothing to do")
        linger(ctx, ME)
        return 0
    starts = (status.get("controller") or {}).get("starts", 0) + 1
    reporter.started(starts)
    return Controller(ctx, reporter, driven).run(starts, status)


def policy_of(ctx: WorkerContext, external: dict[str, Deadline]) -> Policy:
    """The roster's rules for the job, from its spec."""
    job, timeout = ctx.job, ctx.job.transfer.timeout
    return Policy(silent_limit=min(timeout, SILENT_LIMIT), trainer_silent_limit=min(timeout, TRAINER_SILENT_LIMIT),
                  away_limit=job.inference.away_grace_seconds, min_available=job.inference.min_available,
                  running=job.inference.running_ranks, external=frozenset(external), resumable=job.trainer.resumes,
                  tp_replicas=() if job.inference.runs_vllm else job.layout.tp_groups)


class Controller:
    """One start of the controller: the state it keeps while the job runs, declared here once;
    its steps (admit and plan, each round, a resume, the end) are its methods."""

    ctx: WorkerContext
    reporter: Reporter  # status and the one-line records; its metrics are the pod's
    metrics: ControllerMetrics
    timeout: float  # spec.transfer.timeoutSeconds
    external: dict[str, Deadline]  # the roles whose ranks the user starts, with their time to join
    host: Host  # the rendezvous and the roster of ranks
    watch: Receivers  # status.receivers, once the ranks joined
    scale: ScaleWatch | None  # the inference pods' count, where it may change while the job runs
    planned: Planned | None  # once every rank joined
    reached: set[int]  # the versions verified on at least one inference rank
    loss: float | None  # the trainers' loss as last reported
    last: tuple[int, int | None] | None  # the last version delivered, and its step
    admissions: Admissions | None  # with vLLM servers: the fleet's version, told to each (admission.py)
    load_failed: dict[int, Applied]  # the last round's receivers whose load failed part-way (onLoadFailure rollBack)
    driven: Mapping[str, Steps]  # the vLLM servers driven from this process otherwise than over HTTP (run)

    def __init__(self, ctx: WorkerContext, reporter: Reporter, driven: Mapping[str, Steps] | None = None,
                 host: Host | None = None):
        """`host`: the rendezvous to run the job on, built for ctx's job; None (a controller's pod):
        one on ctx's store port, with the rules its spec gives (policy_of), saying its lines here."""
        if host is not None and host.layout != ctx.job.layout:
            raise ValueError(f"the Host given to the controller is laid out for {host.layout}, not for the job's "
                             f"{ctx.job.layout}: build it with the job's layout")
        self.ctx, self.reporter, self.metrics, self.driven = ctx, reporter, reporter.metrics, driven or {}
        self.timeout = ctx.job.transfer.timeout
        self.external = external_deadlines(ctx.job)
        self.host = host if host is not None else Host(ctx.store_port, ctx.token, ctx.job.layout,
                                                       policy_of(ctx, self.external), say=self.say,
                                                       address=ctx.pod_ip, job=ctx.job.identity)
        self.host.publish_job(ctx.job, ctx.network_mode)  # what external ranks read instead of a spec file
        self.watch = Receivers(self.host, reporter.receivers)
        self.scale = None
        if ctx.job.inference.max_replicas is not None and reporter.api is not None:
            self.scale = ScaleWatch(self.host, reporter.inference_replicas, ctx.job.inference.ranks_of_pods, self.say)
            self.scale.start()
        self.planned, self.reached, self.loss, self.last = None, set(), None, None
        self.admissions, self.load_failed = None, {}
        if ctx.job.inference.runs_vllm:
            self.admissions = Admissions(self.host, control_key(ctx.token, ctx.job.identity),
                                         ctx.job.inference.max_version_lag, self.say, frozenset(self.driven))

    def say(self, message: str) -> None:
        log(ME, message)

    def run(self, starts: int, status: dict) -> int:
        """The job, to its end, at the controller's `starts`-th start (`status`: the job's status as it was)."""
        ctx, host, layout = self.ctx, self.host, self.ctx.job.layout
        health.ready()
        if starts > 1:
            last = (status.get("transfer") or {}).get("version")
            where = f"after version {last}" if last is not None else "before the first version"
            return self.fail(JobFailed(
                f"the controller started again (start {starts}) {where}: the rendezvous it hosted, and with it the "
                "plan and every rank's progress, is gone, so the job cannot resume; create the job again to rerun it",
                reasons.CONTROLLER_RESTARTED))
        trainers, inferences = layout.world_size(TRAINER), layout.world_size(INFERENCE)
        scalable = f" (of {inferences} it may scale to)" if host.running < inferences else ""
        self.say(f"rendezvous on {ctx.pod_ip}:{ctx.store_port}: waiting for {trainers} trainer and {host.running} "
                 f"inference ranks{scalable}")
        for role, limit in self.external.items():
            self.say(f"the {role} ranks are external: start them with the job's join variables ({limit.how}) within "
                     f"{limit.seconds:.0f}s ({limit.setting})")
        error = None
        try:
            self.versions()
        except Exception as e:  # noqa: BLE001 - the job's failures with their reasons; anything else is a bug
            error = e  # (ControllerError, its traceback in the log), never a restarted controller
        finally:
            if self.scale is not None:
                self.scale.stop()
            if self.admissions is not None:  # the last word: the servers serve on what they hold
                self.admissions.end()
        return self.succeed() if error is None else self.fail(error)

    def versions(self) -> None:
        """Admit the ranks, plan, and deliver every version the trainers publish; then the final
        one again to the inference ranks that came back after it went out."""
        ctx, host = self.ctx, self.host
        planned = self.planned = make_plan(ctx.job, host.admit(JOIN_TIMEOUT, self.external))
        joined = {rank: got for (role, rank), got in planned.admitted.items() if role == INFERENCE}
        host.publish_plan(publish_shares(host, host.token, planned.plan), {rank: got.endpoint for rank, got in joined.items()},
                          {rank: got.info for rank, got in joined.items()},
                          check_rejoin=partial(planned.check_rejoin, ctx.job.layout))
        self.say(f"transport {planned.transport}; plan:\n{planned.plan.table()}")
        self.watch.update(force=True)
        self.watch.start()
        if self.admissions is not None:
            self.admissions.start()
        delta_on, why = delta_in_effect(ctx.job.transfer.delta, planned.transport,
                                        capabilities_of(planned.transport).patches, planned.plan.sliced)
        self.say(why)
        delta = Delta(delta_on, ctx.job.transfer.delta.full_every)
        version, whole = 0, -1  # whole: the first version after the trainers resumed
        while True:
            try:
                if not host.next_version(version):  # until every trainer rank closed
                    break
            except TrainersRestart as e:
                self.resume(version, e)
                whole = version
                continue
            published = time.monotonic()  # every trainer rank is ready with it
            rnd = host.start_round(version, bases=partial(bases, delta if version != whole else Delta(False, 1),
                                                          version, 0))
            try:
                sent, applied = self.round(rnd)
            except RoundDropped as e:
                host.say_dropped(version, str(e.why))  # its receivers take none of it
                self.say(f"{e}: {rnd.name} is dropped (its bytes are half sent, none was verified), and the inference "
                         "ranks keep the version they serve")
                version += 1  # never a number reused for other bytes
                self.resume(version, e.why)
                whole = version
                continue
            except TrainersRestart as e:  # an inference rank failed, blamed on a trainer that stopped
                raise JobFailed(f"{e}, while {rnd.name} was on its way", reasons.TRAINER_STOPPED) from None
            if sent[0].loss is not None:
                self.loss = sent[0].loss
            if applied:  # a round whose receivers were all away delivered nothing
                self.metrics.publish_to_serving.observe(time.monotonic() - published)
                self.delivered(version)
                self.last = (version, sent[0].step)
            if version >= 2:
                host.forget(version - 2)
            version += 1
        if not version:
            raise JobFailed("every trainer rank closed without publishing a version", reasons.NO_VERSIONS)
        # ranks that came back after the final version; not those whose load of it failed (onLoadFailure
        # rollBack), which wait for a next version, and end the job on the one they hold
        final, again, failed = version - 1, 0, set(self.load_failed)
        while [r for r in host.behind(final) if r not in failed]:
            host.wait_back(final, failed)
            if not [r for r in host.behind(final) if r not in failed]:  # the last of them was dropped meanwhile
                break
            again += 1
            rnd = host.start_round(final, again, bases=partial(bases, delta, final, again))
            if self.round(rnd)[1]:
                self.delivered(final)
            failed |= set(self.load_failed)
        if failed:
            self.say(f"{', '.join(who(INFERENCE, r) for r in sorted(failed))} failed to load the final version "
                     f"{final} and end the job on the version they hold")
        pause_point(CONTROLLER, 0, "delivered", final)

    def round(self, rnd: Round) -> tuple[list[SentReport], int]:
        """One round: wait for the trainers' reports, publish the reference digest, wait for every
        receiver still there to apply it, check the digests; report it. Returns the trainers' reports
        and how many inference ranks applied the version."""
        ctx, host, reporter, timeout = self.ctx, self.host, self.reporter, self.timeout
        plan, transport = self.planned.plan, self.planned.transport
        start, began = time.monotonic(), time.time()
        # A trainer may spend its timeout dialling a receiver and its timeout again on a send that
        # makes no progress before it reports the receiver lost: wait for that report, not past it.
        try:
            sent = host.collect_sent(rnd, 2 * timeout + REPORT_SLACK)
        except TrainersRestart as e:  # a trainer stopped before every byte of the round was sent
            raise RoundDropped(rnd, e) from None
        sent_at = time.monotonic()
        pause_point(CONTROLLER, 0, "verifying", rnd.version)
        reference = Reference.made(reference_digests(plan, sent, rnd.receivers))
        carried = any(s.checksums or s.receiver_checksums for s in sent)  # nothing: the round reached no one
        host.publish_reference(rnd, reference, carried)
        verified_at = time.monotonic()
        loads = load_on_servers(ctx, host, rnd, timeout, self.say, self.driven) if ctx.job.inference.runs_vllm else None
        loaded_at = time.monotonic()
        applied = host.collect_applied(rnd, timeout)
        seconds = time.monotonic() - start
        for r, got in sorted(applied.items()):
            want = reference.of(r) or ""
            if got.digest != want:
                host.verification_failed()
                raise JobFailed(f"{who(INFERENCE, r)} applied version {rnd.version} with digest {got.digest[:16]}, "
                                f"but the trainers sent {want[:16]}", reasons.VERIFICATION_FAILED)
            if got.refused:
                self.say(f"{who(INFERENCE, r)} could not apply {got.refused} patch(es) of {rnd.name} "
                         f"({got.why_refused}); the trainers sent those buckets whole")
        self.load_failed = {r: got for r, got in applied.items() if got.load_failed is not None}
        for r, got in self.load_failed.items():  # onLoadFailure rollBack: behind, and sent the next version whole
            self.say(f"{who(INFERENCE, r)} failed to load {rnd.name}: {got.load_failed}")
            host.fell_back(r, got.holds)
        applied = {r: got for r, got in applied.items() if r not in self.load_failed}
        host.holding(rnd.version, applied)
        self.metrics.states(counts(states(host.seats_now(), rnd.version)))
        if rnd.again or host.rejoins():
            reporter.rejoins({INFERENCE: host.rejoins(), TRAINER: host.resumes})
        loss, step = sent[0].loss, sent[0].step
        changed, compared = sum(s.changed for s in sent), sum(s.compared for s in sent)
        extra = {"changed": round(changed / compared, 6)} if compared else {}
        if loads is not None:
            extra["stall_seconds"] = round(loads.slowest.stall, 4)
        if self.load_failed:
            extra["load_failed"] = sorted(self.load_failed)
        extra["phases"] = phases(sent_at - start, verified_at - sent_at, loads, applied, start + seconds - loaded_at)
        extra["began"] = round(began, 4)  # the go, as the epoch's seconds: the phases laid against other clocks' events
        record = reporter.transfer(rnd.version, step, sum(plan.bytes_for(r) for r in applied), seconds, transport,
                                   loss, wire_bytes=sum(s.wire_bytes for s in sent), delta_ranks=len(rnd.bases),
                                   version_bytes=plan.version_bytes, inference_ranks=len(applied), again=rnd.again,
                                   **extra)
        host.say_done(rnd, record)
        return sent, len(applied)

    def delivered(self, version: int) -> None:
        """`version` was verified on an inference rank: a version delivered, the first time."""
        if version not in self.reached:
            self.reached.add(version)
            self.metrics.delivered(version)
            if self.admissions is not None:
                self.admissions.delivered(version)

    def resume(self, version: int, why: TrainersRestart) -> None:
        """A trainer rank stopped between two versions: every trainer rank starts again, resumes from
        its checkpoint and attaches with the model, transport and shards it had (Planned.check_resumed);
        version `version` comes next."""
        host = self.host
        serving = f"version {self.last[0]}" if self.last is not None else "no version yet"
        self.say(f"{why}: the trainers resume from their checkpoint (resume {host.resumes + 1}); the inference ranks "
                 f"serve {serving} meanwhile")
        resume(host, self.ctx.job.trainer.attach_timeout_seconds, version, *(self.last or (None, None)),
               self.planned.check_resumed)
        self.reporter.rejoins({INFERENCE: host.rejoins(), TRAINER: host.resumes})
        self.say(f"every trainer rank resumed; version {version} comes next, whole to every inference rank")

    def succeed(self) -> int:
        host = self.host
        self.watch.stop()  # every inference rank's last state, before the ranks leave
        delivered = len(self.reached)
        message = f"{delivered} versions delivered to and verified on {host.running} inference ranks"
        if host.rejoins():
            message += f" ({host.rejoins()} rejoins)"
        host.end(SUCCEEDED, message)
        # the goodbyes before the completion: once it is reported, the operator removes the job's pods,
        # this one and its store with them, and a rank still waiting on the store would fail
        missing = host.wait_byes(BYE_TIMEOUT)
        if missing:
            self.say(f"no goodbye within {BYE_TIMEOUT:.0f}s from {', '.join(missing)}")
        self.reporter.completion(SUCCEEDED, message, delivered, failed_verifications=0, final_loss=rounded(self.loss))
        linger(self.ctx, ME)
        return 0

    def fail(self, error: Exception) -> int:
        host = self.host
        reason, message = failure_of(error)
        if reason == reasons.CONTROLLER_ERROR:  # no failure of the job's: a bug, its traceback in the log
            traceback.print_exception(error)
        self.say(f"the job failed: {message}")
        self.watch.stop()
        try:
            host.end(FAILED, message, reason)
        except StoreError as e:  # a full store takes no more keys: the completion below still says why
            self.say(f"could not tell the ranks that the job ended: {e}")
        host.wait_byes(5.0)  # as for success: the ranks see the end before the pods go
        self.reporter.completion(FAILED, message, len(self.reached), reason=reason,
                                 failed_verifications=host.verification_failures(),
                                 final_loss=rounded(self.loss))
        linger(self.ctx, ME)
        return 1


def rounded(loss: float | None) -> float | None:
    return None if loss is None else round(loss, 6)
