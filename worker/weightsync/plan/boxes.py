"""Slices of global tensors: what each rank holds or needs, as boxes.

A trainer rank rarely holds whole tensors (FSDP2 shards dim 0; HSDP and DDP keep replicas of
shards) and a tensor-parallel inference rank needs only its columns or rows. Both sides are
described the same way: a global tensor (its Hugging Face name, shape and transfer dtype) and
boxes of it, one [start, stop) range per dimension. A box on dim 0 is one contiguous run of
bytes; a box on a later dim (a row-parallel slice, half of a packed gate/up) is strided in memory.

A Placement says, for one tensor, which boxes exist and which ranks hold (or need) each; ranks
that share a box are replicas of those bytes. Many tensors share one Placement (every layer's
q_proj under one sharding), which is what lets the plan work per shape class instead of per
tensor. Per-rank views (RankSlices) are derived from it, and the controller can rebuild the
placements from the per-rank lists the ranks publish.

No torch here: the planner and the simulation run on shapes alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from weightsync.model.flat import ITEMSIZE


@dataclass(frozen=True)
class GlobalTensor:
    name: str
    shape: tuple
    dtype: str

    def __post_init__(self):
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"tensor {self.name}: unsupported dtype {self.dtype!r}; use one of {', '.join(ITEMSIZE)}")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def whole(self) -> "Box":
        return Box((0,) * len(self.shape), tuple(self.shape))


@dataclass(frozen=True)
class Box:
    """Per dimension, the elements [start[d], stop[d])."""

    start: tuple
    stop: tuple

    @property
    def shape(self) -> tuple:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def numel(self) -> int:
        return math.prod(max(0, n) for n in self.shape)

    def intersect(self, other: "Box") -> "Box | None":
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        return Box(start, stop) if all(a < b for a, b in zip(start, stop)) else None

    def contiguous_in(self, shape: Sequence[int]) -> bool:
        """True when the box is one run of bytes of a row-major tensor of `shape`: after its first
        dimension wider than one element, every dimension is whole."""
        dims = [d for d, n in enumerate(self.shape) if n != 1]
        if not dims:
            return True
        return all(self.start[d] == 0 and self.stop[d] == shape[d] for d in range(dims[0] + 1, len(shape)))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.stop)) + "]"


@dataclass(frozen=True)
class Slice:
    tensor: str
    box: Box


@dataclass(frozen=True)
class RankSlices:
    """What one rank holds (a trainer) or needs (an inference rank)."""

    rank: int
    slices: tuple


@dataclass(frozen=True)
class Placement:
    """One tensor's boxes and, for each, the ranks holding (or needing) it. Empty boxes are left out."""

    boxes: tuple
    ranks: tuple

    def __post_init__(self):
        if len(self.boxes) != len(self.ranks):
            raise ValueError(f"{len(self.boxes)} boxes but {len(self.ranks)} rank lists")
        if any(not r for r in self.ranks):
            raise ValueError("every box of a placement needs at least one rank")


@dataclass(frozen=True)
class Slicing:
    """How `world` ranks hold (or need) a list of global tensors: one Placement per tensor."""

    tensors: tuple
    placements: tuple
    world: int

    def __post_init__(self):
        if len(self.tensors) != len(self.placements):
            raise ValueError(f"{len(self.placements)} placements for {len(self.tensors)} tensors")
        for t, p in zip(self.tensors, self.placements):
            for box, ranks in zip(p.boxes, p.ranks):
                if (len(box.start) != len(t.shape)
                        or any(a < 0 or b > n or a >= b for a, b, n in zip(box.start, box.stop, t.shape))):
                    raise ValueError(f"tensor {t.name} {list(t.shape)}: box {box} is empty or outside the tensor")
                bad = [r for r in ranks if not 0 <= r < self.world]
                if bad:
                    raise ValueError(f"tensor {t.name}: rank {bad[0]} is outside 0..{self.world - 1}")

    def of_rank(self, rank: int) -> RankSlices:
        """The slices `rank` holds or needs, in tensor order."""
        out = [Slice(t.name, box) for t, p in zip(self.tensors, self.placements)
               for box, ranks in zip(p.boxes, p.ranks) if rank in ranks]
        return RankSlices(rank, tuple(out))

    def bytes_of_rank(self) -> list[int]:
        out = [0] * self.world
        for t, p in zip(self.tensors, self.placements):
            for box, ranks in zip(p.boxes, p.ranks):
                for r in ranks:
                    out[r] += box.numel * t.itemsize
        return out

    @classmethod
    def from_ranks(cls, tensors: Sequence[GlobalTensor], per_rank: Iterable[RankSlices], world: int) -> "Slicing":
        """The placements behind the lists ranks publish (the controller's view): identical boxes
        of one tensor on several ranks become one box with those ranks as its replicas."""
        index = {t.name: i for i, t in enumerate(tensors)}
        boxes: list[dict] = [{} for _ in tensors]
        for rs in per_rank:
            for s in rs.slices:
                if s.tensor not in index:
                    raise ValueError(f"rank {rs.rank} lists tensor {s.tensor!r}, which the version does not have")
                boxes[index[s.tensor]].setdefault(s.box, []).append(rs.rank)
        placements, cache = [], {}
        for held in boxes:
            p = Placement(tuple(held), tuple(tuple(sorted(r)) for r in held.values()))
            placements.append(cache.setdefault(p, p))  # equal placements shared: the plan groups by them
        return cls(tuple(tensors), tuple(placements), world)


