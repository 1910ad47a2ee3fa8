"""The tensors of a weight version as a training loop holds them: a plain module, one wrapped in
DDP (or torch.compile), or one whose parameters FSDP2 (fully_shard) made DTensors sharded on dim 0.

The names are the module's own, as model.named_parameters() lists them for a transformers model
(the names of its Hugging Face checkpoint): the wrappers' prefixes ("module.", "_orig_mod.") are
dropped, and a tied weight is listed once. The version's layout is of the global shapes; what
this rank sends from is its local tensors, each with the rows it holds (shards.Holdings). A
DTensor is never gathered here: only its local shard is read. Dim-0 shards may nest over several
mesh dimensions (experts sharded by expert parallelism, then by FSDP2). Placements other than
dim-0 shards and replicas (tensor-parallel shards on other dims, partial sums) are refused by name.

A job whose versions are a LoRA adapter (spec.model.lora) sends the adapter's tensors alone, named
and ordered as model/lora.py lays them out, read off the model's LoRA layers (PEFT's or ours).

A producer that yields named tensors rather than a module (vLLM's WeightSource: a Megatron export,
an expert-parallel or pipeline-parallel trainer's own) is a NamedTensors: the version's every name
with its global shape, of which the rank holds some whole and the others not at all (no rows).

A quantized version (spec.model.quantization) is made here, each rank quantizing the rows it holds
on their device at every publish (model/quant.py): the layout is the quantized one, and a rank's
rows of a weight's scales are those of the rows it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterator, Sequence

import torch

from weightsync.model.flat import FlatLayout
from weightsync.model.lora import Adapter
from weightsync.model.quant import (
    Format,
    check_quantizable,
    format_of,
    quantize_layout,
    quantized_names,
    quantized_tensors,
)
from weightsync.plan.holders import Holdings

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and FSDP1's wrapper; torch.compile's


def version_name(name: str) -> str:
    """A parameter's name without the prefixes wrappers add."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name


class NamedTensors:
    """A trainer rank's weights as named tensors: every tensor of the version, in order, with its
    global shape and dtype (`shapes`), of which this rank holds those `held` names (None: all)
    whole, in storage of its own on `device` that its producer fills before each publish, and
    the others not at all (tensors of no rows), as other ranks hold them."""

    def __init__(self, shapes: Sequence[tuple[str, tuple[int, ...], torch.dtype]], held: Collection[str] | None,
                 device: torch.device | str = "cpu"):
        self.shapes = {name: tuple(shape) for name, shape, _ in shapes}
        self.tensors = {name: torch.empty(tuple(shape) if held is None or name in held else (0, *shape[1:]),
                                          dtype=dtype, device=device) for name, shape, dtype in shapes}

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())

    def held(self, name: str) -> bool:
        return self.tensors[name].shape == self.shapes[name]


@dataclass(frozen=True)
class Sources:
    """What one trainer rank sends from: the version's layout, and what the rank holds of it
    (None: every tensor whole)."""

    layout: FlatLayout
    holdings: Holdings | None
    device: torch.device
    adapter: Adapter | None = None  # the versions are this LoRA adapter alone
    base: FlatLayout | None = None
    """Of a quantized version: the layout of the model's own parameters (`layout` is the quantized one)."""
    fmt: Format | None = None

    @property
    def starts(self) -> list[int] | None:
        return self.holdings.starts(self.layout) if self.holdings is not None else None


def sources_of(model: torch.nn.Module, dtype: str, adapter: Adapter | None = None,
               quantization: str | None = None) -> Sources:
    """The version layout of `model`'s parameters cast to `dtype` (of its LoRA adapter's alone,
    with `adapter`, whose base weights `quantization` describes; else quantized as `quantization`
    says), and what this rank holds."""
    named = _named(model, adapter)
    if not named:
        raise ValueError("the model has no parameters to publish")
    if isinstance(model, NamedTensors) and (adapter is not None or quantization is not None):
        raise ValueError("a LoRA adapter or a quantized version is read off the model's own modules: publish the "
                         "module itself, not named tensors")
    layout = base = FlatLayout.from_shapes([(n, _shape(model, n, p)) for n, p in named], dtype)
    rows = tuple(_rows_held(n, p) for n, p in named)
    fmt = format_of(quantization) if adapter is None else None  # an adapter travels in `dtype`
    if fmt is not None:
        check_quantizable(model, fmt)
        quantized = {version_name(n) for n in quantized_names(model)}
        layout = quantize_layout(base, quantized, fmt)
        held = {s.name: (s, r) for s, r in zip(base.slots, rows)}
        rows = tuple(held[s.name][1] if s.name in held else _scale_rows(fmt, *held[s.name.removesuffix(fmt.scale_suffix)])
                     for s in layout.slots)
    holdings = Holdings(rows)
    devices = {_local(p).device for _, p in named}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several devices ({', '.join(sorted(map(str, devices)))}); "
                         "weightsync sends from one device per rank")
    return Sources(layout, None if holdings.is_whole(layout) else holdings, devices.pop(), adapter,
                   base if fmt is not None else None, fmt)


