"""Every rank's share of a sliced plan, as the controller publishes it: each rank reads its own.

A SlicedPlan is a pure function of its inputs (the layout, every trainer rank's rows, every
inference rank's boxes), and every rank could derive the whole of it; but for a large job the
whole assignment is tens of millions of pieces, and each rank uses a few hundred thousand of them.
So the controller, which computes the whole assignment anyway (to check it and to print it), cuts
it into shares and publishes each rank's under a key of its own (rendezvous/plan_shares.py):

- the header every rank reads: the layout, the ranks, the bucket size, each inference rank's
  buffer size (what a trainer reports against);
- a trainer rank's share: the runs it sends (each a box of one tensor, where it lands in its
  receiver's buffer, and where the slot it lands in ends), and its receivers in its sending order;
- an inference rank's share: the boxes it needs (its local layout) and the runs it receives.

A run is what SlicedPlan's buckets are made of: a piece of the assignment, which is one
contiguous run of bytes in its receiver's local layout (cut from a trainer's dim-0 rows, a piece
has the later dims of the box it is needed in, or is a part of one of its rows). Both sides pack
their runs into buckets with the same code (rank_plan.pack), so the buckets a trainer sends are
exactly the ones its receivers expect, and exactly SlicedPlan's.

A share's runs are int64 columns (PEER, OFFSET, SLOT_END, and a trainer's TENSOR and BOX, a
receiver's NBYTES), sent as zlib'd differences in base64 (Share). No torch here.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass

import numpy as np

from weightsync.model.flat import ITEMSIZE
from weightsync.plan.boxes import Slicing
from weightsync.plan.pieces import box_arrays
from weightsync.plan.sliced_plan import SlicedPlan, global_tensors, needs_to_json

KIND = "slices-shares"  # the header's kind (sliced_plan.plan_from_json reads the others)
# a share's columns: the other side of the run's stream (a trainer's receiver, a receiver's
# trainer), where the run lands in the receiver's buffer and where its slot ends; then a
# trainer's the tensor and the box (lo, then hi, per dimension), a receiver's the run's bytes
PEER, OFFSET, SLOT_END, TENSOR, BOX = range(5)
NBYTES = 3
# the whole assignment's runs, as class_runs makes them
SENDER, RECEIVER, _TENSOR, _OFFSET, _SLOT_END, RECORD = range(6)


@dataclass(frozen=True)
class PlanShares:
    """The published plan of a SlicedPlan: the header, and each rank's share, as JSON text."""

    header: str
    trainers: tuple  # per trainer rank
    inferences: tuple  # per inference rank


def decode(text: str, columns: int) -> np.ndarray:
    """A share's runs (rows of its `columns` columns), in the order of their stream's peer, then offset."""
    data = zlib.decompress(base64.b64decode(text))
    parts, at = [], 0
    while at < len(data):
        n, k = np.frombuffer(data, dtype="<i8", count=2, offset=at).tolist()
        parts.append(np.cumsum(np.frombuffer(data, dtype="<i8", count=n * k, offset=at + 16).reshape(k, n), axis=1).T)
        at += 16 + 8 * n * k
    return np.concatenate(parts) if parts else np.zeros((0, columns), dtype=np.int64)


def header(plan: SlicedPlan) -> dict:
    return {"kind": KIND, "layout": json.loads(plan.layout.to_json()), "trainers": plan.trainers,
            "inferences": plan.inferences, "bucket_bytes": plan.bucket_bytes,
            "receiver_bytes": plan.bytes_by_receiver()}


def share_out(plan: SlicedPlan) -> PlanShares:
    """Cut `plan` into the header and every rank's share. Each rank's runs are compressed as they
    come, class by class: the whole assignment's runs are never held at once."""
    nd = _ndim(plan)
    trainers = [Share() for _ in range(plan.trainers)]
    receivers = [Share() for _ in range(plan.inferences)]
    items = np.array([ITEMSIZE[s.dtype] for s in plan.layout.slots], dtype=np.int64)
    for records in class_runs(plan, nd):
        box = records[:, RECORD:]
        nbytes = np.prod(box[:, nd:] - box[:, :nd], axis=1) * items[records[:, _TENSOR]]
        sent = np.concatenate([records[:, [RECEIVER, _OFFSET, _SLOT_END, _TENSOR]], box], axis=1)
        received = np.stack([records[:, SENDER], records[:, _OFFSET], records[:, _SLOT_END], nbytes], axis=1)
        for column, out, rows in ((SENDER, trainers, sent), (RECEIVER, receivers, received)):
            order = np.lexsort((rows[:, OFFSET], rows[:, PEER], records[:, column]))
            bounds = np.searchsorted(records[order, column], np.arange(len(out) + 1))
            for rank in np.flatnonzero(np.diff(bounds)).tolist():
                out[rank].add(rows[order[bounds[rank]:bounds[rank + 1]]])
    position = plan.assignment.position
    return PlanShares(json.dumps(header(plan)), tuple(
        json.dumps({"role": "trainer", "rank": t, "nd": nd, "runs": share.text(),
                    "receivers": sorted(share.peers, key=lambda r: int(position[t, r])),
                    "holdings": plan.holdings[t].to_json()}) for t, share in enumerate(trainers)), tuple(
        json.dumps({"role": "inference", "rank": r, "nd": nd, "runs": share.text(), "needs": needs_to_json(plan.needs[r])})
        for r, share in enumerate(receivers)))


