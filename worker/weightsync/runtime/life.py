"""One rank's life, the same for every kind of rank: its start counted (arrive), its heartbeat, its
join (its end of the job's transport, what it tells the controller), the plan, its heap settled
once start-up made what it keeps; then its own work; at the end a goodbye and, in a cluster, a
linger until its pod is removed. A failure on the way is reported to the controller as a typed
record (RankFailure: the reason the job's status gives, and the message), and the rank waits, a
bounded time, for the controller to end the job, so that the rank that failed first is the one
the job names.

Every role lives it through these objects (the built-in trainer through the trainer API, the
built-in and tensor-parallel inference ranks, a vLLM server's worker, a user's training script
through weightsync.attach, a framework's rollout ranks), and keeps only its own work: one copy of
the life, so that what a rank says and when (a failure's record, a goodbye said once, the waits'
deadlines) is the same whoever runs it. A pod that speaks for its ranks without being one (a
trainer command's pod, a vLLM server's pod) has the end of the same life (Farewell)."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from weightsync.job import INFERENCE, TRAINER, SpecError, WorkerContext, states
from weightsync.rendezvous.channel import Channel, connect_store
from weightsync.rendezvous.messages import End, RankFailure, RankInfo
from weightsync.rendezvous.protocol import JobEnded, Keys, Member, Restarted, Resuming, who
from weightsync.runtime.faults import pause_point
from weightsync.runtime.inbound import StartAgain
from weightsync.runtime.rank import FAILED_WAIT, JOIN_TIMEOUT, LINGER, REPORT_CONNECT, Expected, linger, log
from weightsync.transfer.receive import settle_heap
from weightsync.transport import RankContext, make_transport, options_for, resolve_transport
from weightsync.transport.base import Receiver, Sender


@dataclass(frozen=True)
class Joined:
    """A rank that joined the job: its end of the transport and what it told the controller."""

    transport: str  # the transport's name
    why: str  # why that one (resolve_transport's words)
    end: Sender | Receiver  # a trainer's Sender, an inference rank's Receiver
    endpoint: str  # where the trainers reach an inference rank (it listens there); a trainer's pod address
    attempt: int  # the start it joined with (above 1: its process started again)


@dataclass(frozen=True)
class Started:
    """A rank's start-up done (RankLife.start): how it joined, and the plan it waits for."""

    joined: Joined
    plan: Any  # plan.interface.TransferPlan: whole versions, or over slices
    endpoints: dict[int, str]  # {inference rank: endpoint} as the plan was made


class Farewell:
    """The end of a life, for the ranks `ranks` of `role` (`me` in the log): a failure reported as
    a typed record, the wait for the controller's end, the goodbye, the linger. Over `channel`, a
    client of the job's store (connected when first needed where none is given)."""

    def __init__(self, ctx: WorkerContext, role: str, ranks: Sequence[int], me: str, channel: Channel | None = None):
        self.ctx, self.role, self.ranks, self.me = ctx, role, tuple(ranks), me
        self.channel = channel

    def report(self, failure: RankFailure | BaseException | str, rank: int | None = None) -> RankFailure | None:
        """Tell the controller that `rank` (the first of the ranks by default) failed and why: the
        typed record reported (RankFailure.made: an error classified by its kind, or the rank's own
        words), or None where the job has ended, the rank said why already (its own words are the
        better ones), or the controller cannot be reached (logged: the job's deadlines and
        heartbeats find the rank then)."""
        rank = self.ranks[0] if rank is None else rank
        record = RankFailure.made(failure)
        try:
            if self.channel is None:
                self.channel = Channel(connect_store(self.ctx.controller_host, self.ctx.store_port, self.ctx.token,
                                                     self.ctx.job.identity, REPORT_CONNECT))
            if self.channel.has(Keys.END) or self.channel.has(Keys.failed(self.role, rank)):
                return None
            self.channel.rank_failed(self.role, rank, record)
            return record
        except Exception as e:  # noqa: BLE001 - the store is gone or refuses: nothing more to tell
            log(who(self.role, rank), f"could not report its failure to the controller: {e}")
            return None

    def wait_for_end(self, check: Callable[[], None] | None = None, timeout: float = FAILED_WAIT) -> End | None:
        """After a failure: wait (at most `timeout`) for the controller to end the job; its end
        record, or None. `check` runs meanwhile, and what it raises ends the wait (Resuming)."""
        try:
            return self.channel.wait_for_end(timeout, check, "the controller to end the job")
        except Resuming:
            raise
        except TimeoutError:
            log(self.me, f"the controller did not end the job within {timeout:.0f}s")
        except Exception as e:  # noqa: BLE001 - the controller's store is gone
            log(self.me, f"lost the controller while waiting for the end of the job: {e}")
        return None

    def bye(self) -> None:
        """Tell the controller that every one of the ranks saw the job's end (a pod's process
        speaks for them: it, not their workers, is the pod's last word)."""
        for r in self.ranks:
            self.channel.say_bye(self.role, r)

    def linger(self, deadline: float = LINGER) -> None:
        """After the job's end: in a cluster, wait (`deadline` seconds at most) for the operator to
        remove the pod (rank.linger)."""
        linger(self.ctx, self.me, deadline)


