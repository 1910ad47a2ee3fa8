"""The worker every pod runs: its ordinal picks the role, and a trainer or inference pod runs one
process per rank (procsPerPod, one per GPU), or, for trainers with spec.trainer.command, the user's
command (command.py), which starts its own. The pod's first process answers the kubelet's probes
for all of them (runtime/health.py), from before anything heavy is imported."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.connection import wait
from typing import Mapping

from weightsync.job import CONTROLLER, INFERENCE, TRAINER, SpecError, WorkerContext, logline
from weightsync.job.logline import say
from weightsync.rendezvous.protocol import who
from weightsync.roles import command, controller, vllm_server
from weightsync.runtime.health import PodHealth, RankHealth, final_scrape
from weightsync.runtime.metrics import ControllerMetrics, RankBoard
from weightsync.runtime.procs import STOP_GRACE, die_with_parent, exit_status, stop
from weightsync.runtime.rank import without_triton


def main(environ: Mapping[str, str] = os.environ) -> int:
    """`weightsync worker`: raises job.SpecError on a bad environment or spec."""
    try:
        ctx = WorkerContext.from_environ(environ)
    except (OSError, ValueError) as e:
        if isinstance(e, SpecError):
            raise
        raise SpecError([f"the pod's environment or files: {e}"]) from None
    ranks = [] if ctx.role == CONTROLLER else list(ctx.ranks)
    # a vLLM pod is one process, its server, whose tensor-parallel workers are the pod's ranks
    server = ctx.role == INFERENCE and ctx.job.inference.runs_vllm
    names = [who(ctx.role, r) for r in ranks] or [CONTROLLER]
    health = PodHealth([names[0] + (f"..{ranks[-1]}" if len(ranks) > 1 else "")] if server else names)
    # the pod's metrics, served with its probes: the controller's own, or its ranks' board, which
    # every rank process started from here on finds (runtime/metrics.py)
    metrics = ControllerMetrics() if ctx.role == CONTROLLER else RankBoard(ctx.role, ranks)
    if ctx.health_port:  # 0: no probes (pods on the node's network; render.on_host_network)
        try:
            health.serve(ctx.pod_ip, ctx.health_port, metrics.registry)
        except OSError as e:  # a taken port: one line, and the pod fails (it restarts, saying so again)
            say("weightsync worker", e.strerror)
            return 1
    exit_on_sigterm()
    if ctx.role == CONTROLLER:
        health.rank(0).start()
        return controller.run(ctx, metrics)
    if ctx.role == TRAINER and ctx.job.trainer.command:
        return command.run(ctx, health)
    if server:
        health.rank(0).start()
        return vllm_server.run(ctx, ranks)
    if len(ranks) == 1:
        health.rank(0).start()
        return run_rank(ctx.role, ranks[0], 0)
    return supervise(ctx.role, ranks, health)


def exit_on_sigterm() -> None:
    """Ends this process on SIGTERM. A container's first process has no default action for it
    (the kernel drops signals that PID 1 does not handle), so without this a deleted pod would wait
    out its whole grace period and be killed. Nothing is lost: a version is applied whole or not at
    all. supervise() replaces this with its own handler, which stops the ranks first."""

    def exit_now(signum, _frame):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, exit_now)


def run_rank(role: str, rank: int, local_rank: int, ctx: WorkerContext | None = None) -> int:
    ctx = ctx or WorkerContext.from_environ()
    # The built-in trainer and inference ranks import torch (seconds) here, not with this module:
    # a pod's first process answers its ranks' probes from before anything heavy is imported, and
    # the controller's, a trainer command's and a vLLM server's pods never import torch.
    if not ctx.job.pods(role).gpus_per_proc:
        without_triton()
    logline.configure()  # a spawned rank process starts without the pod process's logging
    if role == TRAINER:
        from weightsync.roles import trainer as program
    elif ctx.job.inference.runs_vllm:  # the rank is a worker of the pod's vLLM server
        return vllm_server.run(ctx, list(ctx.ranks))
    else:
        from weightsync.roles import inference as program
    # transformers writes its warnings through a handler of its own, in a format of its own: they go
    # to the lines of the rank's log (job/logline.py) instead
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    return program.run(ctx, rank, local_rank)


def _child(role: str, rank: int, local_rank: int, parent: int, health: RankHealth) -> None:
    health.start()
    die_with_parent(parent)
    sys.exit(run_rank(role, rank, local_rank))


def supervise(role: str, ranks: list[int], health: PodHealth) -> int:
    """One process per rank; when one fails the pod fails (so it restarts, and the controller
    hears of it from the rank); SIGTERM is passed on to every rank. Each rank's process stamps
    its slot of the pod's health."""
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=_child, args=(role, rank, i, os.getpid(), health.rank(i)), name=f"{role}-rank-{rank}")
             for i, rank in enumerate(ranks)]
    for p in procs:
        p.start()

    def end(signum, _frame):  # the pod is being deleted: its ranks end (cleanly, once the job is over)
        stopping = time.monotonic()
        stop(*procs, grace=STOP_GRACE)
        clean = all(p.exitcode == 0 for p in procs)
        if clean:  # the ranks' final figures are on the pod's board: a scrape reads them once
            final_scrape(stopping, lambda line: say("weightsync worker", line))
        sys.exit(0 if clean else 128 + signum)

    signal.signal(signal.SIGTERM, end)
    running = list(procs)
    while running:
        # timed, so that a SIGTERM taken by another thread still reaches its handler here
        for sentinel in wait([p.sentinel for p in running], timeout=1.0):
            p = next(p for p in running if p.sentinel == sentinel)
            p.join()
            running.remove(p)
            if p.exitcode == 0:
                health.finished(procs.index(p))
            else:
                say("weightsync worker", f"{p.name} {exit_status(p.exitcode)}; stopping the pod's other ranks")
                stop(*running, grace=STOP_GRACE)
                return 1
    return 0
