"""Sending one weight version: the pipelined sender, one for every plan.

The trainer roles, the trainer API (publisher/sync.py) and `weightsync bench` all use exactly
this code. A trainer rank sends the buckets the plan gives it (interface.TransferPlan: a whole
version's, where every bucket goes to every inference rank, or a version over slices, where each
goes to the one receiver whose slices it holds): each bucket is packed into a send buffer (cast,
and over slices gathered, by pack.py) chunk by chunk and streamed to its peers right behind the
packing, while earlier buckets are still on the wire (`depth` buffers of one bucket each,
allocated once and registered with the transport once). A host buffer is hashed chunk by chunk
while the chunk is in cache; a GPU buffer is packed and hashed (ws64) in one pass (pack.py's
fill_checksummed) on a side stream of its own, after what the caller's stream did to the
parameters, with no device-wide synchronize, so the transport's own stream keeps sending the
previous bucket meanwhile. Where no cast is needed
(host tensors in the transfer dtype, a transport that takes them) a whole version's bytes go
straight from the parameters.

With delta versions on (delta.py; whole versions only), a trainer rank keeps what it sent last
and sends a bucket to an inference rank that holds that version as a patch; the receiver applies
it against the version it holds. The checksums are of the new bytes either way. Who gets patches
is the caller's word (`bases`, from the controller); the sender also checks that it still keeps
that base.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

import xxhash

from weightsync.model import flat
from weightsync.plan.interface import TransferBucket, TransferPlan
from weightsync.transfer.delta import LastSent
from weightsync.transfer.pack import Packer, packer_for
from weightsync.transport.base import Filling, PeersFailed, Sender
from weightsync.transport.checksum import U64, as_views, checksum_of


def send_buffers(sender: Sender, params, size: int, count: int) -> list:
    """`count` send buffers of `size` bytes, registered with the transport once: on the GPU of
    the parameters where the transport sends from GPU memory, else in host memory (pinned when
    the parameters are on a GPU, as the host staging of device tensors)."""
    import torch

    on_gpu = any(p.device.type == "cuda" for p in params)
    if sender.capabilities.buffer_device == "cuda" and on_gpu:
        kwargs = {"device": next(p.device for p in params if p.device.type == "cuda")}
    else:
        kwargs = {"pin_memory": on_gpu}
    buffers = [torch.empty(size, dtype=torch.uint8, **kwargs) for _ in range(count)]
    sender.register(buffers)
    return buffers


class BufferRing:
    """The send buffers, used in turn: each bucket takes the next bytes of the current buffer, so
    that many small buckets (FSDP2 shards: a few rows of every tensor) share one buffer instead of
    each taking a whole one and draining the pipeline; moving on to a buffer first waits until
    what was last sent from it is off the wire (a failure there is end_version's to raise)."""

    def __init__(self, buffers: list):
        self.buffers = buffers
        self.current, self.used = 0, 0
        self.inflight: list[list[Future]] = [[] for _ in buffers]

    def take(self, length: int):
        """(`length` bytes of a buffer, the list to add the futures that send them to)."""
        if self.used + length > self.buffers[self.current].numel():
            self.current, self.used = (self.current + 1) % len(self.buffers), 0
            wait(self.inflight[self.current])
            self.inflight[self.current] = []
        data = self.buffers[self.current][self.used:self.used + length]
        self.used += -(-length // flat.ALIGN) * flat.ALIGN
        return data, self.inflight[self.current]


@dataclass
class SentVersion:
    version: int
    bytes: int  # this rank's share of the version (each bucket once, however many peers received it)
    seconds: float
    checksums: dict = field(default_factory=dict)  # {offset: xxh3_64} of this rank's buckets that every peer gets
    lost: dict = field(default_factory=dict)  # {peer: why} the peers it could not send to
    wire_bytes: int = 0  # what it put on the wire for all peers: whole ranges, patches, ranges re-sent whole
    patched_peers: int = 0  # peers that were sent patches (the others got every range whole)
    changed: int = 0  # elements that changed since the base, in the buckets sent as patches
    compared: int = 0  # elements compared there
    receiver_checksums: dict = field(default_factory=dict)  # over slices: {peer: {offset: xxh3_64}} of each peer's own
    phases: dict = field(default_factory=dict)  # delta versions: {phase: seconds} (phases.py), of every thread


def end_version(sender: Sender, version: int, lose_peers: bool) -> dict[int, str]:
    """End the version on every peer; {peer: why} of those it could not be sent to (with
    lose_peers; without, PeersFailed is raised)."""
    try:
        sender.end_version(version)
    except PeersFailed as e:
        if not lose_peers:
            raise
        return {peer: str(error) for peer, error in e.failed.items()}
    return {}



class VersionSender:
    """Sends this trainer rank's share of each version to the inference ranks.

    `params` passed to send() are the model's tensors in the plan's layout order (what
    FlatLayout.from_named_tensors was given), in any dtype and on any device: they are cast to
    the layout's dtype on the way. With `starts` they are this rank's shards (FSDP2: each its
    local rows, beginning at element starts[i] of its tensor), and the plan gives this rank only
    bytes it holds (holders.plan_by_holder); over slices the plan itself says which rows the rank
    holds. Send buffers: `depth` buffers of the plan's largest bucket, allocated on the first
    version that needs them, then reused; buffer_bytes says how much that is. The cast of host
    tensors runs on `cast_threads` intra-op threads (one thread casting cache-sized chunks leaves
    the other cores to the connections, which run at the same time).

    With `delta` (whole versions only), the rank keeps its share of the last version it sent
    (LastSent: kept_bytes, one share of a version in the layout's dtype) and every bucket goes
    through a send buffer, also without a cast, to be compared with it and kept; chunks are
    encoded on `delta_threads` threads, the first beside the cast of the next chunk."""

    def __init__(self, sender: Sender, plan: TransferPlan, trainer_rank: int, bucket_bytes: int | None = None,
                 depth: int = 2, cast_threads: int = 1, delta: bool = False, delta_threads: int = 2,
                 starts: Sequence[int] | None = None, tamper: Callable[..., None] | None = None):
        if depth < 1:
            raise ValueError("the pipeline depth must be at least 1")
        if delta and not (sender.capabilities.patches and sender.capabilities.buffer_device == "cpu"):
            raise ValueError(f"the {type(sender).__name__} transport carries no patches: delta versions need tcp")
        if delta and plan.sliced:
            raise ValueError("delta versions are not sent over slices")
        self.sender, self.plan, self.rank, self.depth = sender, plan, trainer_rank, depth
        self.starts = starts  # shards: the element of its tensor each param begins at (flat.check_sources)
        self.buckets = plan.buckets_of(trainer_rank)
        self.bucket_bytes = bucket_bytes or plan.bucket_bytes
        if self.buckets and max(b.length for b in self.buckets) > self.bucket_bytes:
            raise ValueError(f"bucket_bytes {self.bucket_bytes} is smaller than the plan's buckets ({plan.bucket_bytes})")
        self.peers = list(range(plan.inferences))
        self.cast_threads = cast_threads
        self.buffers: list | None = None
        self.last = LastSent(self.buckets, plan.layout.itemsize, delta_threads) if delta else None
        # Tests only: tamper(version, chunk) may change a chunk of a send buffer after it was
        # hashed and before it goes out, as a bad link would (runtime/faults.py tamper_hook).
        self.tamper = tamper
        self.version: int | None = None  # being sent
        self.cast_stream = None  # GPU send buffers: the stream their cast runs on

    @property
    def kept_bytes(self) -> int:
        """Host memory holding the last version sent (delta versions), in bytes."""
        return self.last.nbytes if self.last is not None else 0

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers) if self.buffers else 0

    def _buffers(self, params) -> list:
        if self.buffers is None:
            size = max(b.length for b in self.buckets)
            self.buffers = send_buffers(self.sender, params, size, min(self.depth, len(self.buckets)))
        return self.buffers

    def send(self, version: int, params, peers: list[int] | None = None, lose_peers: bool = False,
             after_bucket: Callable[[int], None] | None = None, bases: dict[int, int | None] | None = None) -> SentVersion:
        """Send this rank's share of `version` to `peers` (every inference rank by default): each
        bucket to every one of them, or over slices to its receiver where that is one of them.
        With lose_peers a peer that fails (its process died) is named in SentVersion.lost and
        the others get all of it; without, PeersFailed is raised. after_bucket(k) runs once the
        k-th bucket sent is handed to the transport. With delta versions, `bases` ({inference
        rank: the version it holds, or None}) names the peers that may get patches; without,
        every bucket goes whole."""
        packer = packer_for(self.plan, self.rank, params, self.starts)
        start = time.monotonic()
        self.version = version
        peers = self.peers if peers is None else list(peers)
        if self.last is not None and self.buckets:
            return self._send_keeping(version, packer, params, peers, lose_peers, after_bucket, bases or {}, start)
        # each bucket with the peers it goes to: all of them, or over slices its receiver if wanted
        todo = [(b, to) for b in self.buckets
                if (to := peers if b.receiver is None else [b.receiver] if b.receiver in peers else [])]
        if not todo:  # no receiver expects a word from this rank
            if self.last is not None:
                self.last.version = version  # it keeps nothing: every version is as good a base
            return SentVersion(version, 0, 0.0, {})
        in_place = self.sender.capabilities.in_place and packer.in_place
        ring = None if in_place else BufferRing(self._buffers(params))
        fillings: list[Filling] = []
        for k, (b, to) in enumerate(todo):
            filling = Filling(b.length)
            fillings.append(filling)
            if in_place:
                self._send_in_place(version, packer, b, to, k, filling)
            else:
                data, inflight = ring.take(b.length)
                inflight.extend(self.sender.send(p, version, b.offset, data, filling) for p in to)
                try:
                    self._fill(packer, b, data, filling)
                except BaseException as e:
                    filling.fail(e)
                    raise
            if after_bucket is not None:
                after_bucket(k)
        lost = end_version(self.sender, version, lose_peers)
        sums: dict[int, int] = {}
        own: dict[int, dict[int, int]] = {}  # over slices: each receiver's buckets
        for (b, to), filling in zip(todo, fillings):
            if b.receiver is None:
                sums[b.offset] = filling.result()
            elif b.receiver not in lost:
                own.setdefault(b.receiver, {})[b.offset] = filling.result()
        return SentVersion(version, sum(b.length for b, _ in todo), time.monotonic() - start, sums, lost,
                           wire_bytes=sum(b.length * len(to) for b, to in todo), receiver_checksums=own)

    def _send_in_place(self, version: int, packer: Packer, bucket: TransferBucket, peers: list[int], k: int,
                       filling: Filling) -> None:
        """Send a bucket straight from the parameters: one peer's connection hashes the bytes as
        it sends them (while they are in cache; the peers take turns by bucket); the others send
        them at once and take that checksum when it is there."""
        data = packer.views(bucket)
        hasher = peers[k % len(peers)]
        hashed = self.sender.send(hasher, version, bucket.offset, data)
        # a hasher that failed (its peer went away) leaves the checksum to this side
        hashed.add_done_callback(lambda f: filling.finish(
            f.result() if f.exception() is None else checksum_of(as_views(data))))
        filling.advance(bucket.length)
        for p in peers:
            if p != hasher:
                self.sender.send(p, version, bucket.offset, data, filling)

    def _fill(self, packer: Packer, bucket: TransferBucket, data, filling: Filling, each=None) -> None:
        """Pack the bucket into `data` and give `filling` its checksum; host buffers in
        cache-sized chunks, each hashed while it is still in cache and handed to the
        transport at once, then to each(start, end) when given."""
        import torch

        if data.device.type == "cuda":
            # the cast and the checksum (ws64, on the GPU) in one pass (the kernel casts float32
            # runs to bfloat16 and sums their words while they are in registers), on a stream of
            # their own, after what the caller's stream did to the parameters; waiting for the
            # checksum waits for that stream alone, while the transport's own stream still sends
            # the previous bucket
            stream = self._stream(data.device)
            stream.wait_stream(torch.cuda.current_stream(data.device))
            with torch.cuda.stream(stream):
                checksum = int(packer.fill_checksummed(bucket, data)) & U64
            if self.tamper is not None:
                first = data[:1].cpu()
                self.tamper(self.version, memoryview(first.numpy()))
                data[:1].copy_(first)
            filling.finish(checksum)
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(self.cast_threads)
        try:
            h = xxhash.xxh3_64()
            view = memoryview(data.numpy())
            a = 0
            phases = self.last.encoders.phases if self.last is not None else None
            clock = time.perf_counter()
            for b in packer.steps(bucket, data):
                cast = time.perf_counter()
                h.update(view[a:b])
                if phases is not None:
                    hashed = time.perf_counter()
                    phases.add("cast", cast - clock)
                    phases.add("hash", hashed - cast)
                if self.tamper is not None:  # the version's byte at a, where the bucket is one run of it
                    self.tamper(self.version, view[a:b], None if getattr(bucket, "parts", None) else bucket.offset + a)
                filling.advance(b)
                if each is not None:
                    each(a, b)
                a = b
                clock = time.perf_counter()
            filling.finish(h.intdigest())
        finally:
            torch.set_num_threads(threads)

    def _stream(self, device):
        """The side stream the GPU cast runs on, made once."""
        import torch

        if self.cast_stream is None:
            self.cast_stream = torch.cuda.Stream(device)
        return self.cast_stream

    def _send_keeping(self, version: int, packer: Packer, params, peers: list[int], lose_peers: bool,
                      after_bucket: Callable[[int], None] | None, bases: dict, start: float) -> SentVersion:
        """send() with delta versions on. Peers whose base is the version kept get each bucket as
        a patch, unless its first chunk shows that too much changed (then whole, streamed right
        behind the cast like to the other peers); every bucket is kept for the next version, also
        when there is no peer to send it to."""
        last = self.last
        base = last.version
        patched = [p for p in peers if base is not None and bases.get(p) == base]
        whole = [p for p in peers if p not in patched]
        last.version = None  # being overwritten: a failure now leaves nothing to patch against
        last.encoders.phases.take()
        ring = BufferRing(self._buffers(params))
        fillings: dict[int, Filling] = {}
        resent: list[int] = []
        wire = changed = compared = 0
        for k, b in enumerate(self.buckets):
            filling = fillings[b.offset] = Filling(b.length)
            data, futures = ring.take(b.length)
            futures.extend(self.sender.send(p, version, b.offset, data, filling) for p in whole)
            encoder = last.encoder(b.offset, base if patched else None)

            def again(b=b):  # the peer could not apply the patch: the bucket whole, as kept
                resent.append(b.length)
                return last.bucket(b.offset)

            def keep(a: int, e: int, encoder=encoder, futures=futures, data=data, filling=filling, b=b,
                     host=data.numpy(), again=again) -> None:
                encoder.add(a, host[a:e])
                if a == 0 and patched and encoder.dense:  # too much changed: whole, right behind the cast
                    futures.extend(self.sender.send(p, version, b.offset, data, filling) for p in patched)
                elif a == 0 and patched:  # the patch goes out piece by piece as it is encoded
                    pieces = encoder.stream(b.length)
                    for p in patched:
                        self.sender.send_patch(p, version, b.offset, b.length, pieces, filling, again)

            try:
                self._fill(packer, b, data, filling, keep)
                payload = encoder.finish(b.length) if patched and not encoder.dense else None
            except BaseException as e:
                filling.fail(e)
                if encoder.out is not None:
                    encoder.out.fail(e)
                raise
            wire += b.length * len(whole)
            if patched and encoder.dense:
                wire += b.length * len(patched)
            elif patched:
                wire += sum(len(part) for part in payload) * len(patched)
                changed, compared = changed + encoder.changed, compared + encoder.compared
            if after_bucket is not None:
                after_bucket(k)
        with last.encoders.phases.timed("wait"):  # for the wire (and the peers' verdicts) after the last bucket
            lost = end_version(self.sender, version, lose_peers)
        last.version = version  # every bucket was kept, whoever received it
        sums = {offset: filling.result() for offset, filling in fillings.items()}
        total = sum(b.length for b in self.buckets)
        return SentVersion(version, total, time.monotonic() - start, sums, lost, wire_bytes=wire + sum(resent),
                           patched_peers=len(patched), changed=changed, compared=compared,
                           phases=last.encoders.phases.take())
