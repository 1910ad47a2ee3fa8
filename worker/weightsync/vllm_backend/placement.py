"""A vLLM worker's placement in its job, decided once at init, before anything is allocated or
joined: which inference rank it is, what a version is to it, what it needs of one, and the checks
that refuse a server the job cannot use.

place.py says where the job and the rank come from (a pod's contract, the join variables, the
trainer's init) and builds a version's layout once. Here the server is checked against the job,
each refusal one line naming what to change: the LoRA settings of a job whose versions are an
adapter, a mixture of experts it can load (experts.py), the job's routed experts, tensor
parallelism alone and of the job's size, and what loadAhead cannot take. Then what this worker
receives of a version: the whole version where every inference rank of the job gets whole
versions, else its slices, as vLLM's tensor-parallel layers load them (shards.py, lora_shards.py;
everything, as one rank's slices, at tensor-parallel size 1).

The answer is one frozen record, Placement, which the staging side (staging.py: the buffer it
receives into) and the loading side (loading.py) read and never change; a second init (a server
that joined its trainer's job, which ended) makes a new one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from weightsync.job import INFERENCE, Env, Lora, WorkerContext
from weightsync.model.config import config_of, expert_count
from weightsync.model.flat import FlatLayout, torch_dtype, views
from weightsync.model.quant import format_of
from weightsync.plan.boxes import RankSlices
from weightsync.plan.sliced_plan import LocalLayout, needs_everything
from weightsync.rendezvous.protocol import who
from weightsync.runtime.rank import log
from weightsync.vllm_backend import lora_problem
from weightsync.vllm_backend.experts import check_experts, cpu_packed, int8_packed, split_experts
from weightsync.vllm_backend.lora_shards import adapter_parts
from weightsync.vllm_backend.parts import Part, UnsupportedLayer
from weightsync.vllm_backend.place import Place, place_of
from weightsync.vllm_backend.shards import worker_needs, worker_parts


@dataclass(frozen=True)
class Placement:
    """Where a vLLM worker stands in its job and what it takes of a version; made by placement_of."""

    place: Place  # its job's context, its inference rank, its server (place.py)
    me: str  # how its log lines name it
    group: range  # the inference ranks of its model replica: its server's workers
    needs: RankSlices | None  # what it declares at its join; None where every inference rank gets whole versions
    local: LocalLayout | None  # its staging buffer's slices of a version; None where it receives versions whole
    parts: tuple[Part, ...] | None  # its parts as vLLM's tensor-parallel layers load them; None where it holds whole tensors
    loads_as: dict  # (tensor, box) -> checkpoint names vLLM loads the part as (shards.Part)
    load_ahead: bool  # spec.inference.vllm.loadAhead, where a version is the model's (an adapter's replaces in place)
    # vLLM's update session is kept open from one version to the next (control.py), except on a
    # LoRA server whose base weights are the versions: vLLM invalidates its LoRA state as the session closes
    keep_session: bool

    @property
    def ctx(self) -> WorkerContext:
        return self.place.ctx

    @property
    def rank(self) -> int:
        return self.place.rank

    @property
    def layout(self) -> FlatLayout:
        return self.place.layout

    @property
    def lora(self) -> Lora | None:
        """The adapter the versions are (spec.model.lora), or None where they are the model's weights."""
        return self.ctx.job.model.lora

    @property
    def staging_bytes(self) -> int:
        return self.layout.total_bytes if self.local is None else self.local.total_bytes

    def tensors(self, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) of everything in `buffer`: the whole version, or this worker's parts."""
        if self.local is None:
            return zip(self.layout.names, views(buffer, self.layout))
        return self._parts(buffer)

    def _parts(self, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for slot in self.local.slots:
            part = buffer[slot.offset:slot.offset + slot.nbytes].view(torch_dtype(slot.dtype)).view(slot.shape)
            names = self.loads_as.get((slot.name, slot.box))
            if names:  # experts of one tensor of every expert, loaded as one expert's tensors each (shards.py)
                yield from zip(names, part.unbind(0))
            else:
                yield slot.name, part

    def check_plan(self, plan) -> None:
        """The controller planned what this worker declared; say what it receives of a version."""
        if self.local is None:
            if getattr(plan, "sliced", False):
                raise ValueError("the controller planned slices for a job whose inference ranks need whole versions")
            log(self.me, f"{plan.version_bytes} bytes per version from {len(plan.expected_for(self.rank))} trainer ranks")
            return
        if not getattr(plan, "sliced", False) or plan.bytes_for(self.rank) != self.local.total_bytes:
            raise ValueError(f"the controller's plan gives this worker {plan.bytes_for(self.rank)} bytes per version; "
                             f"the slices it declared take {self.local.total_bytes}")
        share = self.local.total_bytes / plan.version_bytes
        log(self.me, f"tensor-parallel rank {self.rank - self.group.start} of {len(self.group)} (inference ranks "
                     f"{self.group.start}..{self.group.stop - 1}): receives {self.local.total_bytes} of "
                     f"{plan.version_bytes} bytes per version ({share:.4f} of a whole version) from "
                     f"{len(plan.expected_for(self.rank))} trainer ranks")


def placement_of(vllm_config, model: torch.nn.Module, init=None) -> Placement:
    """This worker's placement (`init`: the trainer's init, engine.WeightsyncInitInfo, which names
    the job of a server that has none of its own); every refusal a one-line error."""
    place = place_of(vllm_config.parallel_config, vllm_config.model_config, init)
    me = who(INFERENCE, place.rank)
    lora_config = getattr(vllm_config, "lora_config", None)
    lora = place.ctx.job.model.lora
    if lora is not None:
        check_lora(me, lora, lora_config)
    group = place.ctx.job.layout.tp_group(place.rank)
    needs, parts = _needs(me, place, group, vllm_config, model)
    return Placement(place, me, group, needs, None if needs is None else LocalLayout.of(place.layout, needs),
                     parts, {} if parts is None else {(p.tensor, p.box): p.loads_as for p in parts if p.loads_as},
                     load_ahead=place.ctx.job.inference.vllm.load_ahead and lora is None,
                     keep_session=lora_config is None or lora is not None)


def check_lora(me: str, lora: Lora, lora_config) -> None:
    """A server of a job whose versions are a LoRA adapter serves it, under its name: refused on one line otherwise."""
    problem = lora_problem(lora, lora_config is not None, getattr(lora_config, "max_lora_rank", None))
    if problem is None and os.environ.get(Env.VLLM_LORA) != lora.name:
        problem = (f"this job serves its LoRA adapter as {lora.name} (spec.model.lora.name): start the vLLM server "
                   f"with {Env.VLLM_LORA}={lora.name} and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment")
    if problem is not None:
        raise ValueError(f"{me}: {problem}")


def _needs(me: str, place: Place, group: range, vllm_config, model) -> tuple[RankSlices | None, tuple[Part, ...] | None]:
    """What this worker needs of a version (plan.boxes.RankSlices), or None where every inference
    rank of the job gets whole versions, and the parts vLLM loads where it holds slices; refuses a
    server whose parallelism or model is not the job's."""
    job, parallel, model_config = place.ctx.job, vllm_config.parallel_config, vllm_config.model_config
    load_ahead = job.inference.vllm.load_ahead
    tp = parallel.tensor_parallel_size
    try:
        check_experts(model)
    except UnsupportedLayer as e:
        raise ValueError(f"{me}: {e}") from None
    if load_ahead and any(cpu_packed(m) or int8_packed(m, "w13_weight") for m in model.modules()):
        # the packing (experts.pack_experts; the int8 kernel's, made anew) replaces what a commit fills
        raise ValueError(f"{me}: spec.inference.vllm.loadAhead: vLLM's CPU build packs a mixture of experts' "
                         "weights again after each load, which a version loaded ahead cannot take: drop loadAhead")
    served = expert_count(getattr(model_config, "hf_text_config", None) or model_config.hf_config)
    wanted = expert_count(config_of(job.model))
    if served != wanted:  # a server the user started on another model
        raise ValueError(f"{me}: this vLLM server's model has {served} routed experts per layer, and the job's "
                         f"spec.model {wanted}: serve the job's model")
    if parallel.pipeline_parallel_size != 1 or parallel.data_parallel_size != 1:
        raise ValueError(f"{me}: the weightsync backend takes vLLM's tensor parallelism only; this server "
                         f"runs pipeline-parallel size {parallel.pipeline_parallel_size} and data-parallel size "
                         f"{parallel.data_parallel_size}: start it without them")
    if tp != len(group):
        raise ValueError(f"{me}: this vLLM server runs {tp} tensor-parallel worker(s), and the job's model replica "
                         f"of inference ranks {group.start}..{group.stop - 1} has {len(group)}: start it "
                         f"with --tensor-parallel-size {len(group)} (spec.inference.tensorParallel)")
    if not job.layout.sliced:
        return None, None
    if tp == 1:
        return needs_everything(place.layout, place.rank), None
    try:
        if job.model.lora is not None:
            parts = adapter_parts(model, place.layout, vllm_config.lora_config)
        else:
            parts = worker_parts(model, place.layout, format_of(job.model.quantization))
    except UnsupportedLayer as e:
        raise ValueError(f"{me}: tensor-parallel size {tp}: {e}") from None
    split = split_experts(model)
    if split and load_ahead:
        # the experts' loaders read the layer's parallel config, which the live layers share
        # with the shadow a version is loaded ahead into (ahead.py)
        raise ValueError(f"{me}: spec.inference.vllm.loadAhead loads a mixture of experts ahead only where each "
                         f"worker holds whole experts; this server splits the experts of {split[0]} over "
                         f"{tp} tensor-parallel workers: set spec.inference.vllm.expertParallel, or drop loadAhead")
    return worker_needs(parts, place.rank), tuple(parts)