def chunk_bounds(size: int, chunks: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `chunks` pieces of `size` elements as torch.chunk cuts them, padded
    with empty pieces at the end (as FSDP2 and DTensor's Shard do): pieces of ceil(size / chunks)
    elements, the last shorter, and ranks past the end empty."""
    return [chunk_bound(size, chunks, i) for i in range(chunks)]


def chunk_bound(size: int, chunks: int, index: int) -> tuple[int, int]:
    """[start, stop) of the index-th of chunk_bounds(size, chunks), without cutting the others."""
    if chunks < 1:
        raise ValueError(f"cannot cut into {chunks} chunks")
    step = -(-size // chunks) if size else 0
    return min(size, index * step), min(size, (index + 1) * step)


def dim_chunks(shape: Sequence[int], dim: int, chunks: int) -> list[Box | None]:
    """Box of each chunk of a tensor cut on `dim` (None for an empty chunk)."""
    out = []
    for a, b in chunk_bounds(shape[dim], chunks):
        start, stop = [0] * len(shape), list(shape)
        start[dim], stop[dim] = a, b
        out.append(Box(tuple(start), tuple(stop)) if a < b and all(shape) else None)
    return out


def strided_chunks(shape: Sequence[int], dim: int, chunks: int, blocks: int) -> list[tuple]:
    """The boxes of each chunk when `dim` packs `blocks` equal blocks (gate and up side by side)
    and every block is cut into `chunks` as torch.chunk does: chunk i is one box per block (the
    layout of DTensor's _StridedShard that transformers' packed_colwise / packed_rowwise use)."""
    if shape[dim] % blocks:
        raise ValueError(f"dim {dim} of shape {list(shape)} does not hold {blocks} equal packed blocks")
    width = shape[dim] // blocks
    out = []
    for a, b in chunk_bounds(width, chunks):
        boxes = []
        for k in range(blocks):
            if a < b and all(shape):
                start, stop = [0] * len(shape), list(shape)
                start[dim], stop[dim] = k * width + a, k * width + b
                boxes.append(Box(tuple(start), tuple(stop)))
        out.append(tuple(boxes))
    return out


def join(*parts: Slicing) -> Slicing:
    """Several groups of ranks side by side (a TP2 replica and a TP1 replica): the ranks of each
    part follow those of the parts before it."""
    if not parts:
        raise ValueError("join needs at least one part")
    tensors = parts[0].tensors
    for p in parts[1:]:
        if p.tensors != tensors:
            raise ValueError("joined groups of ranks must list the same tensors")
    placements, cache = [], {}
    for i in range(len(tensors)):
        by_box: dict = {}
        base = 0
        for p in parts:
            pl = p.placements[i]
            for box, ranks in zip(pl.boxes, pl.ranks):
                by_box.setdefault(box, []).extend(base + r for r in ranks)
            base += p.world
        pl = Placement(tuple(by_box), tuple(tuple(sorted(r)) for r in by_box.values()))
        placements.append(cache.setdefault(pl, pl))
    return Slicing(tensors, tuple(placements), sum(p.world for p in parts))
