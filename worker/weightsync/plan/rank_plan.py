"""One rank's plan over slices, from the header and its own share (shares.py): what a trainer
rank sends, or what an inference rank receives and its local layout. An interface.TransferPlan
for that one rank: asked about another rank's buckets it says so (ValueError).

A rank's runs become buckets here, with the same rule SlicedPlan applies to the whole plan: a
trainer's runs for one receiver in the order of their offsets, and consecutive runs share a bucket
of at most bucket_bytes where only the receiver's alignment padding lies between them (the slot a
run lands in ends where the next one's padding begins). The buckets are kept as arrays, and made
into SliceBuckets as they are read. No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from weightsync.model.flat import ALIGN, ITEMSIZE, FlatLayout
from weightsync.plan.boxes import Box, RankSlices
from weightsync.plan.holders import Holdings
from weightsync.plan.segments import size_text
from weightsync.plan.shares import BOX, KIND, NBYTES, OFFSET, PEER, SLOT_END, TENSOR, decode
from weightsync.plan.sliced_plan import LocalLayout, Part, SliceBucket, needs_from_json


def is_shares(text: str) -> bool:
    """Whether the published plan `text` is the header of a plan published in shares (shares.header
    writes its kind first)."""
    return text.startswith(json.dumps({"kind": KIND})[:-1])


def pack(offset: np.ndarray, nbytes: np.ndarray, slot_end: np.ndarray, limit: int, align: int = ALIGN) -> np.ndarray:
    """The index of the first run of each bucket, for runs of one (trainer, receiver) stream in
    the order of their offsets: a run joins the bucket before it where it begins where that bucket
    ends, or after nothing but padding (the previous run ends its slot, and this one begins at the
    next slot), and the bucket stays within `limit` bytes."""
    n = len(offset)
    if not n:
        return np.zeros(0, dtype=np.int64)
    end = offset + nbytes
    follows = np.zeros(n, dtype=bool)
    follows[1:] = (offset[1:] >= end[:-1]) & ((offset[1:] == end[:-1]) | (
        (end[:-1] == slot_end[:-1]) & (offset[1:] <= -(-slot_end[:-1] // align) * align)))
    firsts = np.flatnonzero(~follows)
    if not follows.any():
        return firsts
    out = []
    chain_ends = np.append(firsts[1:], n)
    for a, b in zip(firsts.tolist(), chain_ends.tolist()):
        out.append(a)
        if b - a == 1:
            continue
        start = int(offset[a])
        for i in range(a + 1, b):
            if int(end[i]) - start > limit:
                out.append(i)
                start = int(offset[i])
    return np.asarray(out, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Streams:
    """Buckets of runs, as arrays: bucket b is runs first[b] .. first[b + 1] - 1."""

    runs: np.ndarray  # a trainer's share's rows (shares.py), in bucket order
    nbytes: np.ndarray  # of each run
    first: np.ndarray  # per bucket, and the end
    nd: int

    def __len__(self) -> int:
        return len(self.first) - 1

    def offsets(self) -> np.ndarray:
        return self.runs[self.first[:-1], OFFSET]

    def lengths(self) -> np.ndarray:
        last = self.first[1:] - 1
        return self.runs[last, OFFSET] + self.nbytes[last] - self.offsets()


def run_bytes(runs: np.ndarray, items: np.ndarray, nd: int) -> np.ndarray:
    return np.prod(runs[:, BOX + nd:] - runs[:, BOX:BOX + nd], axis=1) * items[runs[:, TENSOR]]


def packed(peers: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, slot_end: np.ndarray, peer_order: Sequence[int],
           limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rank's runs packed stream by stream (`peers`: the other side of each run's stream, the
    streams in `peer_order`), each stream's runs in the order of their offsets: the runs' order,
    the first (sorted) run of each bucket, and each bucket's stream."""
    table = np.full(max(peer_order, default=0) + 1, len(peer_order), dtype=np.int64)
    table[list(peer_order)] = np.arange(len(peer_order))
    place = table[peers]
    order = np.lexsort((offset, place))
    offset, nbytes, slot_end, place = offset[order], nbytes[order], slot_end[order], place[order]
    bounds = np.searchsorted(place, np.arange(len(peer_order) + 1)).tolist()
    firsts = [pack(offset[a:b], nbytes[a:b], slot_end[a:b], limit) + a for a, b in zip(bounds[:-1], bounds[1:])]
    first = np.concatenate(firsts) if firsts else np.zeros(0, np.int64)
    stream = np.repeat(np.arange(len(firsts)), [len(f) for f in firsts])
    return order, first, stream


