"""Delta versions: a bucket sent as a patch against the bytes its receiver already holds.

In RL fine-tuning a version differs from the one before it in a few percent of its 16-bit
elements (AdamW moves every element by about the learning rate; a bfloat16 element changes only
when that crosses a rounding boundary). A trainer rank keeps its share of the last version it sent
(LastSent: one share of a version in the layout's dtype, the memory this costs) and sends each
bucket to an inference rank that holds that version as a patch: which elements changed and how.
The receiver applies it to its copy of the base (read only; the model may be running on it),
writing the new bytes into its staging buffer (in place where staging holds the version before
the base: held.py), and checks them against the xxh3_64 of the new bytes that the sender computed
while producing them, so a patched bucket is verified exactly like a bucket sent whole. A patch
that cannot be applied (another base, damaged bytes) is refused, and the sender then sends that
bucket whole (the transport's NEED frame).

Why this encoding. Measured on versions from real training (GPT-2 124M, the built-in trainer's
data, AdamW at lr 1e-6, one optimizer step per version; 4.2% and 3.5% of bfloat16 elements
changed), per 128 MiB on one core of the 2-core VM: the changed elements as u16 gaps and XOR
values, zstd level 1 per 1 MiB chunk: 3.2% of the bytes, 156 ms to encode, 64 ms to apply; the
XOR of everything through zstd level 1: 4.6%, 194 ms and 113 ms; through lz4: 9.5%, 101 ms and
84 ms; u32 index + value without compression: 10.5%. The entries go to zstd as byte planes
(the format below): the high bytes of gaps and values are nearly all zero, and zstd makes a few
matches of them and entropy-codes the low bytes alone; per 64 MiB of a version `weightsync bench`
trains (3.7% changed), 8.1 ms to compress instead of 16.6 ms, and 2.42% of the bytes instead of
3.06% for u16 gaps then values. At float32 every element changes every step (the XOR through
zstd still takes 55% of the bytes, at 270 ms per 64 MiB): the first chunk of a bucket shows that
at once, and the bucket goes whole (`dense`), at the cost of one compare of that chunk. The
chunks are 1 MiB so that each is compared, patched and hashed while in cache.

Patch format (little-endian; the one place it is defined)
---------------------------------------------------------
  HEAD     b"WSDP" | u8 format (2) | u8 element size | 2 zero bytes | u64 base version |
           u64 range length | u32 chunk bytes                                              28 bytes
  then, for every chunk of the range in order (the last one may be shorter):
  RECORD   u8 kind | 3 zero bytes | u32 entries | u32 stored bytes, then `stored` bytes  12 bytes
    SAME   (0) the chunk equals the base's; entries 0, stored 0
    SPARSE (1) zstd of the entries' byte planes: byte 0 of gaps[entries], byte 1 of gaps[entries]
               (u16 each), then byte k of values[entries] for k = 0 .. element size - 1: element
               (sum of the first i+1 gaps) - 1 of the chunk becomes base XOR value i. Gaps are
               at most 65535: a longer run gets filler entries whose value is 0
    RAW    (2) the chunk's new bytes (a chunk where too much changed for SPARSE to be smaller)
"""

from __future__ import annotations

import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import xxhash
import zstandard

from weightsync.transfer import delta_kernels as kernels
from weightsync.transfer.delta_kernels import ELEMENT, GAP, MAX_GAP, elements  # noqa: F401 - the format's
from weightsync.transfer.held import KEPT_SHARE, Applied
from weightsync.transfer.phases import Phases
from weightsync.transport.base import Pieces
from weightsync.transport.checksum import CHUNK

FORMAT = 2  # 2: SPARSE entries as byte planes (1 had u16 gaps, then whole values)
HEAD = struct.Struct("<4sBB2xQQI")
RECORD = struct.Struct("<B3xII")
SAME, SPARSE, RAW = 0, 1, 2
LEVEL = 1  # zstd level: 3 saved no bytes here and took 30% longer
# A bucket goes whole when its first chunk's patch, before compression, would be more than this
# share of the chunk: at float32 every element changes, and encoding would cost time for nothing.
DENSE = 0.5


class PatchError(ValueError):
    """A patch that cannot be applied here; the message says why."""


