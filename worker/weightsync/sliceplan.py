"""The plan over slices: which trainer rank sends which box of which tensor to which inference rank.

Every box an inference rank needs is intersected with the boxes trainer ranks hold; each
intersection is one piece, sent by one of the ranks holding it. Holders of one box are disjoint
from holders of any other box of the tensor (FSDP2 chunks), so every needed byte comes from
exactly one holder; where several ranks hold the same box (DDP, HSDP replicas), the pieces of
that box are split between them by water-filling: each replica set tops its members up to one
common level of bytes, so the busiest sender ends within about one piece of the mean. Pieces are
cut to at most bucket_bytes (and finer where a replica set needs the granularity to balance), so
a sender pipelines them as the flat plan's buckets are.

Scale: 256 trainers x 128 inference ranks over a 1T-parameter MoE is millions of pieces. The
work is done per class of tensors (same shape, same holder placement, same need placement: every
layer's q_proj is one class), intersected once with numpy, then repeated for the class's
tensors; balancing and ordering are array operations. The result is still the complete list of
pieces, checkable piece by piece.

Order: a sender sends all it owes one receiver as one stream, and takes its receivers in the
order linktime.greedy_order finds by playing the transfer forward on the links' model: a free
sender starts on the least crowded receiver it owes bytes, the one with most left to receive
first. Senders therefore start on different receivers and stay spread over them, instead of all
queueing at receiver 0, also where the bytes per (sender, receiver) pair are far from uniform
(column-parallel slices come from a few senders, row-parallel ones from all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .linktime import greedy_order
from .plan import size_text as _size
from .slices import Box, Slicing

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
class SlicePlan:
    """All pieces, sorted by sender and then in each sender's sending order. Arrays of one length:
    tensor (index into tensors), sender, receiver, nbytes; lo and hi are (pieces, ndim) with the
    unused trailing dims of lower-rank tensors as [0, 1)."""

    tensors: tuple
    senders: int
    receivers: int
    bucket_bytes: int
    tensor: np.ndarray
    sender: np.ndarray
    receiver: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.sender)

    def pieces_of(self, sender: int) -> list[Piece]:
        a, b = np.searchsorted(self.sender, [sender, sender + 1])
        out = []
        for i in range(a, b):
            t = self.tensors[self.tensor[i]]
            nd = len(t.shape)
            out.append(Piece(t.name, Box(tuple(int(x) for x in self.lo[i, :nd]), tuple(int(x) for x in self.hi[i, :nd])),
                             int(self.receiver[i]), int(self.nbytes[i])))
        return out

    def bytes_by_sender(self) -> np.ndarray:
        return np.bincount(self.sender, weights=self.nbytes, minlength=self.senders).astype(np.int64)

    def bytes_by_receiver(self) -> np.ndarray:
        return np.bincount(self.receiver, weights=self.nbytes, minlength=self.receivers).astype(np.int64)

    def balance(self) -> tuple[float, float]:
        """(max / mean bytes per sender, max / mean bytes per receiver); 1.0 is perfect."""
        return _max_over_mean(self.bytes_by_sender()), _max_over_mean(self.bytes_by_receiver())

    def table(self, rows: int = 8) -> str:
        """Per-sender and per-receiver bytes (all ranks, or the first and last few of many), and the balance."""
        sent, received = self.bytes_by_sender(), self.bytes_by_receiver()
        pieces = np.bincount(self.sender, minlength=self.senders)
        peers = [len(np.unique(self.receiver[a:b])) for a, b in zip(*self._bounds())]
        lines = [f"slices: {len(self.tensors)} tensors, {len(self)} pieces of at most {_size(self.bucket_bytes)}; "
                 f"{self.senders} trainer rank(s) -> {self.receivers} inference rank(s)",
                 f"{'sender':>8}  {'bytes':>12}  {'pieces':>8}  {'peers':>5}"]
        for s in _shown(self.senders, rows):
            lines.append("     ..." if s is None else f"{s:>8}  {_size(int(sent[s])):>12}  {pieces[s]:>8}  {peers[s]:>5}")
        lines.append(f"{'receiver':>8}  {'bytes':>12}")
        for r in _shown(self.receivers, rows):
            lines.append("     ..." if r is None else f"{r:>8}  {_size(int(received[r])):>12}")
        bs, br = self.balance()
        lines.append(f"balance (max / mean): senders {bs:.3f}, receivers {br:.3f}; "
                     f"busiest sender {_size(int(sent.max()))}, busiest receiver {_size(int(received.max()))}")
        return "\n".join(lines)

    def _bounds(self):
        starts = np.searchsorted(self.sender, np.arange(self.senders))
        ends = np.searchsorted(self.sender, np.arange(self.senders), side="right")
        return starts, ends


def make_slice_plan(holders: Slicing, needs: Slicing, bucket_bytes: int) -> SlicePlan:
    """Assign every byte every inference rank needs (`needs`) to exactly one trainer rank holding
    it (`holders`), balanced by bytes across replicas, cut to pieces of at most bucket_bytes."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    _check_same_tensors(holders, needs)
    tensors = holders.tensors
    nd = max([len(t.shape) for t in tensors] + [1])
    sets: dict = {}  # replica set (tuple of ranks) -> id
    parts = []
    classes: dict = {}
    for i, t in enumerate(tensors):
        classes.setdefault((t.shape, t.itemsize, id(holders.placements[i]), id(needs.placements[i])), []).append(i)
    for idx in classes.values():
        t = tensors[idx[0]]
        parts.append(_class_pieces(t, idx, holders.placements[idx[0]], needs.placements[idx[0]], nd, sets))
    tensor, recv, setid, lo, hi, nbytes = (np.concatenate([p[k] for p in parts]) for k in range(6))
    members = [np.asarray(s, dtype=np.int64) for s in sorted(sets, key=sets.get)]
    limit = _limits(setid, nbytes, members, bucket_bytes)
    tensor, recv, setid, lo, hi, nbytes = _split(tensor, recv, setid, lo, hi, nbytes, limit, tensors)
    sender = _assign(setid, recv, nbytes, members, holders.world)
    pairs = np.bincount(sender * needs.world + recv, weights=nbytes, minlength=holders.world * needs.world)
    turn = greedy_order(pairs.reshape(holders.world, needs.world))[sender, recv]
    order = np.lexsort((lo[:, 0], tensor, turn, sender))
    return SlicePlan(tensors, holders.world, needs.world, bucket_bytes, tensor[order], sender[order], recv[order],
                     lo[order], hi[order], nbytes[order])


