"""How a bucket's bytes are made from a trainer rank's tensors: the packers the send pipeline runs.

The send pipeline (send.py) is one for every plan; what differs is what a bucket is made of. A
bucket of a whole version (segments.Bucket) is one or more runs of the flat layout's bytes:
RangePacker casts each run straight from the rank's tensors (whole, or its FSDP2 shards from
`starts`) into the send buffer, padding zero, and where every tensor already holds the layout's
bytes in host memory it hands the runs out as views of the tensors themselves (the in-place
send, no copy at all). A bucket over slices (sliced_plan.SliceBucket) is runs of boxes of the global
tensors, at their offsets in one receiver's local layout: SlicePacker packs each from the rank's
dim-0 rows (a row-parallel box is a strided view of them), casting on the way (float32 master
weights to the transfer dtype), the padding between runs zero.

A packer fills a bucket's buffer in one go (a GPU buffer, on the pipeline's side stream) or step
by step in pieces of about CHUNK bytes (a host buffer: the pipeline hashes each piece while it is
still in cache and lets the transport send it at once). On a GPU it fills the buffer and gives
the bucket's ws64 in one pass (fill_checksummed): each contiguous float32 run that becomes
bfloat16 is cast by the checksum's kernel, which adds the run's words while they are in
registers (ws64_kernels.bucket_ws64); other runs are cast by torch and read back once.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

from weightsync.model import flat
from weightsync.plan.holders import Holdings
from weightsync.plan.interface import TransferBucket, TransferPlan
from weightsync.plan.rank_plan import RankPlan
from weightsync.plan.segments import Bucket
from weightsync.plan.sliced_plan import Part, SliceBucket, SlicedPlan
from weightsync.transport.checksum import CHUNK
from weightsync.transport.ws64_kernels import Piece, bucket_ws64, castable


class Packer(Protocol):
    """Makes the bytes of one trainer rank's buckets from its tensors (those of one version)."""

    @property
    def in_place(self) -> bool:
        """Whether views() may be sent instead of filled send buffers."""

    def views(self, bucket: TransferBucket) -> list[memoryview]:
        """The bucket's bytes as views into the tensors' memory (only where in_place)."""

    def fill(self, bucket: TransferBucket, data) -> None:
        """Write the bucket's bytes into the uint8 tensor `data` (its length), in one go."""

    def steps(self, bucket: TransferBucket, data) -> Iterator[int]:
        """Write the bucket's bytes into `data` front to back, yielding after each piece of about
        CHUNK bytes how many bytes are written."""

    def fill_checksummed(self, bucket: TransferBucket, data):
        """fill() and the bucket's ws64 (a 0-dim int64 tensor on data's device), on the current
        stream, in one pass over the bytes where the kernel casts."""


def packer_for(plan: TransferPlan, trainer: int, params: Sequence, starts: Sequence[int] | None = None) -> Packer:
    """The packer of trainer rank `trainer`'s buckets of `plan` from `params`, its tensors in the
    layout's order, refused (flat.LayoutMismatch, naming the tensor) where they do not match the
    layout: the whole tensors, or with `starts` its shards (as flat.check_sources says). Over
    slices the plan says which rows the rank holds; `starts`, where given, must say the same."""
    if isinstance(plan, (SlicedPlan, RankPlan)):
        held = plan.holdings[trainer]
        if starts is not None and list(starts) != held.starts(plan.layout):
            raise ValueError(f"trainer rank {trainer} sends from other rows than the plan says it holds")
        return SlicePacker(plan.layout, params, held)
    return RangePacker(plan.layout, params, starts)


class RangePacker:
    """Buckets of runs of the flat layout's bytes (segments.Bucket), cast from the tensors."""

    def __init__(self, layout: flat.FlatLayout, params: Sequence, starts: Sequence[int] | None = None):
        flat.check_sources(layout, params, starts)
        self.layout, self.params, self.starts = layout, params, starts

    @property
    def in_place(self) -> bool:
        """Every tensor already holds the layout's bytes (same dtype, contiguous, in host memory)."""
        return flat.can_send_in_place(self.layout, self.params)

    def views(self, bucket: Bucket) -> list[memoryview]:
        return [v for offset, length in bucket.spans
                for v in flat.range_views(self.layout, self.params, offset, offset + length, self.starts)]

    def fill(self, bucket: Bucket, data) -> None:
        for offset, length, at in _runs(bucket):
            flat.fill_range(self.layout, self.params, offset, offset + length, data[at:at + length], self.starts)

    def fill_checksummed(self, bucket: Bucket, data):
        pieces, pos = [], 0
        for offset, length, at in _runs(bucket):
            for lo, nbytes, src, dtype in flat.range_parts(self.layout, self.params, offset, offset + length,
                                                           self.starts):
                if at + lo > pos:
                    data[pos:at + lo].zero_()
                pieces.append(_piece(data, at + lo, nbytes, src, dtype))
                pos = at + lo + nbytes
        if pos < bucket.length:
            data[pos:bucket.length].zero_()
        return bucket_ws64(data, pieces)

    def steps(self, bucket: Bucket, data) -> Iterator[int]:
        """Chunks of exactly CHUNK bytes of the bucket (the last one shorter): delta versions
        compare and keep a bucket chunk by chunk."""
        runs, r = _runs(bucket), 0
        for a in range(0, bucket.length, CHUNK):
            b = min(a + CHUNK, bucket.length)
            while r < len(runs) and runs[r][2] < b:  # the runs this chunk overlaps
                offset, length, at = runs[r]
                lo, hi = max(a, at), min(b, at + length)
                flat.fill_range(self.layout, self.params, offset + lo - at, offset + hi - at, data[lo:hi], self.starts)
                if at + length > b:
                    break
                r += 1
            yield b