class Encoders:
    """Where chunks are encoded: on `threads` threads (each with its own compressor and scratch
    for a chunk's entries), so that a trainer rank encodes one chunk while it casts the next, and
    several at once where it has the cores; with one thread, in the caller's. `phases` adds up
    the seconds spent comparing (and keeping) and encoding."""

    def __init__(self, threads: int = 1):
        if threads < 1:
            raise ValueError("encoding needs at least one thread")
        self.local = threading.local()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="delta-encode") if threads > 1 else None
        self.phases = Phases()

    def encode(self, kept: np.ndarray, new: np.ndarray, itemsize: int) -> tuple[list, int]:
        """The record of one chunk (its pieces) that makes `new` of `kept` (uint8 arrays of one
        length), and how many elements differ; `kept` holds the new bytes afterwards."""
        local = self.local
        if not hasattr(local, "compressor"):
            local.compressor, local.scratch = zstandard.ZstdCompressor(level=LEVEL), bytearray()
        if len(local.scratch) < kernels.scratch_bytes(len(new), itemsize):
            local.scratch = bytearray(kernels.scratch_bytes(len(new), itemsize))
        start = time.perf_counter()
        entries, changed = kernels.diff(kept, new, itemsize, local.scratch)
        compared = time.perf_counter()
        self.phases.add("compare", compared - start)
        if changed == 0:
            return [RECORD.pack(SAME, 0, 0)], 0
        try:
            if entries >= 0 and changed * (GAP.itemsize + itemsize) < len(new):
                blob = local.compressor.compress(memoryview(local.scratch)[:entries * (GAP.itemsize + itemsize)])
                if len(blob) < len(new):
                    return [RECORD.pack(SPARSE, entries, len(blob)), blob], changed
            return [RECORD.pack(RAW, changed, len(new)), kept.tobytes()], changed
        finally:
            self.phases.add("encode", time.perf_counter() - compared)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


@dataclass
class BucketEncoder:
    """Takes one bucket's new bytes chunk by chunk as they are produced: compares each with what
    this rank sent last (`kept`), records what changed (when `base` is not None), and keeps the new
    bytes for next time. `dense` turns True after the first chunk when the bucket should go whole;
    then later chunks are only kept. stream() hands the patch's pieces to a Pieces as each chunk is
    encoded, in order, so they can go out while the rest is encoded. The caller must not change a
    chunk it added until finish() or wait() has returned."""

    kept: np.ndarray  # uint8: this bucket's bytes of the last version sent; becomes the new one
    itemsize: int
    base: int | None  # the version `kept` holds, when the bucket is to become a patch against it
    encoders: Encoders
    dense: bool = False
    changed: int = 0  # elements that differ from the base, over the chunks compared
    compared: int = 0  # elements compared
    parts: list = field(default_factory=list)
    pending: list = field(default_factory=list)  # futures of (pieces, changed), in chunk order
    out: Pieces | None = None  # where the pieces go as they are made (stream())
    lock: threading.Lock = field(default_factory=threading.Lock)  # over parts, pending and out

    def add(self, pos: int, new: np.ndarray) -> None:
        """The bucket's new bytes [pos, pos + len(new)), a uint8 array; chunks come in order."""
        old = self.kept[pos:pos + len(new)]
        if self.base is None or self.dense:
            with self.encoders.phases.timed("keep"):
                np.copyto(old, new)
            return
        self.compared += len(new) // self.itemsize
        if pos and self.encoders.pool is not None:
            future = self.encoders.pool.submit(self._chunk, old, new)
            with self.lock:
                self.pending.append(future)
            future.add_done_callback(lambda _: self._flush())
            return
        pieces, changed = self._chunk(old, new)
        with self.lock:
            self._take(pieces, changed)
        if pos == 0 and self._too_dense(pieces[0], len(new)):
            self.dense, self.parts = True, []

    def _chunk(self, old: np.ndarray, new: np.ndarray) -> tuple[list, int]:
        return self.encoders.encode(old, new, self.itemsize)

    def _take(self, pieces: list, changed: int) -> None:
        self.parts += pieces
        self.changed += changed
        if self.out is not None:
            self.out.put(pieces)

    def _flush(self) -> None:
        """Take the chunks encoded on the pool, in order, as far as they are done (one that
        failed stays for wait() to raise)."""
        with self.lock:
            while self.pending and self.pending[0].done() and self.pending[0].exception() is None:
                self._take(*self.pending.pop(0).result())

    def _too_dense(self, record: bytes, chunk_bytes: int) -> bool:
        kind, entries, _ = RECORD.unpack(record)
        return kind == RAW or (kind == SPARSE and entries * (GAP.itemsize + self.itemsize) > DENSE * chunk_bytes)

    def stream(self, length: int) -> Pieces:
        """Where the patch of this `length`-byte bucket goes piece by piece from now on (after
        the first chunk, when the bucket is not dense): its head and the chunks so far at once;
        finish() closes it."""
        if self.base is None or self.dense:
            raise ValueError("this bucket is not being encoded as a patch")
        with self.lock:
            self.out = Pieces()
            self.out.put([HEAD.pack(b"WSDP", FORMAT, self.itemsize, self.base, length, CHUNK)] + self.parts)
        return self.out

    def wait(self) -> None:
        """Until every chunk added is compared, encoded and kept."""
        for future in list(self.pending):
            future.result()
        self._flush()

    def finish(self, length: int) -> list[bytes]:
        """The patch: its pieces, in order (send them as they are, without joining)."""
        self.wait()
        if self.base is None or self.dense:
            raise ValueError("this bucket is not being encoded as a patch")
        if self.out is not None:
            self.out.close()
        return [HEAD.pack(b"WSDP", FORMAT, self.itemsize, self.base, length, CHUNK)] + self.parts

