"""What a vLLM worker takes of a version, as records: the vocabulary that the readers of vLLM's
layers (shards.py for linear layers and embeddings, experts.py for fused experts, lora_shards.py for
LoRA layers) answer in, and that the engine loads from. Each reader asks vLLM's own model; these
records are what they agree on, so that no reader imports another's internals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.plan.boxes import Box
from weightsync.vllm_backend.internals import parameters_of, recorded_parameters


class UnsupportedLayer(ValueError):
    """A parameter whose tensor-parallel part weightsync cannot read from vLLM."""


@dataclass(frozen=True)
class Part:
    """What the worker takes of checkpoint tensor `tensor`: `box` of it, loaded into vLLM's
    parameter `param` (as `shard` of a fused one); box None: vLLM loads nothing from it."""

    tensor: str
    param: str | None
    shard: str | int | Expert | None
    box: Box | None
    loads_as: tuple[str, ...] = ()
    """Where vLLM loads the part as tensors of one expert each (its dim 0): their checkpoint names."""


@dataclass(frozen=True)
class Expert:
    """The shard of a fused-experts parameter a part feeds: `shard_id` (w1: gate, w3: up, w2:
    down) of the experts vLLM keeps in slots `local` of it on this worker (one per expert of the
    part; none: another worker's experts)."""

    shard_id: str
    local: tuple[int, ...]


def checkpoint_param(module: torch.nn.Module, attr: str) -> torch.Tensor:
    """The parameter in checkpoint format, with its attributes: what vLLM recorded for its
    layerwise reload (before its CPU build repacked it), else the live one (a bias, which vLLM
    does not record and does not repack)."""
    return recorded_parameters(module).get(attr, parameters_of(module)[attr])


def loaded_parameters(model: torch.nn.Module) -> list[str]:
    """The parameters vLLM loads from a checkpoint: those it recorded for its layerwise reload, in
    checkpoint format, not those its processing after loading made (the int8 kernel's azp_adj);
    all of a layer's where it recorded none."""
    out, seen = [], set()  # a parameter shared by two layers (tied weights) once, as named_parameters lists it
    for path, module in model.named_modules():
        recorded, params = recorded_parameters(module), parameters_of(module)
        for name in recorded or [n for n, p in params.items() if p is not None]:
            live = params.get(name)
            if live is not None:
                if id(live) in seen:
                    continue
                seen.add(id(live))
            out.append(f"{path}.{name}" if path else name)
    return out