def sender_streams(runs: np.ndarray, peer_order: Sequence[int], items: np.ndarray, limit: int,
                   nd: int) -> tuple[Streams, np.ndarray]:
    """A trainer's buckets, in turns of one bucket per receiver (receivers in `peer_order`), and
    each bucket's receiver."""
    nbytes = run_bytes(runs, items, nd)
    order, first, stream = packed(runs[:, PEER], runs[:, OFFSET], nbytes, runs[:, SLOT_END], peer_order, limit)
    count = np.diff(np.append(first, len(runs)))
    per_stream = np.bincount(stream, minlength=len(peer_order))
    turn = np.arange(len(first)) - np.repeat(np.cumsum(per_stream) - per_stream, per_stream)
    by = np.lexsort((stream, turn))
    first, count = first[by], count[by]
    starts = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
    take = order[np.arange(starts[-1]) - np.repeat(starts[:-1], count) + np.repeat(first, count)]
    runs, nbytes = runs[take], nbytes[take]
    return Streams(runs, nbytes, starts, nd), runs[starts[:-1], PEER] if len(runs) else np.zeros(0, np.int64)


def receiver_ranges(runs: np.ndarray, limit: int) -> dict[int, list[tuple[int, int]]]:
    """An inference rank's buckets from its share's rows: {trainer rank: [(offset, length)]},
    trainers in order, each one's buckets in the order of their offsets."""
    senders = np.unique(runs[:, PEER]).tolist()
    order, first, stream = packed(runs[:, PEER], runs[:, OFFSET], runs[:, NBYTES], runs[:, SLOT_END], senders, limit)
    offset, nbytes = runs[order, OFFSET], runs[order, NBYTES]
    last = np.append(first[1:], len(order)) - 1
    starts, lengths = offset[first].tolist(), (offset[last] + nbytes[last] - offset[first]).tolist()
    same: dict[int, int] = {}
    lengths = [same.setdefault(n, n) for n in lengths]  # a few sizes, each one object: a few MB less
    bounds = np.searchsorted(stream, np.arange(len(senders) + 1)).tolist()
    return {t: list(zip(starts[a:b], lengths[a:b])) for t, a, b in zip(senders, bounds[:-1], bounds[1:])}


class ShareBuckets(Sequence):
    """A trainer rank's buckets (SliceBucket), kept as arrays and made as they are read: a rank
    that sends a few hundred thousand small buckets holds them in a few MB."""

    def __init__(self, trainer: int, made: Streams, receivers: np.ndarray, dims: Sequence[int]):
        self.trainer, self.made, self.receivers, self.dims = trainer, made, receivers, dims
        self.offsets, self.lengths = made.offsets(), made.lengths()

    def __len__(self) -> int:
        return len(self.made)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return next(self._made(i, i + 1))

    def __iter__(self):
        for a in range(0, len(self), CHUNK):
            yield from self._made(a, min(len(self), a + CHUNK))

    def _made(self, a: int, b: int):
        m, nd, dims = self.made, self.made.nd, self.dims
        first = m.first[a:b + 1].tolist()
        lo = first[0]
        runs, nbytes = m.runs[lo:first[-1]].tolist(), m.nbytes[lo:first[-1]].tolist()
        for k, (receiver, start, length) in enumerate(zip(self.receivers[a:b].tolist(), self.offsets[a:b].tolist(),
                                                          self.lengths[a:b].tolist())):
            parts = []
            for j in range(first[k] - lo, first[k + 1] - lo):
                row = runs[j]
                t = row[TENSOR]
                n = dims[t]
                parts.append(Part(t, Box(tuple(row[BOX:BOX + n]), tuple(row[BOX + nd:BOX + nd + n])),
                                  row[OFFSET] - start, nbytes[j]))
            yield SliceBucket(self.trainer, receiver, start, length, tuple(parts))