class LastSent:
    """What this trainer rank sent last: its buckets of that version, in the layout's dtype, in
    one host buffer of its share of a version (version_bytes / trainers, the memory a delta costs
    the sender). `version` is None while it is being overwritten, or after a version that failed:
    then nothing can be a patch against it. Chunks are encoded on `threads` threads."""

    def __init__(self, buckets: Sequence, itemsize: int, threads: int = 1):
        elements(itemsize)
        self.itemsize = itemsize
        self.where: dict[int, tuple[int, int]] = {}  # bucket offset -> (position here, length)
        pos = 0
        for b in buckets:
            self.where[b.offset] = (pos, b.length)
            pos += b.length
        self.buffer = np.empty(pos, dtype=np.uint8)
        self.version: int | None = None
        self.encoders = Encoders(threads)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def bucket(self, offset: int) -> np.ndarray:
        """The kept bytes of the bucket at version byte `offset`."""
        pos, length = self.where[offset]
        return self.buffer[pos:pos + length]

    def encoder(self, offset: int, base: int | None) -> BucketEncoder:
        """An encoder for the bucket at `offset`: a patch against `base` (the version whose bytes
        are kept here), or, with base None, only keeping the new bytes."""
        return BucketEncoder(self.bucket(offset), self.itemsize, base, self.encoders)


