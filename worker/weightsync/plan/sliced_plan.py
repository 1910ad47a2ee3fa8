"""The transfer plan over slices: where every assigned piece lands and what it is cut from.

When inference ranks hold tensor-parallel slices, a version is no longer one run of bytes that
every receiver gets whole. Each inference rank has its own local layout: the boxes it needs (of
the global tensors), each contiguous in its box's shape and in its tensor's own dtype (a quantized
version's weights and scales have theirs), in tensor order and then box order, at offsets aligned
as flat.FlatLayout aligns them. Its staging buffer is that size, and its typed
views are its local shards. A receiver that needs every tensor whole has exactly the flat layout.

The piece assignment (pieces.assign_pieces) says which trainer rank sends which box to which
receiver. Here each piece becomes runs of bytes in the receiver's local layout: a piece cut from
dim-0 holder boxes is one run in the receiver's box (rows of a column-parallel box, or rows of a
row-parallel box, which are whole rows of that box); a piece that is not contiguous there is cut
into rows until each part is. A sender then packs consecutive runs for one receiver into buckets
of at most bucket_bytes (runs separated only by the local layout's padding join one bucket, the
padding sent as zeros), which travel as the flat path's buckets do: offset and bytes into the
receiver's registered staging buffer, each with its checksum. SlicedPlan is an
interface.TransferPlan, as segments.Plan is: the send pipeline and the receiver take either.

The plan is a pure function of its inputs (the global layout, the rows every trainer rank holds,
the boxes every inference rank needs, the bucket size; to_json). The controller computes the whole
assignment from them, to check it and to print it, and publishes each rank's share of it
(shares.py): a rank derives its buckets, or what it receives and its local layout, from its own
share alone (rank_plan.RankPlan), exactly as this whole plan has them. No torch here.
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Sequence

from weightsync.model.flat import ALIGN, ITEMSIZE, FlatLayout
from weightsync.plan.boxes import Box, GlobalTensor, RankSlices, Slice, Slicing
from weightsync.plan.holders import Holdings, rows_of
from weightsync.plan.interface import TransferPlan
from weightsync.plan.pieces import PieceAssignment, assign_pieces
from weightsync.plan.segments import Plan, size_text


def global_tensors(layout: FlatLayout) -> tuple[GlobalTensor, ...]:
    """The version's tensors as the piece assignment names them (the layout's transfer dtype)."""
    return tuple(GlobalTensor(s.name, s.shape, s.dtype) for s in layout.slots)


def rows_box(shape: Sequence[int], first: int, end: int) -> Box:
    """The box of dim-0 rows [first, end) of a tensor of `shape` (a 0-d tensor: the whole of it)."""
    if not shape:
        return Box((), ())
    return Box((first,) + (0,) * (len(shape) - 1), (end,) + tuple(shape[1:]))


def holder_slicing(layout: FlatLayout, holdings: Mapping[int, Holdings]) -> Slicing:
    """What the trainer ranks hold ({trainer rank: its dim-0 rows}) as slices of the global tensors."""
    per_rank = [RankSlices(t, tuple(Slice(s.name, rows_box(s.shape, a, b)) for (a, b), s in zip(h.rows, layout.slots) if a < b))
                for t, h in sorted(holdings.items())]
    return Slicing.from_ranks(global_tensors(layout), per_rank, len(holdings))


@dataclass(frozen=True)
class LocalSlot:
    tensor: int  # index into the version's tensors
    name: str
    box: Box  # of the global tensor
    offset: int
    nbytes: int
    dtype: str  # the tensor's (flat.TensorSlot.dtype)

    @property
    def shape(self) -> tuple:
        return self.box.shape


@dataclass(frozen=True)
class LocalLayout:
    """One inference rank's staging buffer: its boxes, each contiguous in its box's shape."""

    slots: tuple
    total_bytes: int
    dtype: str

    @classmethod
    def of(cls, layout: FlatLayout, needs: RankSlices, align: int = ALIGN) -> "LocalLayout":
        index = {s.name: i for i, s in enumerate(layout.slots)}
        order = []
        for s in needs.slices:
            if s.tensor not in index:
                raise ValueError(f"inference rank {needs.rank} needs tensor {s.tensor!r}, which the version does not have")
            order.append((index[s.tensor], s.box.start, s))
        order.sort(key=lambda x: x[:2])
        slots, offset = [], 0
        for i, _, s in order:
            dtype = layout.slots[i].dtype
            nbytes = s.box.numel * ITEMSIZE[dtype]
            slots.append(LocalSlot(i, s.tensor, s.box, offset, nbytes, dtype))
            offset = -(-(offset + nbytes) // align) * align
        return cls(tuple(slots), offset, layout.dtype)

    @cached_property
    def _by_tensor(self) -> dict[int, list[LocalSlot]]:
        out: dict[int, list[LocalSlot]] = {}
        for s in self.slots:
            out.setdefault(s.tensor, []).append(s)
        return out

    def slots_of(self, tensor: int) -> list[LocalSlot]:
        return self._by_tensor.get(tensor, [])

    def runs(self, tensor: int, box: Box) -> list[tuple[int, Box]]:
        """(byte offset, sub-box) of each contiguous run of `box` in this rank's buffer, in order.
        `box` must lie inside one box this rank needs."""
        for s in self.slots_of(tensor):
            if s.box.intersect(box) == box:
                return _runs(s, box, ITEMSIZE[s.dtype])
        raise ValueError(f"tensor #{tensor}: box {box} is not inside any box this rank needs")

    @cached_property
    def _ends(self) -> list[int]:
        return [s.offset + s.nbytes for s in self.slots]

    def is_padding(self, start: int, end: int) -> bool:
        """True when no slot has bytes in [start, end) (alignment padding only)."""
        i = bisect.bisect_right(self._ends, start)  # the first slot ending after start (slots are in offset order)
        return i == len(self.slots) or self.slots[i].offset >= end


def _runs(slot: LocalSlot, box: Box, item: int) -> list[tuple[int, Box]]:
    rel_start = tuple(a - b for a, b in zip(box.start, slot.box.start))
    rel = Box(rel_start, tuple(a + n for a, n in zip(rel_start, box.shape)))
    if rel.contiguous_in(slot.shape):
        index = 0
        for a, n in zip(rel_start, slot.shape):
            index = index * n + a
        return [(slot.offset + index * item, box)]
    dim = next(d for d, n in enumerate(box.shape) if n != 1)  # cut into single rows of its first wide dim
    out = []
    for k in range(box.start[dim], box.stop[dim]):
        start, stop = list(box.start), list(box.stop)
        start[dim], stop[dim] = k, k + 1
        out.extend(_runs(slot, Box(tuple(start), tuple(stop)), item))
    return out


@dataclass(frozen=True)
class Part:
    """A run of one bucket: the elements `box` of tensor #tensor, at byte `at` of the bucket."""

    tensor: int
    box: Box
    at: int
    nbytes: int


