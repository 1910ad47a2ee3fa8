"""What one vLLM worker of a tensor-parallel server holds of a version, read from vLLM itself, and
how it loads only that.

A version travels as the Hugging Face checkpoint's tensors (the trainers' names and shapes). A
vLLM worker of tensor-parallel size N holds a part of most of them, and which part is vLLM's own
business: its model maps checkpoint names onto its parameters (the model's hf_to_vllm_mapper:
q_proj, k_proj and v_proj into qkv_proj as shards "q", "k", "v"; gate_proj and up_proj into
gate_up_proj as shards 0 and 1), and each layer class narrows what it loads by the worker's tensor
-parallel rank. This module asks the worker's model, not a table of our own, and turns the answer
into the slice planner's needs (plan.slices.RankSlices: boxes of the global checkpoint tensors):

- QKVParallelLinear: the rows of the worker's query heads of q_proj, and of its KV heads of k_proj
  and v_proj, which vLLM replicates when N exceeds the KV heads (several workers then need the
  same rows: the planner sends them to each);
- MergedColumnParallelLinear (gate_up_proj): the worker's share of the rows of each of its parts;
- ColumnParallelLinear: its rows (output_dim); RowParallelLinear: its columns (input_dim) of the
  weight, and the whole bias (added after the reduction);
- VocabParallelEmbedding and ParallelLMHead: the worker's vocabulary rows (vLLM pads the
  vocabulary, and its own loader fills the padding with zeros);
- RoutedExperts (a mixture of experts' fused experts, w13_weight of every local expert's gate and
  up projections stacked, w2_weight of its down projections): the model's expert mapping (vLLM's
  own, as its loader reads it) names the parameter, the expert and the shard (w1, w2, w3) of each
  checkpoint expert tensor; under tensor parallelism a worker holds every expert's share of the
  intermediate dimension (the rows of gate_proj and up_proj, the columns of down_proj); under
  expert parallelism (--enable-expert-parallel) it holds whole experts, the ones vLLM's expert
  placement gives it (its expert map), and nothing of the others. A shared expert is a dense MLP
  (the linear layers above), the router's gate a replicated linear layer (whole on every worker);
- every parameter these layers do not shard (norms, a layer with tensor parallelism disabled):
  the whole tensor.

Shapes and the output_dim/input_dim attributes come from the checkpoint-format parameters vLLM
records for its layerwise reload (its CPU build repacks a linear layer's weight for its GEMM
kernel and leaves the live parameter empty). Every parameter of the model must be fed by some
checkpoint tensor and every part must fit the parameter it lands in, else the worker refuses at
init, naming the parameter: a layer class this module does not know (a mixture of experts, say)
is refused, never guessed.

Loading: vLLM's loaders narrow a whole checkpoint tensor to the worker's part by tensor-parallel
rank. `presharded` hands them the part itself: for the reload, every sharded linear layer and its
parameters load as tensor-parallel rank 0 of the part (as vLLM's own MLA projection loads its
replicated latents), a vocabulary layer's shard starts at row 0 of the part, and fused experts
load as if tensor parallelism were 1 (their expert map, which expert parallelism sets, stays); all
of it is put back when the reload ends, so the layers serve as before. What vLLM processes after loading runs
as for any reload.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.attention import is_deferred_attention_layer
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

from weightsync.model.flat import FlatLayout
from weightsync.plan.boxes import Box, RankSlices, Slice
from weightsync.vllm_backend import TESTED_VLLM

QKV_SHARDS = ("q", "k", "v")
# the dim of a checkpoint expert weight that vLLM splits by tensor-parallel rank (the intermediate
# one): gate_proj and up_proj are [intermediate, hidden], down_proj [hidden, intermediate]
EXPERT_DIM = {"w1": 0, "w3": 0, "w2": 1}


class UnsupportedLayer(ValueError):
    """A parameter whose tensor-parallel part this module cannot read from vLLM."""


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


def worker_parts(model: torch.nn.Module, layout: FlatLayout) -> list[Part]:
    """The part of every tensor of the version that this worker's model holds (tensor order)."""
    modules = dict(model.named_modules())
    experts = {m.layer_name: (path, m) for path, m in modules.items() if isinstance(m, RoutedExperts)}
    parts = []
    for slot in layout.slots:
        if experts:
            found = _expert_parts(experts, model, slot.name, tuple(slot.shape))
            if found is not None:
                parts.extend(found)
                continue
        target = _target(model, slot.name)
        if target is None:
            parts.append(Part(slot.name, None, None, None))
            continue
        param, shard = target
        module_name, _, attr = param.rpartition(".")
        module = modules.get(module_name)
        if module is None or attr not in module._parameters:
            parts.append(Part(slot.name, None, None, None))  # vLLM has no such parameter and skips the tensor
            continue
        meta = _checkpoint_param(module, attr)
        try:
            box = _box(module, attr, meta, shard, tuple(slot.shape), slot.name)
        except AttributeError as e:  # a vLLM release whose layers keep their tensor-parallel state elsewhere
            raise UnsupportedLayer(f"{slot.name}: this vLLM's {type(module).__name__} does not say what a worker "
                                   f"holds as vLLM {TESTED_VLLM}'s does ({e}); serve the model with tensorParallel 1 "
                                   f"or use vLLM {TESTED_VLLM}") from None
        parts.append(Part(slot.name, param, shard, box))
    _check(model, modules, parts)
    return parts


