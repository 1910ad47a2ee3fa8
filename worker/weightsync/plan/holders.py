"""What trainer ranks hold of a version, and the plan that has every rank send only that.

FSDP2's fully_shard cuts every parameter on dim 0 (or the dim its shard_placement_fn picks) into
`shard` chunks as torch.chunk does: ceil(n / shard) rows each, the last chunk shorter and ranks
past the end empty. HSDP keeps `replicas` copies of that sharding; ranks are numbered as a
(replicate, shard) device mesh numbers them, so rank = replica * shard + shard index. DDP is the
degenerate case of one shard and N replicas. Replicas hold the same bytes: the plan chooses
among them to balance the senders. sharded() says this as slices of the global tensors, for the
slice planner (pieces.py) and `weightsync plan --simulate`.

On dim 0, a rank holds a contiguous run of rows of every parameter, and in the flat layout a
tensor's rows are contiguous bytes, so the bytes a rank holds are one range per tensor. Each rank
publishes, with its join, the dim-0 row range it holds of every tensor (Holdings); the controller
checks that the ranks' ranges cover every row of every tensor and plans by holder: every range
held by one rank is sent by that rank, a range held by several (replicas of a shard, as in HSDP,
or a tensor FSDP left whole) is split into near-equal runs of rows among its holders. No rank ever
needs a row it does not hold: nothing is gathered.

A rank's runs are one per tensor, most of them far smaller than a bucket (norms, biases, and
every tensor cut in M): where the receivers can scatter a frame's bytes over several runs, one
bucket bundles a rank's runs of consecutive tensors, so that a sharded rank sends about as many
frames as a replica sending the same bytes. Where every rank holds everything (plain or DDP
replicas) the controller keeps segments.make_plan's contiguous segments.
Imports no torch (publisher/sources.py reads the holdings off a model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

from weightsync.model.flat import ALIGN, FlatLayout, TensorSlot
from weightsync.plan.boxes import GlobalTensor, Placement, Slicing, chunk_bound, dim_chunks
from weightsync.plan.segments import Bucket, Plan

ShardDim = Union[int, Callable[[GlobalTensor], int]]


def rows_of(slot: TensorSlot) -> int:
    """Rows along dim 0 (a 0-d tensor is one row)."""
    return slot.shape[0] if slot.shape else 1


def row_bytes(slot: TensorSlot) -> int:
    rows = rows_of(slot)
    return slot.nbytes // rows if rows else 0


@dataclass(frozen=True)
class Holdings:
    """The dim-0 rows [first, end) a rank holds of every tensor of the layout, in layout order."""

    rows: tuple[tuple[int, int], ...]

    @classmethod
    def whole(cls, layout: FlatLayout) -> "Holdings":
        return cls(tuple((0, rows_of(s)) for s in layout.slots))

    @classmethod
    def fsdp(cls, layout: FlatLayout, shard: int, index: int) -> "Holdings":
        """The rows the index-th of `shard` ranks holds under FSDP2's fully_shard (torch.chunk on dim 0)."""
        return cls(tuple(chunk_bound(rows_of(s), shard, index) for s in layout.slots))

    def is_whole(self, layout: FlatLayout) -> bool:
        return self == Holdings.whole(layout)

    def starts(self, layout: FlatLayout) -> list[int]:
        """The element of its tensor each of this rank's shards begins at (flat.check_sources)."""
        return [first * (s.numel // rows_of(s) if rows_of(s) else 0) for (first, _), s in zip(self.rows, layout.slots)]

    def to_json(self) -> list:
        return [list(r) for r in self.rows]

    @classmethod
    def from_json(cls, obj: Sequence) -> "Holdings":
        return cls(tuple((int(a), int(b)) for a, b in obj))

    def check(self, layout: FlatLayout, who: str) -> None:
        if len(self.rows) != len(layout.slots):
            raise ValueError(f"{who} says what it holds of {len(self.rows)} tensors; the version has {len(layout.slots)}")
        for (a, b), s in zip(self.rows, layout.slots):
            if not 0 <= a <= b <= rows_of(s):
                raise ValueError(f"{who} says it holds rows [{a}, {b}) of {s.name}, which has {rows_of(s)}")


def plan_by_holder(layout: FlatLayout, holdings: Mapping[int, Holdings], inferences: int, bucket_bytes: int,
                   bundle: bool = False) -> Plan:
    """The plan in which trainer rank t sends only rows it holds (holdings: {t: Holdings} for
    every trainer rank). With `bundle` (receivers that scatter a frame, Capabilities.scatters) a
    bucket bundles a rank's runs of consecutive tensors up to bucket_bytes; without, every run is
    a bucket of its own. ValueError naming the tensor where the ranks' rows do not cover every
    row exactly (two ranks holding different but overlapping rows, or rows nobody holds)."""
    trainers = len(holdings)
    if sorted(holdings) != list(range(trainers)) or inferences < 1:
        raise ValueError(f"a plan needs every trainer rank's holdings and an inference rank "
                         f"(got {sorted(holdings)}, {inferences})")
    if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise ValueError(f"bucket size must be a positive multiple of {ALIGN} bytes, got {bucket_bytes}")
    for t, h in holdings.items():
        h.check(layout, f"trainer rank {t}")
    pieces: list[tuple[int, int, int]] = []  # (offset, length, trainer)
    for i, slot in enumerate(layout.slots):
        held: dict[tuple[int, int], list[int]] = {}
        for t in range(trainers):
            a, b = holdings[t].rows[i]
            if a < b:
                held.setdefault((a, b), []).append(t)
        _check_cover(slot, sorted(held))
        size = row_bytes(slot)
        for (a, b), holders in sorted(held.items()):
            n = len(holders)
            turn = i % n  # which holder gets the first (larger) run: in turn, tensor by tensor
            for k in range(n):
                r0, r1 = a + k * (b - a) // n, a + (k + 1) * (b - a) // n
                if r0 < r1:
                    pieces.append((slot.offset + r0 * size, (r1 - r0) * size, holders[(k + turn) % n]))
    if not bundle:
        runs = [(t, ((start, min(bucket_bytes, offset + length - start)),))
                for offset, length, t in sorted(pieces) for start in range(offset, offset + length, bucket_bytes)]
    else:
        runs = [(t, parts) for t in range(trainers)
                for parts in _bundled([(o, n) for o, n, holder in sorted(pieces) if holder == t], bucket_bytes)]
        runs.sort(key=lambda run: run[1][0][0])
    buckets = [Bucket(i, t, parts[0][0], sum(n for _, n in parts), parts if len(parts) > 1 else ())
               for i, (t, parts) in enumerate(runs)]
    return Plan(layout, trainers, inferences, bucket_bytes, buckets)


def _bundled(pieces: list[tuple[int, int]], bucket_bytes: int) -> list[tuple[tuple[int, int], ...]]:
    """One rank's runs (offset, length), in order, packed into buckets of at most bucket_bytes:
    a run that does not fit what is left of a bucket is cut there; runs that touch join."""
    out: list[tuple[tuple[int, int], ...]] = []
    parts: list[tuple[int, int]] = []
    room = bucket_bytes
    for offset, length in pieces:
        while length:
            n = min(length, room)
            if parts and parts[-1][0] + parts[-1][1] == offset:
                parts[-1] = (parts[-1][0], parts[-1][1] + n)
            else:
                parts.append((offset, n))
            offset, length, room = offset + n, length - n, room - n
            if not room:
                out.append(tuple(parts))
                parts, room = [], bucket_bytes
    if parts:
        out.append(tuple(parts))
    return out


def _check_cover(slot: TensorSlot, ranges: list[tuple[int, int]]) -> None:
    at = 0
    for a, b in ranges:
        if a != at:
            what = f"rows [{at}, {a}) are held by no trainer rank" if a > at else \
                f"trainer ranks hold overlapping rows ([{a}, {b}) overlaps rows before {at})"
            raise ValueError(f"tensor {slot.name}: {what}; every row must be held whole by one rank or its replicas "
                             "(FSDP2 shards on dim 0, replicated or not)")
        at = b
    if slot.nbytes and at != rows_of(slot):
        raise ValueError(f"tensor {slot.name}: rows [{at}, {rows_of(slot)}) are held by no trainer rank")


# ---------------------------------------------------------------- the same, as slices of the global tensors


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
