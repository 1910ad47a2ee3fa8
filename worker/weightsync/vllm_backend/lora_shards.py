"""What one worker of a tensor-parallel vLLM server holds of a LoRA adapter (spec.model.lora), read
from vLLM's LoRA layers, and how the worker hands vLLM the part it received.

vLLM's LoRA layers (vllm/lora/layers/, not fully sharded) shard an adapter as the base layer they
wrap is sharded: a column-parallel layer (the fused qkv_proj, gate_up_proj) takes B [out, rank] by
its output rows, the rows of each part it fuses, and A [rank, in] whole; a row-parallel layer
(o_proj, down_proj) takes A by its input columns and B whole. Either way an adapter tensor's box
follows its base weight's box (shards.py reads that box from the base layer): A takes the base
box's columns, B its rows. With --fully-sharded-loras vLLM also cuts A of column-parallel layers
by rank, which the base's box does not say: such a server is refused at init.

Loading: vLLM's LoRA layers narrow whole adapter tensors to the worker's part by its
tensor-parallel rank when they take an adapter into their slots (set_lora). The worker builds
vLLM's LoRAModel (adapter.py) from tensors of the adapter's whole shapes that hold the part it
received at its box; the rest, zeros, is what that narrowing leaves out, so no byte of it reaches
vLLM's kernels. An adapter is a few MiB, and other adapters a server loads from disk are narrowed
exactly as vLLM always does.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from weightsync.model.flat import FlatLayout
from weightsync.model.lora import PREFIX
from weightsync.plan.boxes import Box
from weightsync.plan.sliced_plan import LocalLayout
from weightsync.vllm_backend.parts import Part, UnsupportedLayer, checkpoint_param
from weightsync.vllm_backend.shards import layer_box, target

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def adapter_parts(model: torch.nn.Module, layout: FlatLayout, lora_config) -> list[Part]:
    """The part of every tensor of the adapter (`layout`: lora_A [rank, in], lora_B [out, rank]
    of each target layer, in PEFT's names) that this worker's LoRA layers hold."""
    if getattr(lora_config, "fully_sharded_loras", False):
        raise UnsupportedLayer("this vLLM server runs with --fully-sharded-loras, whose LoRA layers also cut the adapter's "
                               "A matrices by tensor-parallel rank; weightsync slices an adapter as vLLM does without it: "
                               "start the server without --fully-sharded-loras")
    modules = dict(model.named_modules())
    shapes = {s.name: tuple(s.shape) for s in layout.slots}
    parts = []
    for slot in layout.slots:
        name = slot.name
        if not name.startswith(PREFIX) or not name.endswith((LORA_A, LORA_B)):
            raise UnsupportedLayer(f"{name}: not a LoRA adapter's tensor in PEFT's names (<layer>{LORA_A}, {LORA_B})")
        layer = name[len(PREFIX):-len(LORA_A)]
        a, b = shapes[f"{PREFIX}{layer}{LORA_A}"], shapes[f"{PREFIX}{layer}{LORA_B}"]
        weight = f"{layer}.weight"
        found = target(model, weight)
        wrapper = modules.get(found[0].rpartition(".")[0]) if found is not None else None
        base = getattr(wrapper, "base_layer", None)
        if base is None:
            raise UnsupportedLayer(f"{name}: vLLM's model has no LoRA layer for {layer} (its adapter targets, "
                                   "spec.model.lora.targetModules, must be layers vLLM serves with LoRA)")
        shard = found[1]
        box = layer_box(base, "weight", checkpoint_param(base, "weight"), shard, (b[0], a[1]), weight)
        if name.endswith(LORA_A):  # [rank, in]: the base's input columns
            part = Box((0, box.start[1]), (a[0], box.stop[1]))
        else:  # [out, rank]: the base's output rows
            part = Box((box.start[0], 0), (box.stop[0], b[1]))
        parts.append(Part(name, found[0], shard, part))
    return parts


def whole_adapter(local: LocalLayout, layout: FlatLayout, parts: Iterable[tuple[str, torch.Tensor]]) -> Iterator[
        tuple[str, torch.Tensor]]:
    """(name, tensor of the adapter's whole shape) for every tensor of this worker's `parts` (its
    local layout's, in order): the part at its box, zeros elsewhere, which vLLM's LoRA layers
    narrow away (see the module's docstring)."""
    shapes = {s.name: tuple(s.shape) for s in layout.slots}
    for slot, (name, part) in zip(local.slots, parts):
        whole = torch.zeros(shapes[name], dtype=part.dtype, device=part.device)
        whole[tuple(slice(a, b) for a, b in zip(slot.box.start, slot.box.stop))] = part
        yield name, whole
