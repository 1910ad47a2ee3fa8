"""Buckets for checking the GPU's fused cast and checksum (ws64_kernels.bucket_ws64, through the
packers' fill_checksummed) against the definition, small enough for Triton's interpreter: a
layout whose slots sit at offsets that are no word's boundary (4-byte alignment, uint8 slots of
odd lengths, a float32 slot the kernel does not cast), float32 sources with NaNs, infinities,
subnormals and rounding ties, and buckets of one run, of several runs, and of a run that starts at
an odd byte (its bfloat16 runs then land at odd offsets, which torch casts and the kernel reads
back)."""

from __future__ import annotations

import torch

from weightsync.model.flat import FlatLayout
from weightsync.plan.segments import Bucket

SHAPES = [("a", (37,)), ("u", (5,), "uint8"), ("b", (300,)), ("c", (3,)), ("q", (7,), "uint8"), ("d", (1000,)),
          ("s", (2,), "float32"), ("f", (513,)), ("g", (1,))]


def layout() -> FlatLayout:
    return FlatLayout.from_shapes(SHAPES, "bfloat16", align=4)


def params(flat: FlatLayout) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = []
    for slot in flat.slots:
        if slot.dtype == "uint8":
            out.append(torch.randint(0, 256, slot.shape, dtype=torch.uint8, generator=g))
            continue
        x = torch.randn(slot.shape, generator=g) * 1e3
        special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-40, -3e-39, 0.0, -0.0,
                                1.00390625, 1.01171875])  # the last two: ties, rounded to even down and up
        x.view(-1)[:min(x.numel(), special.numel())] = special[:x.numel()]
        out.append(x)
    return out


def buckets(flat: FlatLayout) -> list[Bucket]:
    """A bucket of every slot; one of two runs, each from inside one slot to inside another; one
    from an odd byte (inside u), whose bfloat16 runs then lie at odd offsets."""
    at = {s.name: s.offset for s in flat.slots}
    first = (at["u"] + 2, at["c"] + 2 - at["u"] - 2)
    second = (at["d"] + 1300, at["s"] + 8 - at["d"] - 1300)
    odd = at["u"] + 1
    return [Bucket(0, 0, 0, flat.total_bytes),
            Bucket(1, 0, first[0], first[1] + second[1], parts=(first, second)),
            Bucket(2, 0, odd, at["d"] + 376 - odd)]


def sliced():
    """(packer, buckets) of trainer rank 0 of a version over slices (slice_peer's model in
    bfloat16 from float32 rows, two trainer shards, TP 2 and 1): boxes of rows (contiguous, the
    kernel casts them) and of columns (strided, gathered by torch), at the receivers' offsets."""
    from support import slice_peer
    from weightsync.transfer.pack import packer_for

    _, plan = slice_peer.make(slice_peer.parser().parse_args(["--shard", "2", "--dtype", "bfloat16"]))
    local = [t[a:b].clone() for t, (a, b) in zip(slice_peer.full_tensors(1), plan.holdings[0].rows)]
    return packer_for(plan, 0, local), plan.buckets_of(0)
