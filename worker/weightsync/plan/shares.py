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

Runs are int64 records (RECORD's fields, then the box's lo and hi per dimension), sent as zlib'd
bytes in base64. No torch here.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass

import numpy as np

from weightsync.model.flat import ITEMSIZE
from weightsync.plan.boxes import Slicing
from weightsync.plan.sliced_plan import SlicedPlan, global_tensors, needs_to_json

KIND = "slices-shares"  # the header's kind (sliced_plan.plan_from_json reads the others)
SENDER, RECEIVER, TENSOR, OFFSET, SLOT_END = range(5)
RECORD = 5  # fields before the box's lo and hi


@dataclass(frozen=True)
class PlanShares:
    """The published plan of a SlicedPlan: the header, and each rank's share, as JSON text."""

    header: str
    trainers: tuple  # per trainer rank
    inferences: tuple  # per inference rank


def encode(records: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(np.ascontiguousarray(records, dtype="<i8").tobytes(), 1)).decode()


def decode(text: str, fields: int) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype="<i8").reshape(-1, fields)


def header(plan: SlicedPlan) -> dict:
    return {"kind": KIND, "layout": json.loads(plan.layout.to_json()), "trainers": plan.trainers,
            "inferences": plan.inferences, "bucket_bytes": plan.bucket_bytes,
            "receiver_bytes": plan.bytes_by_receiver()}


def share_out(plan: SlicedPlan) -> PlanShares:
    """Cut `plan` into the header and every rank's share."""
    nd = _ndim(plan)
    per_trainer: list[list] = [[] for _ in range(plan.trainers)]
    per_receiver: list[list] = [[] for _ in range(plan.inferences)]
    for records in class_runs(plan, nd):
        for column, out in ((SENDER, per_trainer), (RECEIVER, per_receiver)):
            order = np.argsort(records[:, column], kind="stable")
            ranks = records[order, column]
            bounds = np.searchsorted(ranks, np.arange(len(out) + 1))
            for rank in np.flatnonzero(np.diff(bounds)):
                out[rank].append(records[order[bounds[rank]:bounds[rank + 1]]])
    fields = RECORD + 2 * nd
    empty = np.zeros((0, fields), dtype=np.int64)
    position = plan.assignment.position
    trainers = []
    for t, parts in enumerate(per_trainer):
        records = np.concatenate(parts) if parts else empty
        receivers = sorted(set(np.unique(records[:, RECEIVER]).tolist()), key=lambda r: int(position[t, r]))
        trainers.append(json.dumps({"role": "trainer", "rank": t, "nd": nd, "runs": encode(records),
                                    "receivers": receivers, "holdings": plan.holdings[t].to_json()}))
    inferences = []
    for r, parts in enumerate(per_receiver):
        records = np.concatenate(parts) if parts else empty
        inferences.append(json.dumps({"role": "inference", "rank": r, "nd": nd, "runs": encode(records),
                                      "needs": needs_to_json(plan.needs[r])}))
    return PlanShares(json.dumps(header(plan)), tuple(trainers), tuple(inferences))


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
        blo, bhi = _box_arrays(placement.boxes, nd)
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
    out[:, :, TENSOR] = np.asarray(group, dtype=np.int64)[:, None]
    out[:, :, OFFSET] = offsets + at
    out[:, :, SLOT_END] = offsets + box_bytes
    out[:, :, RECORD:RECORD + nd] = lo
    out[:, :, RECORD + nd:] = hi
    return out.reshape(m * n, -1)


def _padded(a: np.ndarray, nd: int, fill: int) -> np.ndarray:
    if a.shape[1] == nd:
        return a
    out = np.full((len(a), nd), fill, dtype=np.int64)
    out[:, :a.shape[1]] = a[:, :nd]
    return out


def _box_arrays(boxes, nd):
    lo = np.zeros((len(boxes), nd), dtype=np.int64)
    hi = np.ones((len(boxes), nd), dtype=np.int64)
    for i, b in enumerate(boxes):
        lo[i, :len(b.start)], hi[i, :len(b.stop)] = b.start, b.stop
    return lo, hi


def _strides(shape: np.ndarray) -> np.ndarray:
    """Row-major element strides of each row's shape."""
    out = np.ones_like(shape)
    for d in range(shape.shape[1] - 2, -1, -1):
        out[:, d] = out[:, d + 1] * shape[:, d + 1]
    return out
