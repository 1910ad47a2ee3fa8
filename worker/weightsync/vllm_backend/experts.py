"""What one vLLM worker holds of a mixture of experts' fused experts, read from vLLM's layer.

vLLM's RoutedExperts keeps every local expert's gate and up projections stacked in w13_weight and
its down projections in w2_weight. The layer's own expert mapping (vLLM's, as its loader reads a
checkpoint) names the parameter, the expert and the shard (w1, w2, w3) of each checkpoint expert
tensor; under tensor parallelism a worker holds every expert's share of the intermediate dimension
(the rows of gate_proj and up_proj, the columns of down_proj); under expert parallelism
(--enable-expert-parallel) it holds whole experts, the ones vLLM's expert placement gives it (its
expert map), and nothing of the others. Layouts this module does not know (transposed experts,
the load balancer's redundant experts) are refused at init, naming the layer. The scales of
quantized experts (w13_weight_scale, w2_weight_scale) are mapped by the same expert mapping as their
weights; which of their rows or blocks a worker takes follows its part of the weight (shards.py).

vLLM's CPU build packs fused experts for its grouped GEMM once, when the model first loads, and
its reload copies reloaded weights into the packed ones unpacked: pack_experts packs them again
after every load with the kernel's own step.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt8, CPUUnquantizedExperts
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from weightsync.plan.boxes import Box
from weightsync.vllm_backend.internals import (
    int8_small_gemm,
    local_expert,
    padded_intermediate_size,
    parameters_of,
    uses_zentorch,
)
from weightsync.vllm_backend.parts import Expert, Part, UnsupportedLayer, checkpoint_param

# the dim of a checkpoint expert weight that vLLM splits by tensor-parallel rank (the intermediate
# one): gate_proj and up_proj are [intermediate, hidden], down_proj [hidden, intermediate]
EXPERT_DIM = {"w1": 0, "w3": 0, "w2": 1}


def expert_layers(model: torch.nn.Module) -> dict:
    """{vLLM's layer name: (module path, layer)} of the model's fused-experts layers."""
    return {m.layer_name: (path, m) for path, m in model.named_modules() if isinstance(m, RoutedExperts)}


def expert_parts(experts: dict, model, name: str, shape: tuple) -> list[Part] | None:
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
    if attr not in parameters_of(layer):
        return [Part(name, None, None, None)]  # a bias the layer has none of: vLLM's loader skips it
    config = layer.moe_config
    if config.moe_parallel_config.enable_eplb or config.num_experts != config.num_logical_experts:
        raise UnsupportedLayer(f"{name}: vLLM's expert load balancer places redundant copies of experts ({path}); "
                               "weightsync reads a fixed placement: serve without --enable-eplb")
    meta = checkpoint_param(layer, attr)
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
    # one expert's name for what follows the stack's (gate_up_proj_scale: weight_scale, _bias: bias)
    tail = "bias" if bias else ("weight" + tail if tail.startswith("_") else tail.lstrip(".") or "weight")
    shards = [h[3] for h in hits if h[1] == weight_name]  # gate and up where both stack in one tensor
    names = {"w1": layer.ckpt_gate_proj_name, "w3": layer.ckpt_up_proj_name, "w2": layer.ckpt_down_proj_name}
    runs = _runs_of([(e, local_expert(layer, e)) for e in ids])
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


def check_fed_experts(layer, param: str, meta: torch.Tensor, feeding: list[Part]) -> None:
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
    return experts if isinstance(experts, CPUUnquantizedExperts) and not uses_zentorch(experts) else None


def int8_packed(module: torch.nn.Module, attr: str) -> bool:
    """Whether vLLM's CPU build packed this int8 parameter for its AMX kernels when it processed
    it (convert_weight_packed): fused experts' w13_weight and w2_weight under CPUExpertsInt8, and a
    linear layer's weight on the int8 kernel's small-GEMM path."""
    if isinstance(module, RoutedExperts):
        experts = getattr(getattr(module.quant_method, "moe_kernel", None), "fused_experts", None)
        return attr in ("w13_weight", "w2_weight") and isinstance(experts, CPUExpertsInt8)
    kernel = getattr(getattr(module, "scheme", None), "kernel", None)
    return attr == "weight" and kernel is not None and int8_small_gemm(kernel)


def check_experts(model: torch.nn.Module) -> None:
    """Refuse fused experts that a reload cannot bring back into the layout vLLM's CPU build serves
    them in: intermediate sizes it pads (it pads them once, when the model first loads)."""
    for layer in model.modules():
        experts = cpu_packed(layer) if isinstance(layer, RoutedExperts) else None
        if experts is not None and padded_intermediate_size(experts, layer.moe_config) != \
                layer.moe_config.intermediate_size_per_partition:
            raise UnsupportedLayer(f"vLLM's {type(experts).__name__} pads the experts of {layer.layer_name} to an "
                                   f"intermediate size of {padded_intermediate_size(experts, layer.moe_config)} per "
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
