"""The transfer plan: which trainer rank sends which bytes of a version.

Every inference rank needs the whole version. The version's bytes are cut into one contiguous,
near-equal segment per trainer rank (boundaries on ALIGN bytes, tensors split wherever the cut
falls), and each segment into buckets of at most bucket_bytes. Every byte therefore comes from
exactly one trainer, and all trainers send their share to every inference rank at the same time
(M -> N), instead of one rank broadcasting everything. The controller computes the plan once and
publishes its JSON; each version is then only "go".

A bucket is one run of the version's bytes, or (holders.plan_by_holder over a transport whose
receivers scatter) several runs bundled into one frame: a sharded rank holds one run per tensor,
many of them small, and a frame per run costs more than its bytes. Plan is an
interface.TransferPlan, as sliced_plan.SlicedPlan is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from weightsync.model.flat import ALIGN, FlatLayout


@dataclass(frozen=True)
class Bucket:
    """`length` bytes sent by `trainer` in one frame keyed by `offset`: the run [offset, offset +
    length) of the version, or, with `parts`, the runs (offset, length) of the version in turn
    (the first at `offset`, lengths summing to `length`)."""

    index: int
    trainer: int
    offset: int
    length: int
    parts: tuple[tuple[int, int], ...] = ()

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """The runs (offset, length) of the version this bucket carries, in order."""
        return self.parts or ((self.offset, self.length),)

    @property
    def end(self) -> int:
        """The end of its last run."""
        offset, length = self.spans[-1]
        return offset + length

    @property
    def receiver(self) -> None:
        """Every inference rank receives it."""
        return None


@dataclass(frozen=True)
class Plan:
    """The plan of a version every inference rank receives whole (interface.TransferPlan)."""

    layout: FlatLayout
    trainers: int
    inferences: int
    bucket_bytes: int
    buckets: list
    sliced = False  # every inference rank receives the whole version (sliced_plan.SlicedPlan: slices)

    def buckets_of(self, trainer: int) -> list[Bucket]:
        return [b for b in self.buckets if b.trainer == trainer]

    def ranges_of(self, trainer: int) -> list[tuple[int, int]]:
        """(offset, length) of every bucket the trainer sends, in sending order."""
        return [(b.offset, b.length) for b in self.buckets_of(trainer)]

    def expected(self) -> dict[int, list[tuple[int, int]]]:
        """What each inference rank receives, by trainer rank (trainers with no work left out)."""
        return {t: r for t in range(self.trainers) if (r := self.ranges_of(t))}

    def expected_for(self, inference: int) -> dict[int, list[tuple[int, int]]]:
        """What inference rank `inference` receives: the whole version, like every other."""
        return self.expected()

    def scatter_for(self, inference: int) -> dict[int, tuple[tuple[int, int], ...]]:
        """{offset: runs} of the buckets inference rank `inference` receives that bundle several runs."""
        return {b.offset: b.parts for b in self.buckets if b.parts}

    def bytes_for(self, inference: int) -> int:
        """The size of an inference rank's staging buffer: the whole version."""
        return self.layout.total_bytes

    def bytes_by_trainer(self) -> list[int]:
        out = [0] * self.trainers
        for b in self.buckets:
            out[b.trainer] += b.length
        return out

    def balance(self) -> float:
        """Largest trainer share over the mean share (1.0 is perfect)."""
        shares = self.bytes_by_trainer()
        mean = sum(shares) / len(shares)
        return max(shares) / mean if mean else 1.0

    @property
    def version_bytes(self) -> int:
        return self.layout.total_bytes

    def to_json(self) -> str:
        return json.dumps({"layout": json.loads(self.layout.to_json()), "trainers": self.trainers,
                           "inferences": self.inferences, "bucket_bytes": self.bucket_bytes,
                           "buckets": [[b.trainer, b.offset, b.length] + ([[list(p) for p in b.parts]] if b.parts else [])
                                       for b in self.buckets]})

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        obj = json.loads(text)
        buckets = [Bucket(i, t, o, n, tuple(tuple(p) for p in parts[0]) if parts else ())
                   for i, (t, o, n, *parts) in enumerate(obj["buckets"])]
        return cls(FlatLayout.from_json(json.dumps(obj["layout"])), obj["trainers"], obj["inferences"],
                   obj["bucket_bytes"], buckets)

    def table(self) -> str:
        """The plan as text: one row per trainer rank, then the totals and the balance."""
        shares = self.bytes_by_trainer()
        tensors = {t: _tensor_names(self, t) for t in range(self.trainers)}
        lines = [f"version: {len(self.layout.slots)} tensors, {size_text(self.version_bytes)} as {self.layout.dtype}; "
                 f"{self.trainers} trainer rank(s) -> {self.inferences} inference rank(s); "
                 f"buckets of at most {size_text(self.bucket_bytes)}",
                 f"{'trainer':>7}  {'bytes':>12}  {'share':>6}  {'buckets':>7}  {'peers':>5}  {'sends':>12}  tensors"]
        for t in range(self.trainers):
            n = len(self.buckets_of(t))
            peers = self.inferences if n else 0
            lines.append(f"{t:>7}  {size_text(shares[t]):>12}  {shares[t] / max(1, self.version_bytes):>6.1%}  {n:>7}  "
                         f"{peers:>5}  {size_text(shares[t] * peers):>12}  {tensors[t]}")
        lines.append(f"{'total':>7}  {size_text(sum(shares)):>12}  {'':>6}  {len(self.buckets):>7}  {'':>5}  "
                     f"{size_text(sum(shares) * self.inferences):>12}")
        lines.append(f"balance (largest trainer share / mean): {self.balance():.3f}")
        return "\n".join(lines)


def make_plan(layout: FlatLayout, trainers: int, inferences: int, bucket_bytes: int) -> Plan:
    if trainers < 1 or inferences < 1:
        raise ValueError(f"a plan needs at least one trainer and one inference rank (got {trainers} and {inferences})")
    if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise ValueError(f"bucket size must be a positive multiple of {ALIGN} bytes, got {bucket_bytes}")
    total = layout.total_bytes
    if total % ALIGN:
        raise ValueError(f"the layout's total ({total} bytes) is not a multiple of {ALIGN}")
    units = total // ALIGN
    # trainer t owns units [cuts[t], cuts[t+1]): near-equal integer shares, larger ones first
    cuts = [t * units // trainers for t in range(trainers + 1)]
    buckets: list[Bucket] = []
    for t in range(trainers):
        start, end = cuts[t] * ALIGN, cuts[t + 1] * ALIGN
        for offset in range(start, end, bucket_bytes):
            buckets.append(Bucket(len(buckets), t, offset, min(bucket_bytes, end - offset)))
    return Plan(layout, trainers, inferences, bucket_bytes, buckets)


def _tensor_names(plan: Plan, trainer: int) -> str:
    buckets = plan.buckets_of(trainer)
    if not buckets:
        return "-"
    names = []
    for _, slot, _, _ in plan.layout.overlapping(buckets[0].offset, buckets[-1].end):
        names.append(slot.name)
    if not names:
        return "(padding)"
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"