@dataclass(frozen=True)
class SliceBucket:
    """Bytes [offset, offset + length) of one receiver's buffer, sent by one trainer rank; the
    bytes between its parts are padding (zero)."""

    trainer: int
    receiver: int
    offset: int
    length: int
    parts: tuple

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class SlicedPlan:
    """The transfer plan of a version whose receivers need slices (interface.TransferPlan): its
    inputs, and what derives from them."""

    layout: FlatLayout
    holdings: tuple  # per trainer rank: Holdings (dim-0 rows of every tensor)
    needs: tuple  # per inference rank: RankSlices
    bucket_bytes: int
    sliced = True

    def __post_init__(self):
        if self.bucket_bytes < ALIGN or self.bucket_bytes % ALIGN:
            raise ValueError(f"bucket size must be a positive multiple of {ALIGN} bytes, got {self.bucket_bytes}")
        for t, h in enumerate(self.holdings):
            h.check(self.layout, f"trainer rank {t}")
        for r, n in enumerate(self.needs):
            if n.rank != r:
                raise ValueError(f"the needs of inference rank {n.rank} are listed as rank {r}'s")

    @property
    def trainers(self) -> int:
        return len(self.holdings)

    @property
    def inferences(self) -> int:
        return len(self.needs)

    @cached_property
    def assignment(self) -> PieceAssignment:
        """Which trainer rank sends which box to which inference rank."""
        holders = holder_slicing(self.layout, dict(enumerate(self.holdings)))
        needs = Slicing.from_ranks(global_tensors(self.layout), self.needs, self.inferences)
        return assign_pieces(holders, needs, self.bucket_bytes)

    @cached_property
    def local(self) -> tuple:
        """The local layout of every inference rank."""
        return tuple(LocalLayout.of(self.layout, n) for n in self.needs)

    def local_of(self, rank: int) -> LocalLayout:
        return self.local[rank]

    def buckets_of(self, trainer: int) -> list[SliceBucket]:
        """What `trainer` sends, in sending order: receiver by receiver in the assignment's order,
        each receiver's buckets by offset."""
        return self._buckets[trainer]

    @cached_property
    def _buckets(self) -> list[list[SliceBucket]]:
        index = {s.name: i for i, s in enumerate(self.layout.slots)}
        items = [ITEMSIZE[s.dtype] for s in self.layout.slots]
        out = []
        for trainer in range(self.trainers):
            runs: dict[int, list] = {}  # receiver -> [(offset, tensor, box)], receivers in sending order
            for p in self.assignment.pieces_of(trainer):
                t = index[p.tensor]
                runs.setdefault(p.receiver, []).extend((o, t, b) for o, b in self.local[p.receiver].runs(t, p.box))
            streams = [self._pack(trainer, receiver, sorted(rs, key=lambda x: x[0]), items) for receiver, rs in runs.items()]
            # in turn, one bucket per receiver: consecutive buckets go to different receivers, so
            # that every connection stays busy while the next bucket is packed
            out.append([b for turn in itertools.zip_longest(*streams) for b in turn if b is not None])
        return out

    def _pack(self, trainer: int, receiver: int, runs: list, items: list[int]) -> list[SliceBucket]:
        local, limit = self.local[receiver], self.bucket_bytes
        out: list[SliceBucket] = []
        start, end, parts = None, None, []
        for offset, t, box in runs:
            n = box.numel * items[t]
            joins = (start is not None and offset >= end and offset + n - start <= limit
                     and (offset == end or local.is_padding(end, offset)))
            if not joins:
                if start is not None:
                    out.append(SliceBucket(trainer, receiver, start, end - start, tuple(parts)))
                start, parts = offset, []
            parts.append(Part(t, box, offset - start, n))
            end = offset + n
        if start is not None:
            out.append(SliceBucket(trainer, receiver, start, end - start, tuple(parts)))
        return out

    def expected_for(self, rank: int) -> dict[int, list[tuple[int, int]]]:
        """What inference rank `rank` receives, by trainer rank (trainers sending it nothing left out)."""
        out: dict[int, list[tuple[int, int]]] = {}
        for t in range(self.trainers):
            ranges = [(b.offset, b.length) for b in self._buckets[t] if b.receiver == rank]
            if ranges:
                out[t] = ranges
        return out

    def scatter_for(self, rank: int) -> dict:
        """Every bucket lands in one run of the receiver's local layout: none is scattered."""
        return {}

    def bytes_for(self, rank: int) -> int:
        """The size of inference rank `rank`'s staging buffer."""
        return self.local[rank].total_bytes

    def bytes_by_receiver(self) -> list[int]:
        return [layout.total_bytes for layout in self.local]

    @property
    def version_bytes(self) -> int:
        """The whole version in the transfer dtype (what one TP1 replica receives)."""
        return self.layout.total_bytes

    def sent_bytes(self, trainer: int) -> int:
        return sum(b.length for b in self._buckets[trainer])

    def to_json(self) -> str:
        return json.dumps({"kind": "slices", "layout": json.loads(self.layout.to_json()),
                           "holdings": [h.to_json() for h in self.holdings],
                           "needs": [needs_to_json(n) for n in self.needs], "bucket_bytes": self.bucket_bytes})

    @classmethod
    def from_json(cls, text: str) -> "SlicedPlan":
        obj = json.loads(text)
        return cls(FlatLayout.from_json(json.dumps(obj["layout"])), tuple(Holdings.from_json(h) for h in obj["holdings"]),
                   tuple(needs_from_json(r, n) for r, n in enumerate(obj["needs"])), obj["bucket_bytes"])

    def table(self) -> str:
        return (f"version: {len(self.layout.slots)} tensors, {size_text(self.version_bytes)} as {self.layout.dtype}; "
                f"receivers need slices\n{self.assignment.table()}")


def needs_to_json(needs: RankSlices) -> list:
    return [[s.tensor, list(s.box.start), list(s.box.stop)] for s in needs.slices]


def needs_from_json(rank: int, obj: Sequence) -> RankSlices:
    return RankSlices(rank, tuple(Slice(name, Box(tuple(int(x) for x in a), tuple(int(x) for x in b))) for name, a, b in obj))


def needs_everything(layout: FlatLayout, rank: int) -> RankSlices:
    """A receiver of TP degree 1: every tensor whole (its local layout is the flat layout)."""
    return RankSlices(rank, tuple(Slice(s.name, rows_box(s.shape, 0, rows_of(s))) for s in layout.slots))


def plan_from_json(text: str) -> TransferPlan:
    """The published plan: a segments.Plan, or a SlicedPlan when receivers need slices."""
    return SlicedPlan.from_json(text) if json.loads(text).get("kind") == "slices" else Plan.from_json(text)