class Applying:
    """One patch applied while its bytes arrive, so that a receiver patches a bucket's first
    chunks while its last ones are on the wire: feed(payload, got) applies every chunk whose
    record lies within payload[:got] to `base` (version base_version, read only) into `target`
    (uint8 arrays of the range's length); result(payload), once all of it is there, gives the new
    bytes' xxh3_64, or raises PatchError where the patch is not one of this range against this base
    (a PatchError while feeding waits for result()). `phases` adds up the seconds spent applying
    and hashing. `into`: where the new bytes go once verified, when `target` is not their place
    (Patcher's). `redo` (held.Applied): the entries that make `target`, as it is, the base, so
    that each chunk is patched in place rather than copied from the base first (held.py says
    when); `applied` (with keep): the entries applied to each chunk, for the next version's redo."""

    def __init__(self, base: np.ndarray, target: np.ndarray, base_version: int, phases: Phases | None = None, into=None,
                 redo: Applied | None = None, keep: bool = False):
        self.base, self.target, self.base_version, self.phases, self.into = base, target, base_version, phases, into
        self.redo = redo
        self.applied: list | None = [] if keep else None
        self.at = self.pos = 0  # bytes of the payload read, of the range written
        self.length: int | None = None  # the range's, from the head
        self.error: PatchError | None = None
        self.h = xxhash.xxh3_64()
        self.decompressor = zstandard.ZstdDecompressor()

    def feed(self, payload, got: int) -> None:
        if self.error is None:
            try:
                self._feed(memoryview(payload).cast("B"), got)
            except PatchError as e:
                self.error = e

    def _head(self, view) -> None:
        magic, fmt, self.itemsize, against, length, self.chunk = HEAD.unpack_from(view)
        if magic != b"WSDP" or fmt != FORMAT:
            raise PatchError("not a weightsync patch of a format this rank reads")
        if against != self.base_version:
            raise PatchError(f"a patch against version {against}; this rank holds version {self.base_version}")
        if length != len(self.target) or len(self.base) != len(self.target):
            raise PatchError(f"a patch of a {length}-byte range applied to {len(self.target)} bytes")
        if self.itemsize not in ELEMENT or self.chunk <= 0 or self.chunk % self.itemsize:
            raise PatchError(f"element size {self.itemsize} or chunk size {self.chunk} is not valid")
        self.length, self.at = length, HEAD.size
        if self.redo is not None and (self.redo.chunk != self.chunk or self.redo.itemsize != self.itemsize):
            self.redo = None

    def _feed(self, view, got: int) -> None:
        if self.length is None:
            if got < HEAD.size:
                return
            self._head(view)
        start, hashing = time.perf_counter(), 0.0
        while self.pos < self.length and self.at + RECORD.size <= got:
            kind, entries, stored = RECORD.unpack_from(view, self.at)
            if self.at + RECORD.size + stored > got:
                break
            data = view[self.at + RECORD.size:self.at + RECORD.size + stored]
            self.at += RECORD.size + stored
            pos, end = self.pos, min(self.pos + self.chunk, self.length)
            out = self.target[pos:end]
            if kind == SAME and stored == 0:
                self._as_base(pos, end, out)
                raw = b""
            elif kind == RAW and stored == end - pos:
                out[:] = np.frombuffer(data, dtype=np.uint8)
                raw = None
            elif kind == SPARSE and entries:
                raw = self._sparse(data, entries, pos, end, out)
            else:
                raise PatchError(f"the chunk at byte {pos} has a record (kind {kind}, {stored} bytes) this rank cannot read")
            if self.applied is not None:
                self.applied.append(raw if raw is None or len(raw) <= (end - pos) * KEPT_SHARE else None)
            hashed = time.perf_counter()
            self.h.update(out)
            hashing += time.perf_counter() - hashed
            self.pos = end
        if self.phases is not None:
            self.phases.add("apply", time.perf_counter() - start - hashing)
            self.phases.add("hash", hashing)

    def _prior(self, pos: int):
        """The entries that make the target's chunk at `pos` the base's as it is; None: copy it."""
        i = pos // self.chunk
        return self.redo.entries[i] if self.redo is not None and i < len(self.redo.entries) else None

    def _as_base(self, pos: int, end: int, out: np.ndarray) -> None:
        """Make `out`, the target's chunk at `pos`, the base's."""
        prior = self._prior(pos)
        if prior is None:
            np.copyto(out, self.base[pos:end])
        elif prior and not kernels.patch(None, out, prior, len(prior) // (GAP.itemsize + self.itemsize), self.itemsize):
            raise PatchError(f"the last version's entries of the chunk at byte {pos} do not fit it")

    def _sparse(self, data, entries: int, pos: int, end: int, out: np.ndarray) -> bytes:
        want = entries * (GAP.itemsize + self.itemsize)
        try:
            raw = self.decompressor.decompress(data, max_output_size=want)
        except zstandard.ZstdError as e:
            raise PatchError(f"the chunk at byte {pos} does not decompress: {e}") from None
        if len(raw) != want:
            raise PatchError(f"the chunk at byte {pos} holds {len(raw)} bytes for {entries} entries")
        if in_place := self._prior(pos) is not None:
            self._as_base(pos, end, out)
        if not kernels.patch(None if in_place else self.base[pos:end], out, raw, entries, self.itemsize):
            raise PatchError(f"the chunk at byte {pos} changes an element beyond its end")
        return raw

    def result(self, payload) -> int:
        view = memoryview(payload).cast("B")
        self.feed(view, len(view))
        if self.error is not None:
            raise self.error
        if self.length is None:
            raise PatchError(f"a patch of {len(view)} bytes is shorter than its head")
        if self.pos < self.length:
            if self.at + RECORD.size > len(view):
                raise PatchError(f"the patch ends before the chunk at byte {self.pos}")
            stored = RECORD.unpack_from(view, self.at)[2]
            raise PatchError(f"the chunk at byte {self.pos} claims {stored} bytes, "
                             f"{len(view) - self.at - RECORD.size} are left")
        if self.at != len(view):
            raise PatchError(f"{len(view) - self.at} bytes follow the last chunk")
        return self.h.intdigest()


def apply_patch(payload, base: np.ndarray, target: np.ndarray, base_version: int, phases: Phases | None = None) -> int:
    """Write into `target` the new bytes that `payload` (a patch) makes of `base` (version
    base_version, read only; both uint8 arrays of the range's length); returns their xxh3_64.
    Raises PatchError when the patch is not one of this range against this base. `phases` adds
    up the seconds spent applying and hashing."""
    return Applying(base, target, base_version, phases).result(payload)


class Patcher:
    """Applies the patches an inference rank receives for one version: against `base` (the
    buffer of the version it holds, `base_version`; read only) into `target` (its staging
    buffer), both 1-d uint8 tensors of a version, on the CPU or a GPU (through host copies).
    With no base (a rank that holds nothing the sender knows of) every patch is refused. A patch
    is applied only when the new bytes' xxh3_64 equals the sender's; `refused` says why the
    others were not (the sender then sends those ranges whole). A range whose offset is in
    `scatter` is the runs (offset, length) it names, in turn (a bucket that bundles runs of several
    tensors: plan.Bucket). Transports call apply() and refuse() from one thread per sender;
    `phases` adds up the seconds they spend applying and hashing. `redo` ({offset: held.Applied}):
    what makes the target's ranges the base's as they are, to patch them in place (held.Trail);
    `entries` gets the same of this version's ranges patched in a target in host memory."""

    def __init__(self, base_version: int | None, base=None, target=None, scatter: Mapping | None = None,
                 redo: Mapping | None = None):
        if base_version is not None and (base is None or target is None):
            raise ValueError("a patcher with a base version needs the base and the target buffer")
        self.base_version, self.base, self.target = base_version, base, target
        self.scatter = scatter or {}
        self.redo = redo or {}
        self.entries: dict[int, Applied] = {}
        self.applied = 0
        self.refused: list[str] = []
        self.lock = threading.Lock()
        self.phases = Phases()

    def apply(self, offset: int, length: int, payload, checksum: int) -> bool:
        """Apply the patch of the range [offset, offset + length); True when its new bytes are
        in place and their xxh3_64 is `checksum`."""
        return self.end(self.begin(offset, length), offset, length, payload, checksum)

    def begin(self, offset: int, length: int) -> Applying | None:
        """What applies the patch of the range [offset, offset + length) while it arrives (feed
        it, then give it to end()); None where this rank holds no version (end() refuses it)."""
        if self.base_version is None:
            return None
        runs = self.scatter.get(offset)
        if runs is None:
            base, target = self.base[offset:offset + length], self.target[offset:offset + length]
        else:
            import torch

            base, target = torch.cat([self.base[o:o + n] for o, n in runs]), None
        on_host = target is not None and target.device.type == "cpu"
        out = target.numpy() if on_host else np.empty(length, dtype=np.uint8)
        return Applying(base.cpu().numpy(), out, self.base_version, self.phases,
                        into=None if on_host else runs or ((offset, length),),
                        redo=self.redo.get(offset) if on_host else None, keep=on_host)

    def end(self, applying: Applying | None, offset: int, length: int, payload, checksum: int) -> bool:
        """Finish what begin() started, now that all of `payload` is there: True when the new
        bytes are in place and their xxh3_64 is `checksum`."""
        if applying is None:
            self.refuse(offset, length, "this rank holds no version to apply it to")
            return False
        try:
            got = applying.result(payload)
        except PatchError as e:
            self.refuse(offset, length, str(e))
            return False
        if got != checksum:
            why = ", or the staging buffer from the version before it" if applying.redo is not None else ""
            self.refuse(offset, length, f"the patched bytes hash to {got:016x}, the sender's to {checksum:016x} "
                                        f"(this rank's version {self.base_version} differs from the sender's{why})")
            return False
        if applying.applied is not None:
            with self.lock:
                self.entries[offset] = Applied(applying.chunk, applying.itemsize, applying.applied)
        if applying.into is not None:
            import torch

            new, at = torch.from_numpy(applying.target), 0
            for o, n in applying.into:
                self.target[o:o + n].copy_(new[at:at + n])
                at += n
        with self.lock:
            self.applied += 1
        return True

    def refuse(self, offset: int, length: int, reason: str) -> None:
        with self.lock:
            self.refused.append(f"bytes [{offset}, {offset + length}): {reason}")
