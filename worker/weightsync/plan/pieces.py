"""The assignment of pieces: which trainer rank sends which box of which tensor to which inference rank.

Every box an inference rank needs is intersected with the boxes trainer ranks hold; each
intersection is one piece, sent by one of the ranks holding it. Holders of one box are disjoint
from holders of any other box of the tensor (FSDP2 chunks), so every needed byte comes from
exactly one holder; where several ranks hold the same box (DDP, HSDP replicas), the pieces of
that box are split between them by water-filling: each replica set tops its members up to one
common level of bytes, so the busiest sender ends within about one piece of the mean. Pieces are
cut to at most bucket_bytes (and finer where a replica set needs the granularity to balance), so
a sender pipelines them as the flat plan's buckets are.

Scale: 256 trainers x 128 inference ranks over a 1T-parameter MoE is tens of millions of pieces.
The work is done per class of tensors (same shape, same holder placement, same need placement:
every layer's q_proj is one class): intersected, balanced and cut once with numpy, and kept once
with the list of the class's tensors. The assignment is still the complete list of pieces:
pieces_of(sender) lists every one of them, and the tests check them byte by byte.
sliced_plan.SlicedPlan turns an assignment into the transfer plan: the pieces as buckets of bytes.

Order: all a sender owes one receiver goes as one stream, and each sender takes its receivers
in the order linktime.greedy_order finds by playing the transfer forward on the links' model:
the senders with the most left choose first, each the least crowded receiver it owes, the one it
owes most first. Senders therefore start on different receivers and stay spread over them,
instead of all queueing at receiver 0, also where the bytes per (sender, receiver) pair are far
from uniform (column-parallel slices come from a few senders, row-parallel ones from all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weightsync.plan.boxes import Box, Slicing
from weightsync.plan.linktime import greedy_order
from weightsync.plan.segments import size_text as _size

# A replica set cuts its pieces to at most 1/BALANCE_GRAIN of a member's share, so that where
# its cuts fall costs at most that much balance.
BALANCE_GRAIN = 64


@dataclass(frozen=True)
class Piece:
    tensor: str
    box: Box
    receiver: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class PieceClass:
    """The pieces of a class of tensors that are alike (same shape, dtype, holders and needs):
    the same boxes, senders and receivers for each of `tensors` (indices into the assignment's tensors).
    Arrays of one length; lo and hi are (pieces, ndim), unused trailing dims of lower-rank tensors
    [0, 1). Sorted by sender."""

    tensors: np.ndarray
    sender: np.ndarray
    receiver: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    nbytes: np.ndarray


@dataclass(frozen=True, eq=False)
class PieceAssignment:
    """Every piece of every tensor, by class; position[s, r] is where receiver r comes in sender
    s's order (all pieces s owes r go as one stream)."""

    tensors: tuple
    senders: int
    receivers: int
    bucket_bytes: int
    classes: tuple
    position: np.ndarray

    def __len__(self) -> int:
        return sum(len(c.sender) * len(c.tensors) for c in self.classes)

    def pieces_of(self, sender: int) -> list[Piece]:
        """The pieces `sender` sends, in sending order: by receiver in its order, then tensor order."""
        out = []
        for c in self.classes:
            a, b = np.searchsorted(c.sender, [sender, sender + 1])
            for t in c.tensors:
                tensor = self.tensors[t]
                nd = len(tensor.shape)
                for i in range(a, b):
                    box = Box(tuple(int(x) for x in c.lo[i, :nd]), tuple(int(x) for x in c.hi[i, :nd]))
                    out.append((int(self.position[sender, c.receiver[i]]), int(t), box.start,
                                Piece(tensor.name, box, int(c.receiver[i]), int(c.nbytes[i]))))
        out.sort(key=lambda x: x[:3])
        return [x[3] for x in out]

    def pair_bytes(self) -> np.ndarray:
        """(senders, receivers): the bytes each sender sends each receiver."""
        out = np.zeros(self.senders * self.receivers)
        for c in self.classes:
            out += np.bincount(c.sender * self.receivers + c.receiver, weights=c.nbytes * len(c.tensors),
                               minlength=len(out))
        return out.reshape(self.senders, self.receivers)

    def bytes_by_sender(self) -> np.ndarray:
        return self.pair_bytes().sum(axis=1).astype(np.int64)

    def bytes_by_receiver(self) -> np.ndarray:
        return self.pair_bytes().sum(axis=0).astype(np.int64)

    def balance(self) -> tuple[float, float]:
        """(max / mean bytes per sender, max / mean bytes per receiver); 1.0 is perfect."""
        return _max_over_mean(self.bytes_by_sender()), _max_over_mean(self.bytes_by_receiver())

    def table(self, rows: int = 8) -> str:
        """Per-sender and per-receiver bytes (all ranks, or the first and last few of many), and the balance."""
        pairs = self.pair_bytes()
        sent, received = pairs.sum(axis=1).astype(np.int64), pairs.sum(axis=0).astype(np.int64)
        pieces = np.zeros(self.senders, dtype=np.int64)
        for c in self.classes:
            pieces += np.bincount(c.sender, minlength=self.senders) * len(c.tensors)
        peers = (pairs > 0).sum(axis=1)
        lines = [f"slices: {len(self.tensors)} tensors, {len(self)} pieces of at most {_size(self.bucket_bytes)}; "
                 f"{self.senders} trainer rank(s) -> {self.receivers} inference rank(s)",
                 f"{'sender':>8}  {'bytes':>12}  {'pieces':>8}  {'peers':>5}"]
        for s in _shown(self.senders, rows):
            lines.append("     ..." if s is None else f"{s:>8}  {_size(int(sent[s])):>12}  {pieces[s]:>8}  {peers[s]:>5}")
        lines.append(f"{'receiver':>8}  {'bytes':>12}")
        for r in _shown(self.receivers, rows):
            lines.append("     ..." if r is None else f"{r:>8}  {_size(int(received[r])):>12}")
        bs, br = _max_over_mean(sent), _max_over_mean(received)
        lines.append(f"balance (max / mean): senders {bs:.3f}, receivers {br:.3f}; "
                     f"busiest sender {_size(int(sent.max()))}, busiest receiver {_size(int(received.max()))}")
        return "\n".join(lines)


def assign_pieces(holders: Slicing, needs: Slicing, bucket_bytes: int) -> PieceAssignment:
    """Assign every byte every inference rank needs (`needs`) to exactly one trainer rank holding
    it (`holders`), balanced by bytes across replicas, cut to pieces of at most bucket_bytes."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    _check_same_tensors(holders, needs)
    tensors = holders.tensors
    nd = max([len(t.shape) for t in tensors] + [1])
    sets: dict = {}  # replica set (tuple of ranks) -> id
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.shape, t.itemsize, id(holders.placements[i]), id(needs.placements[i])), []).append(i)
    members_of = list(groups.values())
    parts = [_class_pieces(tensors[idx[0]], holders.placements[idx[0]], needs.placements[idx[0]], nd, sets)
             for idx in members_of]
    klass = np.concatenate([np.full(len(p[0]), k, dtype=np.int64) for k, p in enumerate(parts)])
    recv, setid, lo, hi, nbytes = (np.concatenate([p[j] for p in parts]) for j in range(5))
    count = np.array([len(idx) for idx in members_of], dtype=np.int64)  # tensors per class
    item = np.array([tensors[idx[0]].itemsize for idx in members_of], dtype=np.int64)
    members = [np.asarray(s, dtype=np.int64) for s in sorted(sets, key=sets.get)]
    limit = _limits(setid, nbytes * count[klass], count[klass], members, bucket_bytes)
    klass, recv, setid, lo, hi, nbytes = _split(klass, recv, setid, lo, hi, nbytes, limit, item)
    sender = _assign(setid, recv, nbytes * count[klass], members, holders.world)
    pairs = np.bincount(sender * needs.world + recv, weights=nbytes * count[klass],
                        minlength=holders.world * needs.world)
    position = greedy_order(pairs.reshape(holders.world, needs.world))
    order = np.lexsort((lo[:, 0], position[sender, recv], sender, klass))
    klass, sender, recv, lo, hi, nbytes = klass[order], sender[order], recv[order], lo[order], hi[order], nbytes[order]
    bounds = np.searchsorted(klass, np.arange(len(members_of) + 1))
    classes = tuple(PieceClass(np.asarray(idx, dtype=np.int64), *(x[a:b] for x in (sender, recv, lo, hi, nbytes)))
                    for idx, a, b in zip(members_of, bounds[:-1], bounds[1:]))
    return PieceAssignment(tensors, holders.world, needs.world, bucket_bytes, classes, position)


def check_assignment(assignment: PieceAssignment, needs: Slicing) -> None:
    """Cheap whole-assignment check (the tests check byte by byte on small cases): for every
    tensor and receiver, the pieces add up to exactly the bytes that receiver needs of it."""
    for c in assignment.classes:
        got = np.bincount(c.receiver, weights=c.nbytes, minlength=assignment.receivers)
        for t in c.tensors:
            want = np.zeros(assignment.receivers)
            tensor, p = needs.tensors[t], needs.placements[t]
            for box, ranks in zip(p.boxes, p.ranks):
                want[np.asarray(ranks)] += box.numel * tensor.itemsize
            bad = np.flatnonzero(got != want)
            if len(bad):
                r = int(bad[0])
                raise AssertionError(f"the assignment gives receiver {r} {int(got[r])} bytes of {tensor.name}, "
                                     f"it needs {int(want[r])}")


def _check_same_tensors(holders: Slicing, needs: Slicing) -> None:
    for a, b in zip(holders.tensors, needs.tensors):
        if a != b:
            raise ValueError(f"trainers and inference ranks disagree about a tensor: {a} vs {b}")
    if len(holders.tensors) != len(needs.tensors):
        raise ValueError(f"trainers hold {len(holders.tensors)} tensors, inference ranks need {len(needs.tensors)}")


def box_arrays(boxes, nd):
    """The boxes' starts and stops as two (boxes, nd) int64 arrays, a box of fewer dims padded
    with [0, 1)."""
    lo = np.zeros((len(boxes), nd), dtype=np.int64)
    hi = np.ones((len(boxes), nd), dtype=np.int64)
    for i, b in enumerate(boxes):
        lo[i, :len(b.start)], hi[i, :len(b.stop)] = b.start, b.stop
    return lo, hi


def _class_pieces(t, held, needed, nd, sets):
    """One tensor's pieces for its class: intersections of needed and held boxes, one per receiver."""
    hlo, hhi = box_arrays(held.boxes, nd)
    nlo, nhi = box_arrays(needed.boxes, nd)
    _check_disjoint(t, hlo, hhi, None, "trainer ranks hold overlapping but different boxes")
    _check_disjoint(t, nlo, nhi, needed.ranks, "an inference rank needs overlapping boxes")
    lo = np.maximum(hlo[:, None], nlo[None])
    hi = np.minimum(hhi[:, None], nhi[None])
    vol = np.prod(np.clip(hi - lo, 0, None), axis=2)
    covered = vol.sum(axis=0)
    need_vol = np.prod(nhi - nlo, axis=1)
    short = np.flatnonzero(covered != need_vol)
    if len(short):
        n = short[0]
        raise ValueError(f"tensor {t.name}: inference rank(s) {list(needed.ranks[n])[:4]} need {needed.boxes[n]} "
                         f"({need_vol[n]} elements) but the trainer ranks hold {covered[n]} of them")
    h, n = np.nonzero(vol)
    counts = np.array([len(needed.ranks[k]) for k in n], dtype=np.int64)
    rep = np.repeat(np.arange(len(n)), counts)
    recv = np.concatenate([np.asarray(needed.ranks[k], dtype=np.int64) for k in n]) if len(n) else np.zeros(0, np.int64)
    set_of_box = np.array([sets.setdefault(r, len(sets)) for r in held.ranks], dtype=np.int64)
    return recv, set_of_box[h[rep]], lo[h, n][rep], hi[h, n][rep], vol[h, n][rep] * t.itemsize


def _check_disjoint(t, lo, hi, ranks, what):
    if len(lo) < 2:
        return
    inter = np.prod(np.clip(np.minimum(hi[:, None], hi[None]) - np.maximum(lo[:, None], lo[None]), 0, None), axis=2)
    np.fill_diagonal(inter, 0)
    for a, b in zip(*np.nonzero(inter)):
        if ranks is None or set(ranks[a]) & set(ranks[b]):
            raise ValueError(f"tensor {t.name}: {what} ({_box(lo[a], hi[a], t)} and {_box(lo[b], hi[b], t)}); "
                             "give every rank disjoint boxes, or identical ones for replicas")


def _box(lo, hi, t) -> str:
    nd = len(t.shape)
    return str(Box(tuple(int(x) for x in lo[:nd]), tuple(int(x) for x in hi[:nd])))


def _limits(setid, load, count, members, bucket_bytes):
    """Largest piece allowed: a bucket, or less where a replica set needs finer cuts to balance
    (a piece weighs `count` times its bytes: it is sent for every tensor of its class)."""
    sizes = np.array([len(m) for m in members])
    total = np.bincount(setid, weights=load, minlength=len(members))
    grain = np.where(sizes > 1, total / (np.maximum(sizes, 1) * BALANCE_GRAIN), np.inf)[setid] / count
    return np.maximum(1, np.minimum(bucket_bytes, grain)).astype(np.int64)


def _split(klass, recv, setid, lo, hi, nbytes, limit, item):
    """Cut every piece over its limit along its first dim wider than one element (whole rows of
    that dim, so every part is a box again); repeat on the next dim where one row is still too big."""
    for _ in range(lo.shape[1]):
        ext = hi - lo
        over = nbytes > limit
        dim = np.argmax(ext > 1, axis=1)
        width = ext[np.arange(len(ext)), dim]
        parts = np.where(over, np.minimum(width, -(-nbytes // limit)), 1)
        if not (parts > 1).any():
            break
        rep = np.repeat(np.arange(len(parts)), parts)
        j = np.arange(len(rep)) - np.repeat(np.cumsum(parts) - parts, parts)
        d, w, p = dim[rep], width[rep], parts[rep]
        rows = np.arange(len(rep))
        lo, hi = lo[rep], hi[rep]
        base = lo[rows, d]
        lo[rows, d] = base + w * j // p
        hi[rows, d] = base + w * (j + 1) // p
        klass, recv, setid, limit = klass[rep], recv[rep], setid[rep], limit[rep]
        nbytes = np.prod(hi - lo, axis=1) * item[klass]
    return klass, recv, setid, lo, hi, nbytes


def _assign(setid, recv, nbytes, members, world):
    """The sender of every piece: the one member of a single-rank set; across a replica set,
    contiguous runs (by receiver) sized to fill its members up to a common level."""
    sender = np.full(len(setid), -1, dtype=np.int64)
    load = np.zeros(world, dtype=np.float64)
    sizes = np.array([len(m) for m in members])
    single = sizes[setid] == 1
    firsts = np.array([m[0] for m in members], dtype=np.int64)
    sender[single] = firsts[setid[single]]
    load += np.bincount(sender[single], weights=nbytes[single], minlength=world)
    multi = np.flatnonzero(~single)
    if len(multi):
        order = multi[np.lexsort((recv[multi], setid[multi]))]
        ids, starts = np.unique(setid[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        totals = np.add.reduceat(nbytes[order], starts)
        for k in np.argsort(-totals, kind="stable"):
            rows = order[starts[k]:ends[k]]
            m = members[ids[k]]
            quota = _water_fill(load[m], float(totals[k]))
            mid = np.cumsum(nbytes[rows]) - nbytes[rows] / 2
            who = np.minimum(np.searchsorted(np.cumsum(quota), mid, side="right"), len(m) - 1)
            sender[rows] = m[who]
            load += np.bincount(m[who], weights=nbytes[rows], minlength=world)
    return sender


def _water_fill(load, amount):
    """How much each member gets of `amount` so that the lowest loads rise to one common level."""
    levels = np.sort(load)
    filled = np.cumsum(levels)
    k = np.arange(1, len(levels) + 1)
    fits = k * levels - filled <= amount  # raising the k lowest to the k-th level fits within amount
    j = np.flatnonzero(fits)[-1] + 1
    level = (amount + filled[j - 1]) / j
    return np.maximum(0.0, level - load)


def _max_over_mean(x) -> float:
    mean = float(np.mean(x)) if len(x) else 0.0
    return float(np.max(x)) / mean if mean else 1.0


def _shown(n: int, rows: int):
    if n <= 2 * rows:
        return list(range(n))
    return list(range(rows)) + [None] + list(range(n - rows, n))
