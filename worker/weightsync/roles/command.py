"""A trainer pod with spec.trainer.command runs the user's command (their own training script, which
publishes through weightsync.attach) instead of the built-in trainer, and watches it as the pod's
supervisor:

- the command's environment is the pod's (weightsync's contract, spec.trainer.env) with torchrun's
  variables for this pod (job.torchrun_env), so that `torchrun train.py` needs no arguments;
- the pod is alive while the command runs, and ready once every rank of the pod attached;
- a rank of the pod that has not attached within spec.trainer.attachTimeoutSeconds of the
  command's start, or the command's exit before every rank of the pod closed, is reported to the
  controller for each such rank (a rank that reported its own failure keeps its own words), so
  the job fails naming the rank;
- a job that ended Failed stops a command still running; after the end a pod in a cluster stays
  until the operator removes it, as every worker pod does;
- a command that ended as the job's trainers resume from their checkpoint (rendezvous/resume.py:
  a trainer rank stopped, and every rank starts again) is no failure: the pod exits at once, so
  that it starts again and runs the command anew. Each resume gives the commands a port of their
  own for torch.distributed's rendezvous (MASTER_PORT + the resumes so far, modulo MASTER_PORTS):
  a pod that starts again before the others' processes of the earlier start are gone would
  otherwise meet their rendezvous, whose master is on its way out, and hang there; and a command
  started before the resume began that has not attached yet is stopped, so that its pod starts it
  again on the new port.

The command runs in the pod's process group: whatever it starts ends with the pod (a container's
processes do; `weightsync run` stops a local pod's whole group).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from functools import partial

from weightsync.job import MASTER_PORT, MASTER_PORTS, TRAINER, WorkerContext, master_addr, states, torchrun_env
from weightsync.rendezvous.channel import Channel, connect_store
from weightsync.rendezvous.messages import End
from weightsync.rendezvous.protocol import Keys, who
from weightsync.runtime.health import PodHealth
from weightsync.runtime.life import Farewell
from weightsync.runtime.procs import STOP_GRACE, die_with_parent, exit_status, stop
from weightsync.runtime.rank import JOIN_TIMEOUT, log

TICK = 1.0  # seconds between two looks at the command and the rendezvous
# seconds a command gets to exit on its own when its pod is deleted after the job succeeded (the
# operator removes a finished job's pods at once, while the script may still be tearing down);
# with procs.STOP_GRACE within the pod's default 30 s of grace
FINISH_GRACE = 15.0


def run(ctx: WorkerContext, health: PodHealth) -> int:
    argv = ctx.job.trainer.argv
    ranks = list(ctx.ranks)
    me = f"trainer pod {ctx.job.pod_name(ctx.ordinal)}"
    slots = [health.rank(i) for i in range(len(ranks))]
    for slot in slots:  # alive while this process runs; the command's ranks beat to the controller
        slot.start()
    channel = Channel(connect_store(ctx.controller_host, ctx.store_port, ctx.token, ctx.job.identity, JOIN_TIMEOUT))
    life = Farewell(ctx, TRAINER, ranks, me, channel)  # the end of its ranks' lives, which the command lives
    resumes = channel.resumes()  # the trainers' resumes begun before this command
    started = {r: channel.starts(TRAINER, r) for r in ranks}  # its ranks' starts before it
    port = int(os.environ.get("MASTER_PORT") or MASTER_PORT)
    env = {**torchrun_env(ctx.job, ctx.ordinal, os.environ.get("MASTER_ADDR") or master_addr(ctx.job), port), **os.environ}
    if ctx.job.trainer.resumes:  # the resume's own port
        env["MASTER_PORT"] = env["PET_MASTER_PORT"] = str(port + resumes % MASTER_PORTS)
    command = shlex.join(argv)
    log(me, f"runs the command {command} for {', '.join(who(TRAINER, r) for r in ranks)}")
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=partial(die_with_parent, os.getpid()))
    except OSError as e:
        for r in ranks:
            life.report(f"the trainer command {command} cannot be started: {e.strerror or e}", r)
        return _end(life, None)
    succeeded = threading.Event()  # set once the job is seen to have succeeded
    signal.signal(signal.SIGTERM, partial(_stop_on_sigterm, proc, succeeded))
    watch = Watch(ctx, channel, ranks, me, slots)
    deadline = time.monotonic() + ctx.job.trainer.attach_timeout_seconds
    code, end, gone = None, None, False
    while code is None:
        if end is not None and end.state == states.SUCCEEDED:
            succeeded.set()
        if end is not None or gone:  # only the command is left to wait for
            try:
                code = proc.wait(TICK)
            except subprocess.TimeoutExpired:
                pass
            continue
        try:
            # parked on the end (the store answers at once when it is set: once the job's ranks
            # said goodbye a local controller exits, and its store with it)
            end = _wait_end(channel, TICK)
            late = watch.not_attached() if end is None else []
            behind = end is None and _behind_a_resume(ctx, channel, resumes, started)
        except (OSError, ConnectionError, RuntimeError) as e:  # the job's end may take the store with it
            log(me, f"lost the controller's store ({e}); waiting for the command to exit")
            gone = True
            continue
        code = proc.poll()
        if code is None and behind:
            log(me, "the trainers resume from their checkpoint, and the command had not attached: it stops, and this "
                    "pod starts again to run it on the resume's port")
            stop(proc, grace=STOP_GRACE)
            proc.wait()
            return 1
        if end is not None and end.state != states.SUCCEEDED and code is None:
            log(me, "the job failed: stopping the command")
            stop(proc, grace=STOP_GRACE)  # torchrun passes the SIGTERM on to its workers
        elif late and time.monotonic() > deadline and code is None:
            for r in late:
                life.report(f"the trainer command has not called weightsync.attach() within "
                            f"{ctx.job.trainer.attach_timeout_seconds}s of its start "
                            f"(spec.trainer.attachTimeoutSeconds): {command}", r)
            stop(proc, grace=STOP_GRACE)
            return _end(life, proc.wait())
    resuming = False
    if end is None and not gone:
        try:
            end = channel.end()
            resuming = end is None and ctx.job.trainer.resumes and channel.resumes() > resumes
        except (OSError, ConnectionError, RuntimeError) as e:
            log(me, f"lost the controller's store ({e}) as the command exited")
            gone = True
    if resuming:
        log(me, f"the command {exit_status(code)} as the trainers resume from their checkpoint: this pod starts "
                "again, and runs it anew")
        return 1
    if end is None and not gone:
        how = exit_status(code)
        open_ranks = [r for r in ranks if not channel.has(Keys.closed(r))]
        for r in open_ranks:
            life.report(f"the trainer command {how} before this rank closed its weightsync.attach() "
                        f"(sync.close()): {command}", r)
        log(me, f"the command {how}" + (f" before {', '.join(who(TRAINER, r) for r in open_ranks)} closed" if open_ranks else ""))
    elif gone:  # close() returns only once the job succeeded: a command that exits 0 after it is done
        end = End(states.SUCCEEDED if code == 0 else states.FAILED)
    return _end(life, code, end)


def _behind_a_resume(ctx: WorkerContext, channel: Channel, resumes: int, started: dict[int, int]) -> bool:
    """Whether the trainers began to resume after the command started while one of its ranks has
    not arrived yet (it may wait in the rendezvous of the processes that are going)."""
    if not ctx.job.trainer.resumes or channel.resumes() <= resumes:
        return False
    return any(channel.starts(TRAINER, r) <= before for r, before in started.items())


def _wait_end(channel: Channel, timeout: float) -> End | None:
    try:
        return channel.wait_for_end(timeout)
    except TimeoutError:
        return None


class Watch:
    """Which ranks of the pod attached (joined the job, token proven); the pod is ready once all did."""

    def __init__(self, ctx: WorkerContext, channel: Channel, ranks: list[int], me: str, slots):
        self.channel, self.ranks, self.me, self.slots = channel, ranks, me, slots
        self.attached: set[int] = set()

    def not_attached(self) -> list[int]:
        for r in self.ranks:
            if r not in self.attached:
                attempt = self.channel.starts(TRAINER, r)
                if attempt and self.channel.has(Keys.published("proof", TRAINER, r, attempt)):
                    self.attached.add(r)
                    if len(self.attached) == len(self.ranks):
                        for slot in self.slots:
                            slot.ready()
        return [r for r in self.ranks if r not in self.attached]


def _end(life: Farewell, code: int | None, end: End | None = None) -> int:
    """The command is over: wait (bounded) for the job's end, then stay in a cluster."""
    if end is None:
        end = life.wait_for_end()
    state = end.state if end else states.FAILED
    life.linger()
    return states.exit_code(state) if code == 0 else 1


def _stop_on_sigterm(proc: subprocess.Popen, succeeded: threading.Event, signum, _frame) -> None:
    """The pod is being deleted: the command ends first, then this process. After the job
    succeeded the command is only finishing: it gets FINISH_GRACE to exit on its own first."""
    if succeeded.is_set():
        try:
            proc.wait(FINISH_GRACE)
        except subprocess.TimeoutExpired:
            pass
    stop(proc, grace=STOP_GRACE)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)