CHUNK = 4096  # buckets made at a time while they are walked


@dataclass(frozen=True, eq=False)
class RankPlan:
    """The plan over slices as one rank has it (interface.TransferPlan): `role` rank `rank`'s share."""

    layout: FlatLayout
    trainers: int
    inferences: int
    bucket_bytes: int
    receiver_bytes: tuple
    role: str
    rank: int
    runs: np.ndarray  # its records (shares.py)
    nd: int
    holdings: dict  # {its rank: Holdings}, a trainer's
    needs: RankSlices | None  # an inference rank's
    receivers: tuple  # a trainer's, in its sending order
    sliced = True

    @classmethod
    def from_json(cls, header: str, share: str) -> "RankPlan":
        h, s = json.loads(header), json.loads(share)
        if h.get("kind") != KIND:
            raise ValueError("not the header of a plan published in shares")
        nd = int(s["nd"])
        layout = FlatLayout.from_json(json.dumps(h["layout"]))
        rank = int(s["rank"])
        trainer = s["role"] == "trainer"
        return cls(layout, int(h["trainers"]), int(h["inferences"]), int(h["bucket_bytes"]), tuple(h["receiver_bytes"]),
                   s["role"], rank, decode(s["runs"], BOX + 2 * nd if trainer else NBYTES + 1), nd,
                   {rank: Holdings.from_json(s["holdings"])} if trainer else {},
                   None if trainer else needs_from_json(rank, s["needs"]), tuple(s.get("receivers", ())))

    @cached_property
    def _items(self) -> np.ndarray:
        return np.array([ITEMSIZE[s.dtype] for s in self.layout.slots], dtype=np.int64)

    def _own(self, role: str, rank: int, what: str) -> None:
        if (role, rank) != (self.role, self.rank):
            raise ValueError(f"{what} of {role} rank {rank}: this plan is {self.role} rank {self.rank}'s share alone")

    @cached_property
    def _buckets(self) -> ShareBuckets:
        made, receivers = sender_streams(self.runs, self.receivers, self._items, self.bucket_bytes, self.nd)
        return ShareBuckets(self.rank, made, receivers, [len(s.shape) for s in self.layout.slots])

    def buckets_of(self, trainer: int) -> ShareBuckets:
        self._own("trainer", trainer, "the buckets")
        return self._buckets

    def sent_bytes(self, trainer: int) -> int:
        self._own("trainer", trainer, "the bytes")
        return int(self._buckets.lengths.sum())

    @cached_property
    def local(self) -> LocalLayout:
        self._own("inference", self.rank if self.role == "inference" else -1, "the local layout")
        return LocalLayout.of(self.layout, self.needs)

    def local_of(self, rank: int) -> LocalLayout:
        self._own("inference", rank, "the local layout")
        return self.local

    def expected_for(self, inference: int) -> dict[int, list[tuple[int, int]]]:
        self._own("inference", inference, "what is received")
        return receiver_ranges(self.runs, self.bucket_bytes)

    def scatter_for(self, inference: int) -> dict:
        return {}

    def bytes_for(self, inference: int) -> int:
        return int(self.receiver_bytes[inference])

    def bytes_by_receiver(self) -> list[int]:
        return list(self.receiver_bytes)

    @property
    def version_bytes(self) -> int:
        return self.layout.total_bytes

    def to_json(self) -> str:
        raise ValueError("a rank's share of the plan is not published again; the controller publishes the plan")

    def table(self) -> str:
        return (f"version: {len(self.layout.slots)} tensors, {size_text(self.version_bytes)} as {self.layout.dtype}; "
                f"receivers need slices; {self.role} rank {self.rank}'s share: {len(self.runs)} runs")