class RankLife(Farewell):
    """One rank's life, over its side of the rendezvous (`member`). A trainer whose trainers
    `resume` from their own checkpoint (a user's script, spec.trainer.resumes) joins its start
    anew, and its waits end (Resuming) once the trainers begin to resume again."""

    def __init__(self, ctx: WorkerContext, role: str, rank: int, *, resumes: bool = False):
        self.member = Member(ctx.controller_host, ctx.store_port, ctx.token, role, rank, JOIN_TIMEOUT,
                             job=ctx.job.identity)
        super().__init__(ctx, role, (rank,), who(role, rank), self.member)
        self.rank, self.resumes = rank, resumes
        self.end: Sender | Receiver | None = None  # its end of the transport, once joined
        self.failed: BaseException | None = None  # the failure it reported (fail)
        self.beating = self.said_bye = False

    def arrive(self) -> int:
        """Count this process's start, once (at once, before anything slow: the controller learns
        of a restart from it); the attempt. Restarted: a trainer's process that started again and
        does not resume."""
        return self.member.attempt or self.member.arrive(resumes=self.resumes)

    def heartbeat(self) -> None:
        """Beat to the controller from a thread of its own until stop(), once."""
        if not self.beating:
            self.beating = True
            self.member.start_heartbeat()

    def start(self, device, layout: str, *, port: int = 0, **more) -> Started:
        """A rank's start-up, in one: its start counted, its heartbeat, a pause point of the fault
        tests ("joining": its start counted, its heartbeat going, not joined yet), its join (join),
        the plan, once every rank joined."""
        self.arrive()
        self.heartbeat()
        joined = self.join(device, layout, port=port, before=lambda: pause_point(self.role, self.rank, "joining", 0),
                           **more)
        plan, endpoints = self.plan()
        return Started(joined, plan, endpoints)

    def join(self, device, layout: str, *, port: int = 0, before: Callable[[], None] = lambda: None,
             **more) -> Joined:
        """Join the job: its end of the job's transport (an inference rank's receiver listening on
        the pod's address and `port`), then its layout (`layout`, as JSON) and what it tells the
        controller about itself (`more`: RankInfo's other fields), proving the job token. `before`
        runs just before the join (a pause point of the fault tests). A rank that cannot join leaves
        no end of the transport open."""
        ctx, role = self.ctx, self.role
        name, why = resolve_transport(ctx.job.transfer.transport, ctx.network_mode, ctx.colocated)
        layout_of = ctx.job.layout
        context = RankContext(layout_of.world_size(TRAINER), layout_of.world_size(INFERENCE), device,
                              self.member.c10d_store)
        transport = make_transport(name, token=ctx.token, timeout=ctx.job.transfer.timeout,
                                   options=options_for(name, context))
        end = transport.receiver(self.rank) if role == INFERENCE else transport.sender(self.rank)
        try:
            endpoint = end.listen(ctx.pod_ip, port) if role == INFERENCE else ctx.pod_ip
            before()
            attempt = self.member.join(endpoint, layout, RankInfo(name, why, str(device), ctx.pod_name, **more),
                                       JOIN_TIMEOUT)
        except BaseException:
            end.close()
            raise
        self.end = end
        if self.resumes:
            self.member.watch_resumes()
        return Joined(name, why, end, endpoint, attempt)

    def plan(self):
        """(the controller's plan, {inference rank: endpoint}), once every rank joined."""
        return self.member.plan(JOIN_TIMEOUT)

    @staticmethod
    def settle() -> None:
        """Start-up made what the rank keeps: out of the garbage collector's reach (settle_heap)."""
        settle_heap()

    def fail(self, error: BaseException, *, trace: bool = True, wait: bool = True, said: str | None = None,
             check: Callable[[], None] | None = None) -> RankFailure | None:
        """This rank cannot go on: say so (with the traceback of an unexpected error), report the
        typed record (report: of `error`, or of the rank's own words `said`), and, with `wait`,
        wait a bounded time for the controller to end the job, heartbeats going (`check` as for
        wait_for_end). The record reported, or None."""
        if trace and not isinstance(error, (Expected, SpecError, KeyboardInterrupt)):
            traceback.print_exception(error)
        log(self.me, f"failed: {error}")
        self.failed = error
        record = self.report(error if said is None else said)
        if wait:
            self.wait_for_end(check)
        return record

    def stop(self) -> None:
        """Stop the heartbeat and close the transport (a process of an earlier start, as the
        trainers resume, stops so and says no goodbye: its rank's next start does)."""
        self.member.stop_heartbeat()
        self.beating = False
        self.close()

    def close(self) -> None:
        """Close its end of the transport, once."""
        end, self.end = self.end, None
        if end is not None:
            end.close()

    def bye(self) -> bool:
        """Stop, and tell the controller this rank saw the job's end, once; False where the
        controller had already gone (it waits a bounded time for every goodbye)."""
        self.stop()
        if self.said_bye:
            return True
        self.said_bye = True
        return self.member.bye()

    def run(self, body: Callable[[], str]) -> int:
        """A rank process's whole life: its start counted, then `body` (the role's own work, which
        joins and returns the job's end state); the exit code. A failure is reported (unless the
        body reported it already) and the job fails naming this rank."""
        try:
            self.arrive()
            state = body()
        except Restarted as e:
            if self.member.has(Keys.END):  # a pod restarted after its job ended: nothing to do
                log(self.me, "restarted after the job ended")
                self.linger()
                return 0
            log(self.me, f"{e}; waiting for the controller to end the job")
            self.wait_for_end()
            return self._leave(1)
        except StartAgain as e:
            log(self.me, str(e))
            return 1
        except JobEnded as e:
            log(self.me, str(e))
            return self._leave(1)
        except Exception as e:  # noqa: BLE001 - reported to the controller, which fails the job
            if e is not self.failed:
                # the controller ends the job; until then this process stays, so that the ones
                # that died first are the ones that stand out
                self.fail(e)
            return self._leave(1)
        if state != states.SUCCEEDED:
            log(self.me, "the job failed elsewhere")
        return self._leave(states.exit_code(state))

    def _leave(self, code: int) -> int:
        self.bye()
        self.linger()
        return code
