"""What tensor-parallel inference ranks need, from the model's transformers TP plan.

transformers (5.x) gives every model a TP plan (the config's base_model_tp_plan plus the LM
head's, as model._tp_plan): parameter or module name patterns ("model.layers.*.mlp.up_proj")
mapped to style names. How each style shards a parameter, as transformers' own styles do it
(transformers.distributed.tensor_parallel; DTensor Shard is torch.chunk, the last rank shorter):

- colwise, colwise_rep, colwise_gather_output: dim ndim-2 (the output dim: dim 0 of a Linear
  weight, dim 1 of a 3-d expert stack); a 1-d bias on its only dim.
- rowwise, rowwise_rep, rowwise_split_input: the last dim (the input dim) - strided in memory;
  a bias is needed whole (it is added after the reduction).
- packed_colwise / packed_rowwise: as colwise / rowwise, but that dim packs two equal blocks
  (gate and up side by side) and every rank takes its chunk of each: two boxes per rank.
- embedding_rowwise / embedding_colwise: dim 0 (vocabulary) / dim 1.
- styles that shard no parameter (moe_tp_experts, replicate, sequence_parallel, all_reduce,
  mla_kv_a_proj, replicated_with_grad_allreduce, moe_identity_expert, local_params), and
  parameters the plan does not name: needed whole by every rank of the replica.

Any other style name is refused with the list above: guessing would send a rank bytes it does not
hold. Ranks are numbered replica * tp + tp rank; a replica of TP degree 1 needs everything.

With expert parallelism of degree ep (vLLM's --enable-expert-parallel) a replica is ep ranks: the
routed experts are placed as vLLM places them by default (linearly: rank i holds experts
[i * E/ep, (i + 1) * E/ep) whole, from a stack of every expert or from one expert's tensors), and
the rest of the model is sharded by the TP plan over groups of tp ranks (ep / tp of them: data-
parallel attention where tp < ep).

A quantized version's scales (model/quant.py) follow their weights: a rank needs the scales of the
box it needs of the weight (its rows' per-row int8 scales; the 128x128 blocks its fp8 box covers),
whatever the plan says of the scale's own name. An fp8 box that cuts a block is refused, naming
the weight.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from weightsync.model.quant import Format
from weightsync.plan.boxes import Box, GlobalTensor, Placement, Slicing, dim_chunks, strided_chunks

COLWISE = {"colwise", "colwise_rep", "colwise_gather_output"}
ROWWISE = {"rowwise", "rowwise_rep", "rowwise_split_input"}
PACKED = {"packed_colwise", "packed_rowwise"}
EMBEDDING = {"embedding_rowwise": 0, "embedding_colwise": 1}
WHOLE = {"moe_tp_experts", "replicate", "sequence_parallel", "all_reduce", "mla_kv_a_proj",
         "replicated_with_grad_allreduce", "moe_identity_expert", "local_params"}
KNOWN = COLWISE | ROWWISE | PACKED | set(EMBEDDING) | WHOLE

# Projections whose output dim is heads x head_dim: sharding them splits heads between ranks.
HEAD_PROJECTIONS = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads", "v_proj": "num_key_value_heads"}


def style_of(name: str, plan: Mapping[str, str]) -> str | None:
    """The plan's style for a parameter, matched as transformers matches it: layer numbers
    become '*', the parameter's own name first, then its module's."""
    generic = re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)
    if generic in plan:
        return plan[generic]
    module = generic.rsplit(".", 1)[0] if "." in generic else None
    return plan.get(module) if module is not None else None


def tp_boxes(t: GlobalTensor, style: str | None, tp: int) -> list[tuple]:
    """The boxes tp rank i needs of tensor t, for every i (a tuple of boxes per rank; () for none)."""
    if style is not None and style not in KNOWN:
        raise ValueError(f"tensor {t.name}: unknown tensor-parallel style {style!r} in the model's TP plan; "
                         f"weightsync knows {', '.join(sorted(KNOWN))}")
    nd = len(t.shape)
    is_bias = t.name.rsplit(".", 1)[-1] == "bias"
    if tp == 1 or style is None or style in WHOLE or nd == 0:
        return [(t.whole(),)] * tp
    if style in COLWISE:
        return _single(dim_chunks(t.shape, max(0, nd - 2), tp))
    if style in ROWWISE:
        return [(t.whole(),)] * tp if is_bias else _single(dim_chunks(t.shape, nd - 1, tp))
    if style == "packed_colwise":
        return _single(dim_chunks(t.shape, 0, tp)) if nd == 1 else strided_chunks(t.shape, nd - 2, tp, 2)
    if style == "packed_rowwise":
        return [(t.whole(),)] * tp if nd == 1 else strided_chunks(t.shape, nd - 1, tp, 2)
    dim = EMBEDDING[style]
    if dim >= nd:
        raise ValueError(f"tensor {t.name} {list(t.shape)}: style {style} shards dim {dim}, which it does not have")
    return _single(dim_chunks(t.shape, dim, tp))


# a routed expert's tensors: a stack of every expert (transformers 5), or one expert's (experts.<e>.)
STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj)(_bias|_scale_inv|_scale)?$")
ONE_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def tp_needs(tensors: Sequence[GlobalTensor], plan: Mapping[str, str], tp: int, replicas: int = 1,
             ep: int = 0, experts: int = 0, fmt: Format | None = None) -> Slicing:
    """`replicas` inference replicas of TP degree `tp`: what each of the replicas * tp ranks needs;
    with `ep`, replicas of ep ranks whose `experts` routed experts are split by expert; with `fmt`,
    the tensors of a version quantized so (each weight's scales follow its boxes)."""
    if tp < 1 or replicas < 1:
        raise ValueError(f"inference needs tp >= 1 and replicas >= 1 (got tp={tp}, replicas={replicas})")
    size = max(tp, ep)
    if ep and (ep % tp or not experts or experts % ep):
        raise ValueError(f"expert parallelism of degree {ep}: it must be a multiple of the TP degree {tp} and divide "
                         f"the model's {experts} routed experts")
    cache: dict = {}  # key -> (placement, boxes per rank): tensors alike share one placement
    placements = []
    by_name = {t.name: t for t in tensors}
    quantized: dict[str, tuple] = {}  # a quantized weight -> (its placement, its boxes per rank): its scales follow
    for t in tensors:
        stacked, one = STACKED_EXPERTS.search(t.name), ONE_EXPERT.search(t.name)
        weight = fmt.weight_of(t.name) if fmt is not None else None
        if weight in quantized:
            held, of_weight = quantized[weight]
            key = ("scales", t.shape, id(held))
            chunks = None if key in cache else \
                [tuple(scale_box(fmt, by_name[weight], box, f"tensor-parallel rank {i} of {size}") for box in of_weight[i])
                 for i in range(size)]
        elif ep and (stacked or one):
            per = experts // ep
            if stacked:  # rank i: its experts of the stack, whole
                chunks = [(box,) for box in dim_chunks(t.shape, 0, ep)]
            else:  # the rank that holds this expert, all of it
                chunks = [(t.whole(),) if i == int(one.group(1)) // per else () for i in range(ep)]
            key = None
        else:
            style = style_of(t.name, plan) if tp > 1 else None
            key = (t.shape, style, t.name.rsplit(".", 1)[-1] == "bias")
            chunks = None if key in cache else tp_boxes(t, style, tp)
        if chunks is None:
            placement, chunks = cache[key]
        else:
            chunks = [chunks[i % len(chunks)] for i in range(size)]
            boxes, ranks = [], []
            for i in range(size):
                for box in chunks[i]:
                    if box is not None:
                        boxes.append(box)
                        ranks.append(tuple(g * size + i for g in range(replicas)))
            placement = _merged(boxes, ranks)
            if key is not None:
                cache[key] = placement, chunks
        if fmt is not None and fmt.scale_name(t.name) in by_name:
            quantized[t.name] = placement, chunks
        placements.append(placement)
    return Slicing(tuple(tensors), tuple(placements), size * replicas)


def scale_box(fmt: Format, weight: GlobalTensor, box: Box, holder: str) -> Box:
    """The box of `weight`'s scales that quantize `box` of it (model/quant.py: a scale follows its
    weight), refused on one line where an fp8 box cuts a block."""
    start, stop = fmt.scale_bounds(weight.name, weight.shape, box.start, box.stop, holder,
                                   f"choose a tensor-parallel size that leaves every worker whole {fmt.block}x{fmt.block} "
                                   "blocks of every weight (or quantize int8)")
    return Box(start, stop)


def check_heads(config, plan: Mapping[str, str], tp: int) -> None:
    """Refuse a TP degree that would split attention heads between ranks, where the plan shards
    the projections that hold them."""
    if tp == 1:
        return
    styled = {key.rsplit(".", 1)[-1] for key, style in plan.items() if style in COLWISE | PACKED}
    for proj, attr in HEAD_PROJECTIONS.items():
        heads = getattr(config, attr, None)
        if proj in styled and heads and heads % tp:
            fits = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(f"TP degree {tp} does not divide the model's {attr}={heads}: every TP rank must hold "
                             f"whole heads; use a TP degree of {', '.join(map(str, fits))}")


def _single(chunks: list) -> list[tuple]:
    return [(box,) if box is not None else () for box in chunks]


def _merged(boxes: list, ranks: list) -> Placement:
    """One entry per distinct box (a replicated tensor is one box needed by every rank)."""
    by_box: dict = {}
    for box, r in zip(boxes, ranks):
        by_box.setdefault(box, []).extend(r)
    return Placement(tuple(by_box), tuple(tuple(sorted(r)) for r in by_box.values()))
