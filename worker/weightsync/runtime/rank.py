"""What every rank process shares, whoever started it (a worker pod's rank process, or a user's
training script through weightsync.attach), and its pod's other processes too: logging, its end of
the job's transport, what it tells the controller about itself, how a failure reaches the
controller, the end of the job in a cluster. The pieces of one rank's life, which life.py puts
together for every role; the tests' hooks are faults.py's."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from weightsync.job import INFERENCE, TRAINER, WorkerContext
from weightsync.job.logline import say
from weightsync.rendezvous.channel import Channel, connect_store
from weightsync.rendezvous.messages import End, RankFailure, RankInfo
from weightsync.rendezvous.protocol import Keys, Member, Resuming, who
from weightsync.runtime import health
from weightsync.transport import RankContext, make_transport, options_for, resolve_transport
from weightsync.transport.base import Receiver, Sender

JOIN_TIMEOUT = 1800.0  # seconds for the whole job to come up (pods may wait for nodes and images)
FAILED_WAIT = 30.0  # seconds a failed rank waits for the controller to end the job
REPORT_CONNECT = 60.0  # seconds to reach the controller's store to report a failure
# seconds a pod whose job ended waits at most for the operator to remove it (it scales a finished
# job's pods down at once; past this the process exits, and a pod started again after its job's
# end only lingers again)
LINGER = 3600.0


def without_triton() -> None:
    """For a rank process that computes on the CPU, before it imports torch's heavy parts: triton
    (GPU kernels only, installed with torch's CUDA wheels) is hidden, so torch sees it as not
    installed. Otherwise torch imports it as soon as anything loads torch._dynamo (AdamW's
    constructor does), for nothing, and at exit its native objects print dozens of "leaked" lines
    into the rank's log."""
    if "triton" not in sys.modules:
        sys.modules["triton"] = None  # `import triton` raises ImportError, as where it is not installed


def log(who: str, message: str) -> None:
    """A line of this rank's log (job/logline.py: its UTC time and `who`)."""
    say(who, message)


class Expected(RuntimeError):
    """A failure whose message says it all (no traceback)."""


def report_failure(ctx: WorkerContext, role: str, rank: int, failure: RankFailure | BaseException | str,
                   channel: Channel | None = None) -> RankFailure | None:
    """Tell the controller that `rank` failed and why, as a typed record (RankFailure.made: the
    error, classified by its kind, or the rank's own words), unless the job has ended or the rank
    said why already (its own words are the better ones); the record if this reported it. A
    controller that cannot be reached is logged: the job's deadlines and heartbeats find the rank
    then."""
    record = RankFailure.made(failure)
    try:
        channel = channel or Channel(connect_store(ctx.controller_host, ctx.store_port, ctx.token, ctx.job.identity,
                                                   REPORT_CONNECT))
        if channel.has(Keys.END) or channel.has(Keys.failed(role, rank)):
            return None
        channel.rank_failed(role, rank, record)
        return record
    except Exception as e:  # noqa: BLE001 - the store is gone or refuses: nothing more to tell
        log(who(role, rank), f"could not report its failure to the controller: {e}")
        return None


def wait_for_the_end(channel: Channel, me: str, timeout: float = FAILED_WAIT, check=None) -> End | None:
    """After a failure: wait (at most `timeout`) for the controller to end the job; its end
    record, or None. `check` runs meanwhile, and what it raises ends the wait (Resuming)."""
    try:
        return channel.wait_for_end(timeout, check, "the controller to end the job")
    except Resuming:
        raise
    except TimeoutError:
        log(me, f"the controller did not end the job within {timeout:.0f}s")
    except Exception as e:  # noqa: BLE001 - the controller's store is gone
        log(me, f"lost the controller while waiting for the end of the job: {e}")
    return None


def in_cluster(ctx: WorkerContext) -> bool:
    """In a pod, an exiting process is restarted, so a rank whose job has ended stays up."""
    return ctx.report_to_kubernetes or bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def linger(ctx: WorkerContext, who: str, deadline: float = LINGER) -> None:
    """After the job's end: in a cluster, wait (`deadline` seconds at most) for the operator to
    scale the pod down; a pod that a Prometheus scrapes then waits (health.FINAL_SCRAPE at most)
    until its final figures were read once."""
    if not in_cluster(ctx) or threading.current_thread() is not threading.main_thread():
        return  # (a controller on a thread of another program's process, integrations/ranks.py, leaves with it)
    ended = time.monotonic()
    log(who, "the job has ended; waiting for the operator to remove this pod")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Timed waits: Python runs a signal's handler on the main thread only once it wakes, and a
    # SIGTERM the kernel hands to another thread (health, store) would not wake an untimed wait.
    while not stop.wait(min(1.0, max(0.0, ended + deadline - time.monotonic()))):
        if time.monotonic() >= ended + deadline:
            log(who, f"the operator did not remove this pod within {deadline:g}s of the job's end; exiting")
            return
    health.final_scrape(ended, lambda line: log(who, line))


def transport_for(ctx: WorkerContext, member: Member, role: str, rank: int, device):
    """This rank's end of the job's transport: (name, why, Sender or Receiver)."""
    name, why = resolve_transport(ctx.job.transfer.transport, ctx.network_mode, ctx.colocated)
    layout = ctx.job.layout
    context = RankContext(layout.world_size(TRAINER), layout.world_size(INFERENCE), device,
                          member.c10d_store)
    transport = make_transport(name, token=ctx.token, timeout=ctx.job.transfer.timeout,
                               options=options_for(name, context))
    end = transport.receiver(rank) if role == INFERENCE else transport.sender(rank)
    return name, why, end


@dataclass(frozen=True)
class Joined:
    """A rank that joined the job: its end of the transport and what it told the controller."""

    transport: str  # the transport's name
    why: str  # why that one (resolve_transport's words)
    end: Sender | Receiver  # a trainer's Sender, an inference rank's Receiver
    endpoint: str  # where the trainers reach an inference rank (it listens there); a trainer's pod address
    attempt: int  # the start it joined with (above 1: its process started again)


def join_job(ctx: WorkerContext, member: Member, role: str, rank: int, device, layout: str, *, port: int = 0,
             before: Callable[[], None] = lambda: None, **more) -> Joined:
    """A rank's start-up, the one every kind of rank runs (a built-in trainer or inference rank, a
    rank of a tensor-parallel replica, a vLLM server's worker, a user's training script): its end of
    the job's transport (an inference rank's receiver listening on the pod's address and `port`),
    then its join with its layout (`layout`, as JSON) and what it tells the controller about itself
    (`more`: RankInfo's other fields), proving the job token. `before` runs just before the join (a
    pause point of the fault tests). A rank that cannot join leaves no end of the transport open.
    The plan comes next, when the rank is ready to wait for it (Member.plan)."""
    name, why, end = transport_for(ctx, member, role, rank, device)
    try:
        endpoint = end.listen(ctx.pod_ip, port) if role == INFERENCE else ctx.pod_ip
        before()
        attempt = member.join(endpoint, layout, info(ctx, name, why, device, **more), JOIN_TIMEOUT)
    except BaseException:
        end.close()
        raise
    return Joined(name, why, end, endpoint, attempt)


def info(ctx: WorkerContext, transport: str, why: str, device, **more) -> RankInfo:
    """What a rank tells the controller about itself besides endpoint and layout (`more`: the
    other fields of RankInfo)."""
    return RankInfo(transport, why, str(device), ctx.pod_name, **more)