def worker_needs(parts: list[Part], rank: int) -> RankSlices:
    """The slice planner's view of the parts: what inference rank `rank` needs."""
    return RankSlices(rank, tuple(Slice(p.tensor, p.box) for p in parts if p.box is not None))


def _target(model, name: str) -> tuple[str, str | int | None] | None:
    """vLLM's parameter for checkpoint tensor `name`, and the shard of it, as the model maps them
    (None: the model drops the tensor)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "_map_name_with_shard"):
        mapped = mapper._map_name_with_shard(name)
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


def _expert_parts(experts: dict, model, name: str, shape: tuple) -> list[Part] | None:
    """What the worker takes of `name` where it is an expert tensor of a fused-experts layer (None:
    it is not), read from the layer's expert mapping as vLLM's RoutedExperts.load_weights reads it.
    A checkpoint tensor of one expert (experts.<e>.gate_proj) is one part; one of every expert
    (transformers' experts.gate_up_proj [experts, 2 x intermediate, hidden], experts.down_proj
    [experts, hidden, intermediate]) is a part per shard and run of the worker's experts, which the
    worker hands vLLM as the tensors of one expert each (Part.loads_as)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapped = mapper.map_name(name) if mapper is not None and hasattr(mapper, "map_name") else name
    owner = None if mapped is None else max((n for n in experts if mapped.startswith(n + ".")), key=len, default=None)
    if owner is None:
        return None
    path, layer = experts[owner]
    hits = [h for h in layer.get_expert_mapping(include_fused=True) if h[1] in mapped]
    if not hits:
        return None  # not an expert weight (vLLM's loader takes nothing from it either)
    param_name, weight_name, _, _ = hits[0]
    attr = mapped.replace(weight_name, param_name).removeprefix(owner + ".")
    if attr not in layer._parameters:
        return [Part(name, None, None, None)]  # a bias the layer has none of: vLLM's loader skips it
    config = layer.moe_config
    if config.moe_parallel_config.enable_eplb or config.num_experts != config.num_logical_experts:
        raise UnsupportedLayer(f"{name}: vLLM's expert load balancer places redundant copies of experts ({path}); "
                               "weightsync reads a fixed placement: serve without --enable-eplb")
    meta = _checkpoint_param(layer, attr)
    if getattr(meta, "is_transposed", False) or layer.is_fused_checkpoint_transposed:
        raise UnsupportedLayer(f"{name}: vLLM's {type(layer).__name__} {path} reads its experts transposed; "
                               "weightsync slices experts laid out as [intermediate, hidden] (gate, up) and "
                               "[hidden, intermediate] (down): serve this model with tensorParallel 1")
    param = f"{path}.{attr}"
    bias = attr.endswith("bias")
    if len(shape) == (2 if bias else 3):  # one tensor of every expert: the expert is its dim 0
        ids, inner = range(shape[0]), shape[1:]
    else:
        ids, inner = [hits[0][2]], shape
    stem, _, tail = name.partition(weight_name)
    tail = tail.lstrip("._") or ("bias" if bias else "weight")
    shards = [h[3] for h in hits if h[1] == weight_name]  # gate and up where both stack in one tensor
    names = {"w1": layer.ckpt_gate_proj_name, "w3": layer.ckpt_up_proj_name, "w2": layer.ckpt_down_proj_name}
    runs = _runs_of([(e, layer._map_global_expert_id_to_local_expert_id(e)) for e in ids])
    parts = []
    for half, shard_id in enumerate(shards):
        if not runs:  # another worker's experts (expert parallelism)
            parts.append(Part(name, param, Expert(shard_id, ()), None))
        for first, slots in runs:
            box = _expert_box(inner, half, shard_id, bias, len(shards), config.moe_parallel_config, name)
            if len(inner) < len(shape):
                box = Box((first,) + box.start, (first + len(slots),) + box.stop)
            # vLLM loads it as it is (one expert's tensor of one shard), or as one expert's each
            plain = len(inner) == len(shape) and len(shards) == 1
            loads_as = () if plain else tuple(f"{stem}experts.{e}.{names[shard_id]}.{tail}"
                                              for e in range(first, first + len(slots)))
            parts.append(Part(name, param, Expert(shard_id, slots), box, loads_as))
    return parts


