"""What one vLLM worker of a tensor-parallel server holds of a version, read from vLLM itself, and
how it loads only that.

A version travels as the Hugging Face checkpoint's tensors (the trainers' names and shapes). A
vLLM worker of tensor-parallel size N holds a part of most of them, and which part is vLLM's own
business: its model maps checkpoint names onto its parameters (the model's hf_to_vllm_mapper:
q_proj, k_proj and v_proj into qkv_proj as shards "q", "k", "v"; gate_proj and up_proj into
gate_up_proj as shards 0 and 1), and each layer class narrows what it loads by the worker's tensor
-parallel rank. This module asks the worker's model, not a table of our own, and turns the answer
into the slice planner's needs (plan.boxes.RankSlices: boxes of the global checkpoint tensors):

- QKVParallelLinear: the rows of the worker's query heads of q_proj, and of its KV heads of k_proj
  and v_proj, which vLLM replicates when N exceeds the KV heads (several workers then need the
  same rows: the planner sends them to each);
- MergedColumnParallelLinear (gate_up_proj): the worker's share of the rows of each of its parts;
- ColumnParallelLinear: its rows (output_dim); RowParallelLinear: its columns (input_dim) of the
  weight, and the whole bias (added after the reduction);
- VocabParallelEmbedding and ParallelLMHead: the worker's vocabulary rows (vLLM pads the
  vocabulary, and its own loader fills the padding with zeros);
- RoutedExperts (a mixture of experts' fused experts): read through the layer's own expert
  mapping (experts.py). A shared expert is a dense MLP (the linear layers above), the router's
  gate a replicated linear layer (whole on every worker);
- a quantized version's scales (spec.model.quantization: int8's weight_scale, fp8's
  weight_scale_inv): the scales of the worker's part of their weight (model/quant.py: its rows'
  per-row scales, or the 128x128 blocks its part covers), loaded by vLLM's quantized layers as
  they load the weight's part; a quantized expert's scales likewise, mapped by the layer's expert
  mapping as the weight is (whole experts only: expert parallelism, or tensor-parallel size 1);
- every parameter these layers do not shard (norms, a layer with tensor parallelism disabled):
  the whole tensor.

Shapes and the output_dim/input_dim attributes come from the checkpoint-format parameters vLLM
records for its layerwise reload (its CPU build repacks a linear layer's weight for its GEMM
kernel and leaves the live parameter empty). Every parameter of the model must be fed by some
checkpoint tensor and every part must fit the parameter it lands in, else the worker refuses at
init, naming the parameter: a layer class this module does not know (a mixture of experts, say)
is refused, never guessed.

Loading: vLLM's loaders narrow a whole checkpoint tensor to the worker's part by tensor-parallel
rank. `presharded` (internals.py) hands them the part itself: for the reload, every sharded linear layer and its
parameters load as tensor-parallel rank 0 of the part (as vLLM's own MLA projection loads its
replicated latents), a vocabulary layer's shard starts at row 0 of the part, and fused experts
load as if tensor parallelism were 1 (their expert map, which expert parallelism sets, stays); all
of it is put back when the reload ends, so the layers serve as before. What vLLM processes after loading runs
as for any reload.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.model_executor.layers.attention import is_deferred_attention_layer
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from weightsync.model.flat import FlatLayout
from weightsync.model.quant import Format
from weightsync.plan.boxes import Box, RankSlices, Slice
from weightsync.vllm_backend import VLLM_TESTED
from weightsync.vllm_backend.experts import check_fed_experts, expert_layers, expert_parts, split_experts
from weightsync.vllm_backend.internals import parameters_of, shard_mapper
from weightsync.vllm_backend.parts import Part, UnsupportedLayer, checkpoint_param, loaded_parameters

QKV_SHARDS = ("q", "k", "v")


def worker_parts(model: torch.nn.Module, layout: FlatLayout, fmt: Format | None = None) -> list[Part]:
    """The part of every tensor of the version that this worker's model holds (tensor order); of a
    version quantized in `fmt`, a weight's scales follow its part (model/quant.py)."""
    modules = dict(model.named_modules())
    experts = expert_layers(model)
    split = split_experts(model) if fmt is not None else []
    if split:
        raise UnsupportedLayer(f"spec.model.quantization {fmt.name}: vLLM splits the fused experts of {split[0]} by "
                               "tensor-parallel rank, and slices of quantized experts with their scales are read from "
                               "vLLM only where each worker holds whole experts: set spec.inference.vllm.expertParallel, "
                               "or serve this model with tensorParallel 1")
    parts, by_tensor, shapes = [], {}, {s.name: tuple(s.shape) for s in layout.slots}
    of_experts: dict[str, list[Part]] = {}  # an expert tensor -> its parts, which its scales follow
    for slot in layout.slots:
        if experts:
            found = expert_parts(experts, model, slot.name, tuple(slot.shape))
            if found is not None:
                weight = fmt.weight_of(slot.name) if fmt is not None else None
                if weight in of_experts:  # a quantized expert weight's scales: those of each of its parts
                    found = [_scales_of(fmt, w, s, shapes[weight], f"a vLLM worker ({s.param}, experts {s.shard.local})")
                             for w, s in _aligned(of_experts[weight], found)]
                of_experts[slot.name] = found
                parts.extend(found)
                continue
        found = target(model, slot.name)
        if found is None:
            parts.append(Part(slot.name, None, None, None))
            continue
        param, shard = found
        module_name, _, attr = param.rpartition(".")
        module = modules.get(module_name)
        if module is None or attr not in parameters_of(module):
            parts.append(Part(slot.name, None, None, None))  # vLLM has no such parameter and skips the tensor
            continue
        weight = by_tensor.get(fmt.weight_of(slot.name)) if fmt is not None else None
        if weight is not None:  # the scales of a quantized weight: the rows (or blocks) of its part
            holder = f"a vLLM worker (tensor-parallel rank {getattr(module, 'tp_rank', 0)} of {getattr(module, 'tp_size', 1)})"
            parts.append(_scales_of(fmt, weight, Part(slot.name, param, shard, None), shapes[weight.tensor], holder))
            continue
        meta = checkpoint_param(module, attr)
        try:
            box = layer_box(module, attr, meta, shard, tuple(slot.shape), slot.name)
        except AttributeError as e:  # a vLLM release whose layers keep their tensor-parallel state elsewhere
            raise UnsupportedLayer(f"{slot.name}: this vLLM's {type(module).__name__} does not say what a worker "
                                   f"holds as vLLM {VLLM_TESTED}'s does ({e}); serve the model with tensorParallel 1 "
                                   f"or use vLLM {VLLM_TESTED}") from None
        parts.append(Part(slot.name, param, shard, box))
        by_tensor[slot.name] = parts[-1]
    _check(model, modules, parts)
    return parts