def _piece(data, at: int, nbytes: int, src, dtype) -> Piece:
    """The bucket's bytes [at, at + nbytes) from the contiguous `src` in `dtype`: cast by the
    checksum's kernel where it casts them (float32 to bfloat16), else cast here and read back."""
    import torch

    if dtype == torch.bfloat16 and castable(data, at, src):
        return Piece(at, nbytes, src)
    flat.cast_into(data[at:at + nbytes], src, dtype)
    return Piece(at, nbytes)


def _runs(bucket: Bucket) -> list[tuple[int, int, int]]:
    """(offset in the version, length, offset in the bucket's bytes) of every run of the bucket."""
    out, at = [], 0
    for offset, length in bucket.spans:
        out.append((offset, length, at))
        at += length
    return out


class SlicePacker:
    """Buckets of boxes of the global tensors (sliced_plan.SliceBucket), packed and cast from the
    rank's local tensors: each the dim-0 rows `held` gives it."""

    in_place = False  # a box is packed (a row-parallel one is strided): never sent from the tensors

    def __init__(self, layout: flat.FlatLayout, params: Sequence, held: Holdings):
        flat.check_sources(layout, params, held.starts(layout))
        self.params = params
        self.first = [a for a, _ in held.rows]
        self.dtypes = [flat.torch_dtype(s.dtype) for s in layout.slots]  # each tensor's own (a quantized version's)

    def views(self, bucket: SliceBucket) -> list[memoryview]:
        raise ValueError("a bucket over slices is packed into a send buffer, never sent from the tensors")

    def fill(self, bucket: SliceBucket, data) -> None:
        pos = 0
        for part in bucket.parts:
            if part.at > pos:
                data[pos:part.at].zero_()
            self._pack(part.tensor, part.box, data[part.at:part.at + part.nbytes])
            pos = part.at + part.nbytes

    def fill_checksummed(self, bucket: SliceBucket, data):
        pieces, pos = [], 0
        for part in bucket.parts:
            if part.at > pos:
                data[pos:part.at].zero_()
            src, dtype = self._source(part.tensor, part.box), self.dtypes[part.tensor]
            if src.is_contiguous():
                pieces.append(_piece(data, part.at, part.nbytes, src.reshape(-1), dtype))
            else:  # a strided box: gathered and cast by torch, then read back
                self._pack(part.tensor, part.box, data[part.at:part.at + part.nbytes])
                pieces.append(Piece(part.at, part.nbytes))
            pos = part.at + part.nbytes
        if pos < bucket.length:
            data[pos:bucket.length].zero_()
        return bucket_ws64(data, pieces)

    def steps(self, bucket: SliceBucket, data) -> Iterator[int]:
        """Run by run, a large run in pieces of about CHUNK bytes."""
        pos = 0
        for part in bucket.parts:
            if part.at > pos:
                data[pos:part.at].zero_()
            for at, box, n in _chunks(part):
                self._pack(part.tensor, box, data[at:at + n])
                pos = at + n
                yield pos

    def _source(self, tensor: int, box):
        """The elements `box` of the global tensor #tensor in this rank's shard (a view)."""
        src = self.params[tensor].detach()
        if box.start:
            first = self.first[tensor]
            index = ((slice(box.start[0] - first, box.stop[0] - first),)
                     + tuple(slice(a, b) for a, b in zip(box.start[1:], box.stop[1:])))
            src = src[index]
        return src

    def _pack(self, tensor: int, box, dest) -> None:
        """Cast the elements `box` of the global tensor #tensor from this rank's shard into `dest`."""
        src = self._source(tensor, box)
        dtype = self.dtypes[tensor]
        if src.is_contiguous():
            flat.cast_into(dest, src.reshape(-1), dtype)
        else:  # a strided box (row-parallel): one pass that gathers and casts
            dest.view(dtype).view(src.shape).copy_(src)


def _chunks(part: Part):
    """(byte in the bucket, sub-box, bytes) of a run cut into pieces of about CHUNK bytes along
    its first dim wider than one element (each still one run in the receiver's buffer)."""
    box = part.box
    wide = [d for d, n in enumerate(box.shape) if n != 1]
    if part.nbytes <= CHUNK or not wide:
        yield part.at, box, part.nbytes
        return
    d = wide[0]
    extent = box.shape[d]
    per = part.nbytes // extent  # bytes of one step along d
    step = max(1, CHUNK // per)
    for k in range(box.start[d], box.stop[d], step):
        start, stop = list(box.start), list(box.stop)
        start[d], stop[d] = k, min(k + step, box.stop[d])
        yield part.at + (k - box.start[d]) * per, type(box)(tuple(start), tuple(stop)), (stop[d] - k) * per