def _expert_box(shape: tuple, half: int, shard_id: str, bias: bool, halves: int, parallel, name: str) -> Box:
    """The worker's box of one expert's tensor of `shape` (`half` of `halves` stacked shards on
    dim 0, gate and up): its share of the intermediate dimension under tensor parallelism."""
    rows = shape[0] // halves
    dim = 0 if bias else EXPERT_DIM[shard_id]
    size = rows if dim == 0 else shape[dim]
    if shard_id == "w2" and bias or parallel.tp_size == 1:  # down_proj's bias: added after the reduction
        start, part = 0, size
    else:
        if size % parallel.tp_size:
            raise UnsupportedLayer(f"{name}: its {size} intermediate rows do not split evenly over "
                                   f"{parallel.tp_size} tensor-parallel workers")
        part = size // parallel.tp_size
        start = parallel.tp_rank * part
    begin, end = [0] * len(shape), list(shape)
    if dim == 0:
        begin[0], end[0] = half * rows + start, half * rows + start + part
    else:
        begin[0], end[0] = half * rows, (half + 1) * rows
        begin[dim], end[dim] = start, start + part
    return Box(tuple(begin), tuple(end))


def _runs_of(slots: list[tuple[int, int]]) -> list[tuple[int, tuple[int, ...]]]:
    """(first global expert, local slots) of each run of consecutive experts this worker holds."""
    runs: list[tuple[int, list[int]]] = []
    for expert, slot in slots:
        if slot < 0:
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == expert:
            runs[-1][1].append(slot)
        else:
            runs.append((expert, [slot]))
    return [(first, tuple(s)) for first, s in runs]


def _checkpoint_param(module: torch.nn.Module, attr: str) -> torch.Tensor:
    """The parameter in checkpoint format, with its attributes: what vLLM recorded for its
    layerwise reload (before its CPU build repacked it), else the live one (a bias, which vLLM
    does not record and does not repack)."""
    recorded, _ = get_layerwise_info(module).restore_metadata
    return recorded.get(attr, module._parameters[attr])


def _box(module, attr: str, meta: torch.Tensor, shard, shape: tuple, name: str) -> Box:
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
    unfed = [name for name, _ in model.named_parameters()
             if name not in fed and not is_deferred_attention_layer(modules.get(name.rpartition(".")[0]))]
    if unfed:
        raise UnsupportedLayer(f"no tensor of the version feeds vLLM's parameter(s) {', '.join(unfed[:4])}"
                               f"{' and more' if len(unfed) > 4 else ''}: the model's names do not map onto this "
                               "vLLM model's as weightsync reads them; serve it with tensorParallel 1")
    for param, feeding in fed.items():
        module_name, _, attr = param.rpartition(".")
        meta = _checkpoint_param(modules[module_name], attr)
        if isinstance(modules[module_name], RoutedExperts):
            _check_experts(modules[module_name], param, meta, feeding)
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


