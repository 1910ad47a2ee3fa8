"""Sending a version over slices: each bucket packed from this rank's shard, to the one receiver
that needs it.

The flat path (transfer.VersionSender) sends every bucket to every inference rank. Over slices a
bucket is one receiver's (slicepath.SliceBucket): runs of boxes of the global tensors, at their
offsets in that receiver's local layout. The sender packs each run from its local tensors (its
dim-0 rows of every tensor; a row-parallel box is a strided view of them), casting on the way
(float32 master weights to the transfer dtype), into one of `depth` send buffers allocated and
registered once, and hands the bucket to the transport right behind the packing, while the
previous buckets are still on the wire. The checksums are per receiver ({receiver: {offset:
xxh3_64}}): the controller computes every receiver's digest from them, and each receiver its own
from what it received (transfer.VersionReceiver), so a sliced version is verified exactly as
strongly as a whole one. Delta versions are not sent over slices.
"""

from __future__ import annotations

import time
from typing import Callable

import xxhash

from weightsync.model import flat
from weightsync.plan.sliced import Part, SliceBucket, SlicedPlan
from weightsync.transfer.send import BufferRing, SentVersion, end_version, send_buffers
from weightsync.transport.base import Filling, Sender
from weightsync.transport.checksum import CHUNK, bucket_checksum


class SliceSender:
    """Sends this trainer rank's buckets of each version. `params` passed to send() are its local
    tensors in the layout's order: each the dim-0 rows the plan's holdings give this rank."""

    def __init__(self, sender: Sender, plan: SlicedPlan, trainer_rank: int, depth: int = 2, cast_threads: int = 1):
        if depth < 1:
            raise ValueError("the pipeline depth must be at least 1")
        self.sender, self.plan, self.rank, self.depth = sender, plan, trainer_rank, depth
        self.buckets = plan.buckets_of(trainer_rank)
        self.starts = plan.holdings[trainer_rank].starts(plan.layout)
        self.first = [a for a, _ in plan.holdings[trainer_rank].rows]
        self.dtype = flat.torch_dtype(plan.layout.dtype)
        self.cast_threads = cast_threads
        self.buffers: list | None = None

    @property
    def kept_bytes(self) -> int:
        return 0

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers) if self.buffers else 0

    def _buffers(self, params) -> list:
        if self.buffers is None:
            self.buffers = send_buffers(self.sender, params, max(b.length for b in self.buckets),
                                        min(self.depth, len(self.buckets)))
        return self.buffers

    def send(self, version: int, params, peers: list[int] | None = None, lose_peers: bool = False,
             after_bucket: Callable[[int], None] | None = None, bases: dict | None = None) -> SentVersion:
        """Send this rank's buckets of `version` to `peers` (every inference rank by default),
        as transfer.VersionSender.send does; `bases` must name no patches (none are sent here)."""
        if bases and any(b is not None for b in bases.values()):
            raise ValueError("delta versions are not sent over slices")
        flat.check_sources(self.plan.layout, params, self.starts)
        start = time.monotonic()
        wanted = set(range(self.plan.inferences) if peers is None else peers)
        todo = [b for b in self.buckets if b.receiver in wanted]
        fillings: dict[int, dict[int, Filling]] = {}
        if todo:
            ring = BufferRing(self._buffers(params))
            for k, b in enumerate(todo):
                filling = fillings.setdefault(b.receiver, {})[b.offset] = Filling(b.length)
                data, inflight = ring.take(b.length)
                inflight.append(self.sender.send(b.receiver, version, b.offset, data, filling))
                try:
                    self._fill(params, b, data, filling)
                except BaseException as e:
                    filling.fail(e)
                    raise
                if after_bucket is not None:
                    after_bucket(k)
        lost = end_version(self.sender, version, lose_peers)
        sums = {r: {o: f.result() for o, f in by.items()} for r, by in fillings.items() if r not in lost}
        total = sum(b.length for b in todo)
        return SentVersion(version, total, time.monotonic() - start, {}, lost, wire_bytes=total, receiver_checksums=sums)

    def _fill(self, params, bucket: SliceBucket, data, filling: Filling) -> None:
        """Pack the bucket's runs into `data`, the gaps between them zero; host buffers are hashed
        and handed to the transport run by run (large runs in chunks of about CHUNK bytes)."""
        import torch

        if data.device.type == "cuda":
            self._pack_all(params, bucket, data)
            torch.cuda.current_stream(data.device).synchronize()
            filling.finish(bucket_checksum(data))
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(self.cast_threads)
        try:
            h = xxhash.xxh3_64()
            view = memoryview(data.numpy())
            pos = 0
            for part in bucket.parts:
                if part.at > pos:
                    data[pos:part.at].zero_()
                for at, box, n in _chunks(part):
                    self._pack(params, part.tensor, box, data[at:at + n])
                    h.update(view[pos:at + n])
                    pos = at + n
                    filling.advance(pos)
            filling.finish(h.intdigest())
        finally:
            torch.set_num_threads(threads)

    def _pack_all(self, params, bucket: SliceBucket, data) -> None:
        pos = 0
        for part in bucket.parts:
            if part.at > pos:
                data[pos:part.at].zero_()
            self._pack(params, part.tensor, part.box, data[part.at:part.at + part.nbytes])
            pos = part.at + part.nbytes

    def _pack(self, params, tensor: int, box, dest) -> None:
        """Cast the elements `box` of the global tensor #tensor from this rank's shard into `dest`."""
        src = params[tensor].detach()
        if box.start:
            first = self.first[tensor]
            index = (slice(box.start[0] - first, box.stop[0] - first),) + tuple(slice(a, b) for a, b in zip(box.start[1:], box.stop[1:]))
            src = src[index]
        if src.is_contiguous():
            flat.cast_into(dest, src.reshape(-1), self.dtype)
        else:  # a strided box (row-parallel): one pass that gathers and casts
            dest.view(self.dtype).view(src.shape).copy_(src)


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
