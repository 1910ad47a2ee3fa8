"""What trainer ranks hold: FSDP2 shards, HSDP replicas of shards, DDP replicas.

FSDP2's fully_shard cuts every parameter on dim 0 (or the dim its shard_placement_fn picks) into
`shard` chunks as torch.chunk does: ceil(n / shard) rows each, the last chunk shorter and ranks
past the end empty. HSDP keeps `replicas` copies of that sharding; ranks are numbered as a
(replicate, shard) device mesh numbers them, so rank = replica * shard + shard index. DDP is the
degenerate case of one shard and N replicas. Replicas hold the same bytes: the plan chooses
among them to balance the senders.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

from weightsync.plan.slices import GlobalTensor, Placement, Slicing, dim_chunks

ShardDim = Union[int, Callable[[GlobalTensor], int]]


def sharded(tensors: Sequence[GlobalTensor], shard: int, replicas: int = 1, shard_dim: ShardDim = 0) -> Slicing:
    """`replicas` x `shard` trainer ranks: FSDP2 (replicas=1), HSDP, or DDP (shard=1).
    `shard_dim` is the dim every tensor is cut on, or a function of the tensor that returns it
    (FSDP2's shard_placement_fn); a 0-d tensor is held whole by the first shard."""
    if shard < 1 or replicas < 1:
        raise ValueError(f"trainer sharding needs shard >= 1 and replicas >= 1 (got shard={shard}, replicas={replicas})")
    cache: dict = {}
    placements = []
    for t in tensors:
        dim = shard_dim(t) if callable(shard_dim) else shard_dim
        if t.shape and not 0 <= dim < len(t.shape):
            raise ValueError(f"tensor {t.name} {list(t.shape)} cannot be sharded on dim {dim}")
        key = (t.shape, dim if t.shape else None)
        if key not in cache:
            chunks = dim_chunks(t.shape, dim, shard) if t.shape else [t.whole()] + [None] * (shard - 1)
            boxes, ranks = [], []
            for i, box in enumerate(chunks):
                if box is not None:
                    boxes.append(box)
                    ranks.append(tuple(g * shard + i for g in range(replicas)))
            cache[key] = Placement(tuple(boxes), tuple(ranks))
        placements.append(cache[key])
    return Slicing(tuple(tensors), tuple(placements), shard * replicas)


def dim1_where_dim0_is_uneven(shard: int) -> Callable[[GlobalTensor], int]:
    """A shard_placement_fn in the way torchtitan shards MoE experts: dim 0 unless it does not
    split evenly over `shard` ranks (384 experts over 256 ranks would leave 64 ranks empty and
    the rest with two experts each), then dim 1 where that one does."""
    def pick(t: GlobalTensor) -> int:
        if len(t.shape) >= 2 and t.shape[0] % shard and t.shape[1] % shard == 0:
            return 1
        return 0
    return pick
