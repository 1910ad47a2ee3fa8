"""A checkpoint's tensors as the tests write them to disk: quantized (each quantized weight
followed by its scales, as a quantized version holds them), and a mixture of experts' stacks of
every expert (transformers' names, which the trainers hold) split into one tensor per expert, as
published checkpoints store them and as every vLLM loader of them reads them."""

from __future__ import annotations

import re

import torch

from weightsync.model.quant import FORMATS, quantize

# a stack of every expert's (transformers' names), or an int8 one's scales
EXPERT_STACK = re.compile(r"experts\.(gate_up_proj|down_proj)(_scale)?$")


def quantized(tensors: dict[str, torch.Tensor], names: set[str], quantization: str) -> dict[str, torch.Tensor]:
    """The tensors of a quantized checkpoint: each of `names` quantized, followed by its scales."""
    fmt, out = FORMATS[quantization], {}
    for name, t in tensors.items():
        if name in names:
            out[name], out[fmt.scale_name(name)] = quantize(t, fmt)
        else:
            out[name] = t
    return out


def one_per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint as the models' published checkpoints name their experts (experts.<e>.gate_proj
    and so on, one tensor each, an int8 one's scales as experts.<e>.gate_proj.weight_scale), which
    vLLM's loaders of these models read; transformers stacks them (experts.gate_up_proj), which
    vLLM's DeepSeek loader does not take."""
    out = {}
    for name, t in tensors.items():
        stack = EXPERT_STACK.search(name)
        if stack is None:
            out[name] = t
            continue
        stem, tail = name[:stack.start()] + "experts.", "weight" + (stack[2] or "")
        if stack[1] == "gate_up_proj":
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"{stem}{e}.gate_proj.{tail}"], out[f"{stem}{e}.up_proj.{tail}"] = gate, up
        else:
            out.update({f"{stem}{e}.down_proj.{tail}": down for e, down in enumerate(t)})
    return out