def _check_experts(layer, param: str, meta: torch.Tensor, feeding: list[Part]) -> None:
    """Each local expert of a fused-experts parameter is fed once per shard (w13: gate and up, or
    up alone where the activation is not gated; w2: down), by a part of its shape."""
    shards = ("w2",) if param.rpartition(".")[2].startswith("w2") else \
        ("w1", "w3") if layer.moe_config.is_act_and_mul else ("w1",)
    experts, *row = meta.shape
    want = (row[0] // len(shards), *row[1:])
    got: dict[tuple[int, str], list[tuple]] = {}  # (slot, shard) -> the shape of each piece feeding it
    for p in feeding:
        piece = tuple(p.box.shape[1:] if len(p.box.shape) == len(meta.shape) else p.box.shape)
        for slot in p.shard.local:
            got.setdefault((slot, p.shard.shard_id), []).append((p.tensor, piece))
    wrong = [f"expert slot {e} {s}: {', '.join(f'{t} {list(piece)}' for t, piece in got.get((e, s), [])) or 'nothing'}"
             for e in range(experts) for s in shards
             if len(got.get((e, s), [])) != 1 or got[(e, s)][0][1] != want]
    if wrong or len(got) != experts * len(shards):
        raise UnsupportedLayer(f"vLLM's parameter {param} holds {experts} experts of {list(want)} per shard "
                               f"{'/'.join(shards)} on this worker, and the expert tensors read from vLLM's "
                               f"{type(layer).__name__} do not fill it ({'; '.join(wrong[:4]) or 'other shards'}); "
                               "serve this model with tensorParallel 1")


def cpu_packed(layer: torch.nn.Module) -> CPUUnquantizedExperts | None:
    """The grouped-GEMM kernel of vLLM's CPU build that serves a fused-experts layer, which packs
    the layer's w13_weight and w2_weight in place when the model first loads (None: another kernel)."""
    experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    return experts if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch else None


def check_experts(model: torch.nn.Module) -> None:
    """Refuse fused experts that a reload cannot bring back into the layout vLLM's CPU build serves
    them in: intermediate sizes it pads (it pads them once, when the model first loads)."""
    for layer in model.modules():
        experts = cpu_packed(layer) if isinstance(layer, RoutedExperts) else None
        if experts is not None and experts._padded_intermediate_size(layer.moe_config) != \
                layer.moe_config.intermediate_size_per_partition:
            raise UnsupportedLayer(f"vLLM's {type(experts).__name__} pads the experts of {layer.layer_name} to an "
                                   f"intermediate size of {experts._padded_intermediate_size(layer.moe_config)} per "
                                   "worker when the model loads, which its reload does not do again: serve a model whose "
                                   "intermediate size per worker is a multiple of 32")


def pack_experts(model: torch.nn.Module) -> None:
    """After a reload: vLLM's CPU build packs a mixture of experts' weights for its grouped GEMM
    when the model first loads, and its reload of a weight update copies the reloaded weights,
    unpacked, into the packed ones without packing them again (it packs only on the first load).
    Pack them as the first load does, with the kernel's own step."""
    for layer in model.modules():
        experts = cpu_packed(layer) if isinstance(layer, RoutedExperts) else None
        if experts is not None:
            experts.process_weights_after_loading(layer)


def split_experts(model: torch.nn.Module) -> list[str]:
    """The fused-experts layers whose experts are split by tensor-parallel rank."""
    return [m.layer_name for m in model.modules()
            if isinstance(m, RoutedExperts) and m.moe_config.moe_parallel_config.tp_size > 1]


def sharded_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers whose loaders narrow by tensor-parallel rank."""
    return [m for m in model.modules()
            if isinstance(m, (LinearBase, VocabParallelEmbedding)) and getattr(m, "tp_size", 1) > 1]


@contextlib.contextmanager
def presharded(model: torch.nn.Module):
    """For a reload set up by initialize_layerwise_reload: vLLM's loaders take the worker's part
    as given (see the module's docstring). Everything changed is put back on the way out."""
    undo = []
    for module in model.modules():
        if isinstance(module, RoutedExperts) and module.moe_config.moe_parallel_config.tp_size > 1:
            # a copy of the module's own: the config object is shared with the kernels and other layers
            config = module.moe_config
            module.moe_config = copy.copy(config)
            module.moe_config.moe_parallel_config = dataclasses.replace(config.moe_parallel_config, tp_size=1, tp_rank=0)
            undo.append(lambda m=module, c=config: setattr(m, "moe_config", c))
    for module in sharded_modules(model):
        if isinstance(module, VocabParallelEmbedding):
            indices, size = module.shard_indices, module.org_vocab_size
            rows = indices.org_vocab_end_index - indices.org_vocab_start_index
            module.shard_indices = dataclasses.replace(indices, org_vocab_start_index=0, org_vocab_end_index=rows)
            module.org_vocab_size = rows
            undo.append(lambda m=module, i=indices, s=size: (setattr(m, "shard_indices", i), setattr(m, "org_vocab_size", s)))
            continue
        undo.append(lambda m=module, r=module.tp_rank: setattr(m, "tp_rank", r))
        module.tp_rank = 0
        # the parameters the reload materializes carry the recorded ones' attributes: v2 loaders
        # narrow by the parameter's own tp_rank
        for param in list(module._parameters.values()):
            if param is not None and "tp_rank" in param.__dict__:
                undo.append(lambda p=param, r=param.tp_rank: setattr(p, "tp_rank", r))
                param.tp_rank = 0
    try:
        yield
    finally:
        for step in reversed(undo):
            step()
