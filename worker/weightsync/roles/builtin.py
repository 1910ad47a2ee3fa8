"""What the built-in engine's rank processes share (trainer.py, inference.py, sharded.py): a rank's
device, and an inference rank's model and generation pace. Their life, join to goodbye, is every
rank's (runtime/life.py)."""

from __future__ import annotations

import torch

from weightsync.job import WorkerContext
from weightsync.model.build import build, layout_of, parameters
from weightsync.model.flat import FlatLayout, torch_dtype
from weightsync.model.lora import Adapter, add_adapters
from weightsync.runtime.rank import Expected

GENERATE_EVERY = 1.0  # seconds between an inference rank's generations while no new version arrives
NEW_TOKENS = 8  # tokens an inference rank generates from the prompt each time


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


def serving_model(ctx: WorkerContext, device):
    """An inference rank's model on `device`: (model, its version layout, the parameters versions
    replace) of spec.model in the job's dtype, evaluating, without weights
    worth keeping (versions replace them). Where versions are a LoRA adapter (spec.model.lora) the
    base weights are loaded (spec.model.path) or built as the trainers build them (spec.model.config
    and spec.training.seed), and only the adapter's parameters are the version's."""
    job = ctx.job
    dtype = job.model.dtype
    lora = job.model.lora
    if lora is None:
        model = build(job.model, dtype=dtype, device=device, seed=job.training.seed, load_weights=False)
        model.eval()
        return model, layout_of(model, dtype, job.model.quantization), [p for _, p in parameters(model)]
    # the base as the trainers hold it: built in float32 from the seed (or loaded), then cast
    model = build(job.model, dtype="float32", device=device, seed=job.training.seed).to(torch_dtype(dtype))
    model.eval()
    adapter = Adapter.of(job.model)
    add_adapters(model, lora)
    params = adapter.tensors(model)
    return model, FlatLayout.from_named_tensors(params, dtype), [p for _, p in params]
