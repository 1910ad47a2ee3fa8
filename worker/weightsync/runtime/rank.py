"""What every rank process shares, whoever started it (a worker pod's rank process, or a user's
training script through weightsync.attach), and its pod's other processes too (the controller's):
logging, the failure that says it all, the deadlines of a rank's start-up and end, and the end of
the job in a cluster (linger). One rank's life, its join and its failure reports, is life.py's;
the tests' hooks are faults.py's."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from weightsync.job import WorkerContext
from weightsync.job.logline import say
from weightsync.runtime import health

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