def _scales_of(fmt: Format, weight: Part, scales: Part, shape: tuple, holder: str) -> Part:
    """`scales` (a part of a quantized weight's scales, as vLLM loads them) with the box that
    quantizes the worker's part `weight` of the weight (of `shape`), refused on one line where an
    fp8 part cuts a 128x128 block; none where the worker holds nothing of the weight."""
    if weight.box is None:
        return dataclasses.replace(scales, box=None)
    start, stop = fmt.scale_bounds(weight.tensor, shape, weight.box.start, weight.box.stop, holder,
                                   "choose a tensor-parallel size that leaves every worker whole blocks of every "
                                   "weight, or quantize int8")
    return dataclasses.replace(scales, box=Box(start, stop))


def _aligned(weight: list[Part], scales: list[Part]) -> zip:
    """The parts of a quantized expert weight paired with those of its scales, which vLLM's expert
    mapping gives the same shards and experts (refused, naming the scales, where it does not)."""
    if [p.shard for p in weight] != [p.shard for p in scales]:
        raise UnsupportedLayer(f"{scales[0].tensor}: vLLM loads these scales into other experts or shards "
                               f"({[p.shard for p in scales]}) than their weight's ({[p.shard for p in weight]})")
    return zip(weight, scales)


def worker_needs(parts: list[Part], rank: int) -> RankSlices:
    """The slice planner's view of the parts: what inference rank `rank` needs."""
    return RankSlices(rank, tuple(Slice(p.tensor, p.box) for p in parts if p.box is not None))


def target(model, name: str) -> tuple[str, str | int | None] | None:
    """vLLM's parameter for checkpoint tensor `name`, and the shard of it, as the model maps them
    (None: the model drops the tensor)."""
    mapper = shard_mapper(model)
    if mapper is not None:
        mapped = mapper(name)
        if mapped is None:
            return None
        param, shard = mapped
    else:  # a model without a mapper: its packed modules (qkv_proj: [q_proj, k_proj, v_proj])
        param, shard = name, None
        module, _, attr = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        for fused, members in (getattr(model, "packed_modules_mapping", None) or {}).items():
            if leaf in members:
                param = f"{parent}.{fused}.{attr}" if parent else f"{fused}.{attr}"
                shard = members.index(leaf)
                break
    if shard is not None and not isinstance(shard, (str, int)):
        raise UnsupportedLayer(f"vLLM loads {name} into {param} as shards {shard!r}; weightsync's tensor-parallel "
                               "slicing takes one shard per checkpoint tensor: serve this model with tensorParallel 1")
    return param, shard