def _scale_rows(fmt: Format, weight, rows: tuple[int, int]) -> tuple[int, int]:
    return fmt.scale_rows(weight.name, weight.shape, *rows)


def local_tensors(model: torch.nn.Module, sources: Sources) -> list[torch.Tensor]:
    """This rank's tensors of the version as they are now, in layout order: each whole tensor, or
    the local shard of each DTensor (no copy). Refuses a model that no longer matches `sources`
    (parameters replaced, or FSDP's unsharded parameters, inside its forward or backward)."""
    named = _named(model, sources.adapter)
    own = sources.base or sources.layout
    if [n for n, _ in named] != own.names:
        raise ValueError("the model's parameters are not the ones weightsync.attach() saw: publish from the model attached")
    out = []
    held = dict(zip(sources.layout.names, _rows(sources)))
    for (name, p), slot in zip(named, own.slots):
        first, end = held[name]
        local = _local(p).detach()
        rows = local.shape[0] if local.dim() else 1
        if _shape(model, name, p) != slot.shape or rows != end - first:
            raise ValueError(f"parameter {name} is not as it was when weightsync.attach() saw it ({list(local.shape)} "
                             f"held of {list(p.shape)}); with FSDP publish between optimizer steps, "
                             "not inside forward or backward")
        out.append(local)
    return out if sources.fmt is None else quantized_tensors(sources.layout, sources.fmt, out)


def _rows(sources: Sources) -> tuple[tuple[int, int], ...]:
    holdings = sources.holdings or Holdings.whole(sources.layout)
    return holdings.rows


def _named(model: torch.nn.Module, adapter: Adapter | None = None) -> list[tuple[str, torch.nn.Parameter]]:
    if adapter is not None:
        return adapter.tensors(model)
    if isinstance(model, NamedTensors):  # the producer's own names
        return list(model.named_parameters())
    return [(version_name(n), p) for n, p in model.named_parameters()]


def _shape(model, name: str, p) -> tuple[int, ...]:
    """The global shape of the version's tensor `name`, whose parameter (or held tensor) is `p`."""
    return model.shapes[name] if isinstance(model, NamedTensors) else tuple(p.shape)


def _is_dtensor(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _local(p) -> torch.Tensor:
    return p.to_local() if _is_dtensor(p) else p


def _rows_held(name: str, p) -> tuple[int, int]:
    """The dim-0 rows [first, end) of `p` this rank holds: one run of them, whatever the mesh (FSDP2's
    Shard(0), or a mixture of experts' experts sharded over an expert-parallel mesh dimension and
    again by FSDP2 over another, as torchtitan shards them: nested Shard(0) placements), as
    DTensor itself places the rank's shard."""
    rows = p.shape[0] if p.dim() else 1
    if not _is_dtensor(p):
        return 0, rows
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    odd = [pl for pl in p.placements if not isinstance(pl, Replicate) and not (type(pl) is Shard and pl.dim == 0)]
    if odd:
        raise ValueError(f"parameter {name} is a DTensor placed as {tuple(p.placements)}: weightsync sends shards on "
                         "dim 0 (FSDP2's fully_shard, expert parallelism, nested over several mesh dimensions) and "
                         "their replicas; shards on other dims (tensor parallelism), strided shards and partial "
                         "values are not supported")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    first, end = (offset[0], offset[0] + shape[0]) if p.dim() else (0, 1)
    local = p.to_local()
    held = local.shape[0] if local.dim() else 1
    if held != end - first:
        raise ValueError(f"parameter {name}: this rank holds {held} rows of {rows}, not the {end - first} rows "
                         f"[{first}, {end}) that its placement {tuple(p.placements)} gives")
    return first, end