class Share:
    """One rank's runs, compressed as they are added, and the peers of its streams. Each group of
    rows added (in the order of their peer, then offset) is its count, its columns' count, and
    each column's differences from the row before (small numbers, which compress well)."""

    def __init__(self):
        self.zip = zlib.compressobj(6)
        self.chunks: list[bytes] = []
        self.peers: set[int] = set()

    def add(self, rows: np.ndarray) -> None:
        columns = np.diff(rows.T, axis=1, prepend=0)
        self.chunks.append(self.zip.compress(np.array(rows.shape, dtype="<i8").tobytes()
                                             + np.ascontiguousarray(columns, dtype="<i8").tobytes()))
        self.peers.update(np.unique(rows[:, PEER]).tolist())

    def text(self) -> str:
        return base64.b64encode(b"".join(self.chunks) + self.zip.flush()).decode()


def _ndim(plan: SlicedPlan) -> int:
    return max([len(s.shape) for s in plan.layout.slots] + [1])


def need_slicing(plan: SlicedPlan) -> Slicing:
    return Slicing.from_ranks(global_tensors(plan.layout), plan.needs, plan.inferences)


def class_runs(plan: SlicedPlan, nd: int):
    """The runs of the whole assignment, as records, one array per class of its pieces (and per
    group of the class's tensors, so that no array holds more than a few million)."""
    assignment, local = plan.assignment, plan.local
    needs = need_slicing(plan)
    items = [ITEMSIZE[s.dtype] for s in plan.layout.slots]
    slots = [{(s.tensor, s.box.start): s for s in lay.slots} for lay in local]
    for c in assignment.classes:
        if not len(c.sender):
            continue
        placement = needs.placements[int(c.tensors[0])]
        lo, hi = _padded(c.lo, nd, 0), _padded(c.hi, nd, 1)
        blo, bhi = box_arrays(placement.boxes, nd)
        member = np.zeros((len(placement.boxes), plan.inferences), dtype=bool)
        for k, ranks in enumerate(placement.ranks):
            member[k, list(ranks)] = True
        inside = np.all(lo[:, None] >= blo[None], axis=2) & np.all(hi[:, None] <= bhi[None], axis=2)
        k = np.argmax(inside & member[:, c.receiver].T, axis=1)  # the needed box each piece lies in
        shape = bhi[k] - blo[k]
        rel = lo - blo[k]
        index = (rel * _strides(shape)).sum(axis=1)
        whole = (rel == 0) & (hi - lo == shape)
        wide = hi - lo != 1
        first = np.where(wide.any(axis=1), np.argmax(wide, axis=1), nd)
        contiguous = np.all((np.arange(nd)[None] <= first[:, None]) | whole, axis=1)
        if not contiguous.all():  # a piece cut from dim-0 rows has the later dims of its needed box
            i = int(np.flatnonzero(~contiguous)[0])
            raise ValueError(f"tensor {assignment.tensors[int(c.tensors[0])].name}: a piece is not one run of bytes "
                             f"in the buffer of inference rank {int(c.receiver[i])}")
        item = items[int(c.tensors[0])]
        box_bytes = np.prod(shape, axis=1) * item
        tensors = [int(t) for t in c.tensors]
        step = max(1, (4 << 20) // len(k))
        for g in range(0, len(tensors), step):
            group = tensors[g:g + step]
            offsets = _offsets(group, placement, slots, c.receiver, k, plan.inferences)
            yield _records(group, c.sender, c.receiver, offsets, index * item, box_bytes, lo, hi)


def _offsets(group, placement, slots, receiver, k, inferences) -> np.ndarray:
    """(tensors, pieces): where the needed box each piece lies in begins in its receiver's buffer."""
    table = np.full((len(group), len(placement.boxes), inferences), -1, dtype=np.int64)
    for j, t in enumerate(group):
        for kk, (box, ranks) in enumerate(zip(placement.boxes, placement.ranks)):
            for r in ranks:
                table[j, kk, r] = slots[r][(t, box.start)].offset
    return table[:, k, receiver]


def _records(group, sender, receiver, offsets, at, box_bytes, lo, hi) -> np.ndarray:
    m, n, nd = len(group), len(sender), lo.shape[1]
    out = np.empty((m, n, RECORD + 2 * nd), dtype=np.int64)
    out[:, :, SENDER] = sender
    out[:, :, RECEIVER] = receiver
    out[:, :, _TENSOR] = np.asarray(group, dtype=np.int64)[:, None]
    out[:, :, _OFFSET] = offsets + at
    out[:, :, _SLOT_END] = offsets + box_bytes
    out[:, :, RECORD:RECORD + nd] = lo
    out[:, :, RECORD + nd:] = hi
    return out.reshape(m * n, -1)


def _padded(a: np.ndarray, nd: int, fill: int) -> np.ndarray:
    if a.shape[1] == nd:
        return a
    out = np.full((len(a), nd), fill, dtype=np.int64)
    out[:, :a.shape[1]] = a[:, :nd]
    return out


def _strides(shape: np.ndarray) -> np.ndarray:
    """Row-major element strides of each row's shape."""
    out = np.ones_like(shape)
    for d in range(shape.shape[1] - 2, -1, -1):
        out[:, d] = out[:, d + 1] * shape[:, d + 1]
    return out