def layer_box(module, attr: str, meta: torch.Tensor, shard, shape: tuple, name: str) -> Box:
    whole = Box((0,) * len(shape), shape)
    if getattr(module, "tp_size", 1) == 1 or not shape:
        return whole
    if isinstance(module, VocabParallelEmbedding):
        if getattr(meta, "output_dim", None) is None:
            return whole
        indices = module.shard_indices
        return _on(shape, 0, indices.org_vocab_start_index, indices.org_vocab_end_index - indices.org_vocab_start_index)
    if isinstance(module, RowParallelLinear):
        dim = getattr(meta, "input_dim", None)
        if dim is None:  # the bias: added after the reduction, whole on every worker
            return whole
        size = meta.shape[dim]
        return _on(shape, dim, module.tp_rank * size, size)
    if isinstance(module, ColumnParallelLinear):
        dim = getattr(meta, "output_dim", None)
        if dim is None:
            return whole
        if isinstance(module, QKVParallelLinear):
            if shard not in QKV_SHARDS:
                raise UnsupportedLayer(f"{name}: vLLM loads it into {type(module).__name__} as shard {shard!r}, "
                                       f"not one of {', '.join(QKV_SHARDS)}")
            if shard == "q":
                size = module.num_heads * module.head_size
                return _on(shape, dim, module.tp_rank * size, size)
            size = module.num_kv_heads * (module.head_size if shard == "k" else module.v_head_size)
            return _on(shape, dim, (module.tp_rank // module.num_kv_head_replicas) * size, size)
        if isinstance(module, MergedColumnParallelLinear):
            if not isinstance(shard, int) or not 0 <= shard < len(module.output_sizes):
                raise UnsupportedLayer(f"{name}: vLLM loads it into {type(module).__name__} as shard {shard!r}")
            size = module.output_sizes[shard] // module.tp_size
            return _on(shape, dim, module.tp_rank * size, size)
        size = meta.shape[dim]
        return _on(shape, dim, module.tp_rank * size, size)
    if isinstance(module, LinearBase):  # ReplicatedLinear: every worker holds it whole
        return whole
    if getattr(meta, "output_dim", None) is not None or getattr(meta, "input_dim", None) is not None:
        raise UnsupportedLayer(f"{name}: vLLM shards it in a {type(module).__name__}, a layer weightsync's "
                               "tensor-parallel slicing does not know; serve this model with tensorParallel 1")
    return whole


def _on(shape: tuple, dim: int, start: int, size: int) -> Box:
    if dim >= len(shape) or start < 0 or size <= 0 or start + size > shape[dim]:
        raise UnsupportedLayer(f"a part of {size} at {start} on dim {dim} is outside a checkpoint tensor of shape "
                               f"{list(shape)}")
    begin, end = [0] * len(shape), list(shape)
    begin[dim], end[dim] = start, start + size
    return Box(tuple(begin), tuple(end))


def _check(model, modules: dict, parts: list[Part]) -> None:
    """Every parameter of the model is fed, and what feeds it fits it."""
    fed: dict[str, list[Part]] = {}
    for p in parts:
        if p.box is not None:
            fed.setdefault(p.param, []).append(p)
    # an attention layer's own parameters (MLA's W_UK_T and W_UV) are what its processing derives
    # from the projections' weights after loading, not loaded
    unfed = [name for name in loaded_parameters(model)
             if name not in fed and not is_deferred_attention_layer(modules.get(name.rpartition(".")[0]))]
    if unfed:
        raise UnsupportedLayer(f"no tensor of the version feeds vLLM's parameter(s) {', '.join(unfed[:4])}"
                               f"{' and more' if len(unfed) > 4 else ''}: the model's names do not map onto this "
                               "vLLM model's as weightsync reads them; serve it with tensorParallel 1")
    for param, feeding in fed.items():
        module_name, _, attr = param.rpartition(".")
        meta = checkpoint_param(modules[module_name], attr)
        if isinstance(modules[module_name], RoutedExperts):
            check_fed_experts(modules[module_name], param, meta, feeding)
            continue
        if isinstance(modules[module_name], VocabParallelEmbedding):
            rows, rest = feeding[0].box.shape[0], feeding[0].box.shape[1:]
            fits = len(feeding) == 1 and rows <= meta.shape[0] and tuple(rest) == tuple(meta.shape[1:])
        elif len(feeding) == 1 and feeding[0].shard is None:
            fits = tuple(feeding[0].box.shape) == tuple(meta.shape)
        else:  # the parts of a fused parameter stack on its output dim
            dim = getattr(meta, "output_dim", 0)
            shapes = [p.box.shape for p in feeding]
            fits = (sum(s[dim] for s in shapes) == meta.shape[dim]
                    and all(s[:dim] + s[dim + 1:] == tuple(meta.shape[:dim]) + tuple(meta.shape[dim + 1:]) for s in shapes))
        if not fits:
            got = ", ".join(f"{p.tensor} {p.box}" for p in feeding)
            raise UnsupportedLayer(f"vLLM's parameter {param} holds {list(meta.shape)} on this worker, and the parts "
                                   f"read from vLLM's layers do not fill it ({got}); serve this model with tensorParallel 1")