def check_plan(plan: SlicePlan, needs: Slicing) -> None:
    """Cheap whole-plan check (the tests check byte by byte on small cases): the pieces for every
    (tensor, receiver) add up to exactly what that receiver needs of that tensor."""
    key = plan.tensor.astype(np.int64) * plan.receivers + plan.receiver
    got = np.bincount(key, weights=plan.nbytes, minlength=len(plan.tensors) * plan.receivers)
    want = np.zeros_like(got)
    for i, (t, p) in enumerate(zip(needs.tensors, needs.placements)):
        for box, ranks in zip(p.boxes, p.ranks):
            want[i * plan.receivers + np.asarray(ranks)] += box.numel * t.itemsize
    bad = np.flatnonzero(got != want)
    if len(bad):
        i, r = divmod(int(bad[0]), plan.receivers)
        raise AssertionError(f"plan gives receiver {r} {int(got[bad[0]])} bytes of {plan.tensors[i].name}, "
                             f"it needs {int(want[bad[0]])}")


def _check_same_tensors(holders: Slicing, needs: Slicing) -> None:
    for a, b in zip(holders.tensors, needs.tensors):
        if a != b:
            raise ValueError(f"trainers and inference ranks disagree about a tensor: {a} vs {b}")
    if len(holders.tensors) != len(needs.tensors):
        raise ValueError(f"trainers hold {len(holders.tensors)} tensors, inference ranks need {len(needs.tensors)}")


def _arrays(boxes, nd):
    lo = np.zeros((len(boxes), nd), dtype=np.int64)
    hi = np.ones((len(boxes), nd), dtype=np.int64)
    for i, b in enumerate(boxes):
        lo[i, :len(b.start)], hi[i, :len(b.stop)] = b.start, b.stop
    return lo, hi


def _class_pieces(t, idx, held, needed, nd, sets):
    """The pieces of every tensor in one class: intersections of needed and held boxes, one per receiver."""
    hlo, hhi = _arrays(held.boxes, nd)
    nlo, nhi = _arrays(needed.boxes, nd)
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
    m = len(idx)
    tensor = np.repeat(np.asarray(idx, dtype=np.int64), len(rep))
    return (tensor, np.tile(recv, m), np.tile(set_of_box[h[rep]], m), np.tile(lo[h, n][rep], (m, 1)),
            np.tile(hi[h, n][rep], (m, 1)), np.tile(vol[h, n][rep] * t.itemsize, m))


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


def _limits(setid, nbytes, members, bucket_bytes):
    """Largest piece allowed: a bucket, or less where a replica set needs finer cuts to balance."""
    sizes = np.array([len(m) for m in members])
    total = np.bincount(setid, weights=nbytes, minlength=len(members))
    grain = np.where(sizes > 1, total / (np.maximum(sizes, 1) * BALANCE_GRAIN), np.inf)
    return np.maximum(1, np.minimum(bucket_bytes, grain[setid])).astype(np.int64)


def _split(tensor, recv, setid, lo, hi, nbytes, limit, tensors):
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
        lo, hi = lo[rep].copy(), hi[rep].copy()
        base = lo[rows, d]
        lo[rows, d] = base + w * j // p
        hi[rows, d] = base + w * (j + 1) // p
        item = np.array([t.itemsize for t in tensors], dtype=np.int64)[tensor[rep]]
        tensor, recv, setid, limit = tensor[rep], recv[rep], setid[rep], limit[rep]
        nbytes = np.prod(hi - lo, axis=1) * item
    return tensor, recv, setid, lo, hi, nbytes


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
