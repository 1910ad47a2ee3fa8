"""Tensor parallelism for the built-in inference engine: transformers' own TP plan over the
processes of one model replica.

A replica of TP degree tp is tp consecutive inference ranks (job.Layout.tp_group). They form
a torch.distributed group (gloo on CPU, nccl on GPUs) through the job's rendezvous, and
transformers shards the model over it with the model's own plan (model._tp_plan expanded as
transformers expands it, apply_tensor_parallelism on a DeviceMesh): the parameters become
DTensors whose local shards are exactly the boxes plan.tp_needs gives the rank (checked
against apply_tensor_parallelism in the tests), which is what the rank declares when it joins. A
received version lands in the rank's local layout (plan.sliced_plan.LocalLayout) and is copied into the
local shards between two generations, at the same generation on every rank of the replica: the
ranks agree on it with one all-reduce per generation, so no forward pass mixes two versions.

Tied weights: transformers' apply_tensor_parallelism looks every name of the expanded plan up
among the model's deduplicated parameters, so the tied alias (lm_head.weight, tied to the input
embedding) fails it. The alias is left out of the plan and tied again afterwards to the sharded
embedding, whose vocabulary rows are what the head's colwise plan shards as well.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from weightsync.job import INFERENCE, SpecError
from weightsync.model.build import build, layout_of
from weightsync.model.config import expert_count
from weightsync.model.flat import FlatLayout, torch_dtype
from weightsync.model.quant import BlockCut, format_of
from weightsync.plan.boxes import RankSlices
from weightsync.plan.sliced_plan import LocalLayout, global_tensors
from weightsync.plan.tp_needs import check_heads, tp_needs


def tp_plan_of(model) -> dict:
    plan = getattr(model, "_tp_plan", None)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan in transformers (its config's "
                         "base_model_tp_plan): run it with spec.inference.tensorParallel 1")
    return dict(plan)


def needs_of(model, layout: FlatLayout, group: range, rank: int, expert_parallel: bool = False,
             quantization: str | None = None) -> RankSlices:
    """What inference rank `rank` needs of a version as a rank of the replica `group` (its
    inference ranks, job.Layout.tp_group); with `expert_parallel`, its experts as vLLM places them
    (a vLLM server's, spec.inference.vllm.expertParallel: `weightsync plan`'s preview); of a
    version quantized as `quantization`, each weight's scales with it."""
    plan = tp_plan_of(model)
    check_heads(model.config, plan, len(group))
    ep = len(group) if expert_parallel and len(group) > 1 else 0
    needs = tp_needs(global_tensors(layout), plan, len(group), ep=ep, experts=expert_count(model.config),
                     fmt=format_of(quantization))
    mine = needs.of_rank(rank - group.start)
    return RankSlices(rank, mine.slices)


def check_block_slices(job) -> None:
    """Refuse, before anything starts, an fp8 job whose tensor-parallel workers would hold slices
    that cut a 128x128 block of some weight (quant.BlockCut, naming it), as the model's TP plan
    slices it: a vLLM server refuses to build such a model, naming no layer."""
    fmt = format_of(job.model.quantization)
    sizes = sorted({len(job.layout.tp_group(r)) for r in range(job.layout.world_size(INFERENCE))} - {1})
    if fmt is None or fmt.block is None or not sizes:
        return
    model = build(job.model, dtype="float32", device="meta", load_weights=False)
    layout = layout_of(model, job.model.dtype, job.model.quantization)
    plan = getattr(model, "_tp_plan", None)
    for tp in sizes if plan else ():
        try:
            tp_needs(global_tensors(layout), dict(plan), tp, fmt=fmt)
        except BlockCut as e:
            raise SpecError([str(e)]) from None
        except ValueError:
            return  # a slicing the TP plan cannot preview (vLLM's own, as its workers read it, may differ)


class TensorParallel:
    """One rank's membership of its replica's process group, over `store` (the job's rendezvous)."""

    def __init__(self, store, group: range, rank: int, device: torch.device, timeout: float, formed: int = 0):
        """`formed`: the times the replica went away before (Member.replica_epoch); each group the
        replica forms has its own keys, which a group formed before cannot have written."""
        self.group, self.rank, self.tp = group, rank, len(group)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore(f"tp/{group.start}/{formed}/", store),
                                rank=rank - group.start, world_size=self.tp, timeout=datetime.timedelta(seconds=timeout))
        self.device = device
        self.mesh = DeviceMesh(device.type, list(range(self.tp)))

    def shard(self, model) -> None:
        """Shard `model` (built whole, on this rank's device) as transformers does with its TP plan."""
        # here only: a second or more to import, which every other inference rank and `weightsync plan` skip
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        first: dict[int, str] = {}
        aliases = []
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                aliases.append((name, first[id(p)]))
            first.setdefault(id(p), name)
        known = dict(model.named_parameters()).keys() | dict(model.named_modules()).keys()
        plan = {n: s for n, s in model._expand_parallel_plan(tp_plan_of(model)).items() if n in known}
        apply_tensor_parallelism(model, self.mesh, plan)
        for alias, source in aliases:
            module, _, attr = alias.rpartition(".")
            setattr(model.get_submodule(module), attr, model.get_parameter(source))

    def agree(self, staged: int | None, ended: bool) -> tuple[int | None, bool]:
        """(the version every rank of the replica has staged, or None; whether every rank saw the
        end). A collective: every rank calls it once per generation."""
        x = torch.tensor([-1 if staged is None else staged, int(ended), -(-1 if staged is None else staged)],
                         dtype=torch.int64, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
        low, high = int(x[0]), -int(x[2])
        return (low if low == high and low >= 0 else None), bool(x[1])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def local_shards(model) -> dict[str, torch.Tensor]:
    """Every parameter's local shard (a DTensor's, or the whole tensor where the plan keeps it whole)."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p) for n, p in model.named_parameters()}


def load(model, layout: FlatLayout, local: LocalLayout, staging: torch.Tensor) -> None:
    """Copy a version from `staging` (this rank's local layout) into the model's local shards. A
    tensor the plan gives this rank as two boxes (packed gate and up) is their concatenation."""
    dtype = torch_dtype(layout.dtype)
    shards = local_shards(model)
    with torch.no_grad():
        for i, slot in enumerate(layout.slots):
            parts = local.slots_of(i)
            views = [staging[s.offset:s.offset + s.nbytes].view(dtype).view(s.shape) for s in parts]
            if len(views) == 1:
                value = views[0]
            else:
                dim = next(d for d in range(len(slot.shape)) if parts[0].box.start[d] != parts[1].box.start[d])
                value = torch.cat(views, dim)
            shard = shards[slot.name]
            if tuple(shard.shape) != tuple(value.shape):
                raise ValueError(f"{slot.name}: transformers holds a {list(shard.shape)} shard on this rank, the plan "
                                 f"sends it {list(value.shape)}")
            shard.copy_(value)
