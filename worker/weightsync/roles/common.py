"""What the trainer and inference roles share: device, transport, logging, the end of a rank."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

from ..contract import INFERENCE, TRAINER, WorkerContext
from ..rendezvous import JobEnded, Keys, Member, Restarted, who

JOIN_TIMEOUT = 1800.0  # seconds for the whole job to come up (pods may wait for nodes and images)
FAILED_WAIT = 30.0  # seconds a failed rank waits for the controller to end the job

# Tests only: a directory where trainer and inference ranks save, after every version, the
# version's tensors and the logits on model.PROMPT, so that tests compare real weights and logits.
DUMP_DIR_ENV = "WEIGHTSYNC_TEST_DUMP_DIR"
# Tests only: a directory of armed pause points. A rank that reaches point P of version V, when
# the file <role>-<rank>-<P>-v<V>.arm is there, removes it, creates ....reached and waits (at most
# PAUSE_LIMIT seconds) for ....release: meanwhile the test kills or stops whatever process it
# wants, at a known point of a version. Points: trainer "before-go" (ready, before the go) and
# "mid-send" (its first bucket of the version handed to the transport, the others not yet: every
# inference rank is then in the middle of receiving); inference "verifying" (received, before the
# check against the reference); controller "verifying" (the trainers are done, the inference
# ranks' digests not yet checked).
PAUSE_DIR_ENV = "WEIGHTSYNC_TEST_PAUSE_DIR"
PAUSE_LIMIT = 120.0


def log(who: str, message: str) -> None:
    print(f"[{who}] {message}", file=sys.stderr, flush=True)


class Expected(RuntimeError):
    """A failure whose message says it all (no traceback)."""


class StartAgain(Expected):
    """This rank's process must end so that it starts again and rejoins the job (its pod restarts
    it); not a failure of the job."""


def run_rank(ctx: WorkerContext, role: str, rank: int, local_rank: int, body) -> int:
    """Run one rank: body(ctx, member, rank, local_rank).run() returns the job's end state.
    A failure is reported to the controller, which fails the job naming this rank."""
    me = who(role, rank)
    member = Member(ctx.controller_host, ctx.store_port, ctx.token, role, rank, JOIN_TIMEOUT, job=ctx.job.identity)
    try:
        member.arrive()
        state = body(ctx, member, rank, local_rank).run()
    except Restarted as e:
        if member.has(Keys.END):  # a pod restarted after its job ended: nothing to do
            log(me, "restarted after the job ended")
            linger(ctx, me)
            return 0
        log(me, f"{e}; waiting for the controller to end the job")
        return _wait_for_the_end(ctx, member, me)
    except StartAgain as e:
        log(me, str(e))
        return 1
    except JobEnded as e:
        log(me, str(e))
        member.bye()
        linger(ctx, me)
        return 1
    except Exception as e:  # noqa: BLE001 - reported to the controller, which fails the job
        if not isinstance(e, Expected):
            traceback.print_exc()
        log(me, f"failed: {e}")
        member.fail(f"{type(e).__name__}: {e}")
        # The controller ends the job; until then this process stays, so that the ones that
        # died first are the ones that stand out.
        return _wait_for_the_end(ctx, member, me)
    member.bye()
    if state != "Succeeded":
        log(me, "the job failed elsewhere")
    linger(ctx, me)
    return 0 if state == "Succeeded" else 1


def _wait_for_the_end(ctx: WorkerContext, member: Member, me: str) -> int:
    try:
        member.wait([Keys.END], "the controller to end the job", FAILED_WAIT)
    except TimeoutError:
        log(me, f"the controller did not end the job within {FAILED_WAIT:.0f}s")
    member.bye()
    linger(ctx, me)
    return 1


def in_cluster(ctx: WorkerContext) -> bool:
    """In a pod, an exiting process is restarted, so a rank whose job has ended stays up."""
    return ctx.report_to_kubernetes or bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def linger(ctx: WorkerContext, who: str) -> None:
    """After the job's end: in a cluster, wait for the operator to scale the pod down."""
    if not in_cluster(ctx):
        return
    log(who, "the job has ended; waiting for the operator to remove this pod")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Timed waits: Python runs a signal's handler on the main thread only once it wakes, and a
    # SIGTERM the kernel hands to another thread (health, store) would not wake an untimed wait.
    while not stop.wait(1.0):
        pass


def device_for(ctx: WorkerContext, role: str, local_rank: int):
    """cuda:<local rank> when the role asks for GPUs (gpusPerProc > 0), else the CPU."""
    import torch

    spec = ctx.job.spec[role]
    if spec["gpusPerProc"] == 0:
        return torch.device("cpu")
    need = spec["procsPerPod"] * spec["gpusPerProc"]
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        raise Expected(f"spec.{role} asks for {need} GPUs per pod (procsPerPod {spec['procsPerPod']} x gpusPerProc "
                       f"{spec['gpusPerProc']}) but this pod has {have}; set spec.{role}.gpusPerProc: 0 to run on CPU")
    index = local_rank * spec["gpusPerProc"]
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def transport_for(ctx: WorkerContext, member: Member, role: str, rank: int, device):
    """This rank's end of the job's transport: (name, why, Sender or Receiver)."""
    from ..transport import make_transport, resolve_transport

    spec = ctx.job.spec
    name, why = resolve_transport(spec["transfer"]["transport"], ctx.network_mode)
    options: dict = {}
    if name == "nccl":
        import torch.distributed as dist

        layout = ctx.job.layout
        options = {"store": dist.PrefixStore("transfer/", member.client().store), "trainers": layout.world_size(TRAINER),
                   "inferences": layout.world_size(INFERENCE), "device": device.index}
    elif name == "uccl":
        options = {"gpu": device.index}
    transport = make_transport(name, token=ctx.token, timeout=float(spec["transfer"]["timeoutSeconds"]), **options)
    end = transport.receiver(rank) if role == INFERENCE else transport.sender(rank)
    return name, why, end


def info(ctx: WorkerContext, transport: str, why: str, device) -> str:
    """What a rank tells the controller about itself besides endpoint and layout."""
    return json.dumps({"transport": transport, "why": why, "device": str(device),
                       "pod": ctx.job.pod_name(ctx.ordinal)}, sort_keys=True)


def pause_point(role: str, rank: int, point: str, version: int) -> None:
    """Tests only (PAUSE_DIR_ENV): hold here while the test acts, if it armed this point."""
    folder = os.environ.get(PAUSE_DIR_ENV)
    if not folder:
        return
    base = os.path.join(folder, f"{role}-{rank}-{point}-v{version}")
    try:
        os.remove(base + ".arm")
    except FileNotFoundError:
        return
    open(base + ".reached", "w").close()
    deadline = time.monotonic() + PAUSE_LIMIT
    while not os.path.exists(base + ".release") and time.monotonic() < deadline:
        time.sleep(0.01)


def dumping() -> bool:
    return bool(os.environ.get(DUMP_DIR_ENV))


def dump(role: str, rank: int, version: int, tensors: dict, logits) -> None:
    """Tests only (DUMP_DIR_ENV): save this rank's tensors of a version and its logits on the prompt."""
    import torch

    torch.save({"tensors": tensors, "logits": logits},
               os.path.join(os.environ[DUMP_DIR_ENV], f"{role}-{rank}-v{version}.pt"))
