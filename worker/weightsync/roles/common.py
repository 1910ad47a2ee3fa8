"""What the roles' rank processes share: their device, an inference rank's model and generation
pace (inference.py and sharded.py), and running one rank to its end (runtime/rank.py has what any
rank process shares, the trainer API's included)."""

from __future__ import annotations

import traceback

import torch

from weightsync.job import INFERENCE, WorkerContext, states
from weightsync.model.build import build, layout_of, parameters
from weightsync.model.flat import FlatLayout, torch_dtype
from weightsync.model.lora import Adapter, add_adapters
from weightsync.rendezvous.protocol import JobEnded, Keys, Member, Restarted, who
from weightsync.runtime.inbound import StartAgain
from weightsync.runtime.rank import JOIN_TIMEOUT, Expected, linger, log, wait_for_the_end

GENERATE_EVERY = 1.0  # seconds between an inference rank's generations while no new version arrives
NEW_TOKENS = 8  # tokens an inference rank generates from the prompt each time


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
        member.fail(e)
        # The controller ends the job; until then this process stays, so that the ones that
        # died first are the ones that stand out.
        return _wait_for_the_end(ctx, member, me)
    member.bye()
    if state != states.SUCCEEDED:
        log(me, "the job failed elsewhere")
    linger(ctx, me)
    return states.exit_code(state)


def _wait_for_the_end(ctx: WorkerContext, member: Member, me: str) -> int:
    wait_for_the_end(member, me)
    member.bye()
    linger(ctx, me)
    return 1


def device_for(ctx: WorkerContext, role: str, local_rank: int):
    """cuda:<local rank> when the role asks for GPUs (gpusPerProc > 0), else the CPU."""
    pods = ctx.job.pods(role)
    if pods.gpus_per_proc == 0:
        return torch.device("cpu")
    need = pods.gpus
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        raise Expected(f"spec.{role} asks for {need} GPUs per pod (procsPerPod {pods.procs_per_pod} x gpusPerProc "
                       f"{pods.gpus_per_proc}) but this pod has {have}; set spec.{role}.gpusPerProc: 0 to run on CPU")
    index = local_rank * pods.gpus_per_proc
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def serving_model(ctx: WorkerContext, member: Member, local_rank: int):
    """An inference rank's start: its heartbeat, and (model, its version layout, device, the
    parameters versions replace) of spec.model in the job's dtype, evaluating, without weights
    worth keeping (versions replace them). Where versions are a LoRA adapter (spec.model.lora) the
    base weights are loaded (spec.model.path) or built as the trainers build them (spec.model.config
    and spec.training.seed), and only the adapter's parameters are the version's."""
    job = ctx.job
    dtype = job.model.dtype
    device = device_for(ctx, INFERENCE, local_rank)
    member.start_heartbeat()
    lora = job.model.lora
    if lora is None:
        model = build(job.model, dtype=dtype, device=device, seed=job.training.seed, load_weights=False)
        model.eval()
        return model, layout_of(model, dtype, job.model.quantization), device, [p for _, p in parameters(model)]
    # the base as the trainers hold it: built in float32 from the seed (or loaded), then cast
    model = build(job.model, dtype="float32", device=device, seed=job.training.seed).to(torch_dtype(dtype))
    model.eval()
    adapter = Adapter.of(job.model)
    add_adapters(model, lora)
    params = adapter.tensors(model)
    return model, FlatLayout.from_named_tensors(params, dtype), device, [p for _, p in params]
