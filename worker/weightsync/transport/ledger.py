"""What one trainer rank may send one inference rank for one version, checked frame by frame.

Every receiver (tcp, uccl, nccl) keeps the same account: the ranges the plan gives the trainer,
each to arrive exactly once, then an END whose counts match what arrived. The rules and their
messages live here once, so that every transport refuses the same frames with the same words.
"""

from __future__ import annotations

from typing import Iterable

from weightsync.transport.base import ChecksumMismatch, TransferError


class Ledger:
    """One trainer's ranges of one version, as a receiver reads its frames."""

    def __init__(self, trainer: int, version: int, ranges: Iterable[tuple[int, int]]):
        self.peer, self.version = f"trainer rank {trainer}", version
        self.ranges = list(ranges)
        self.lengths = dict(self.ranges)
        self.planned = set(self.ranges)
        self.left = set(self.ranges)
        self.frames = self.nbytes = 0

    def check_version(self, version: int) -> None:
        if version != self.version:
            raise TransferError(self.peer, f"sent version {version} while version {self.version} was expected")

    def take(self, what: str, offset: int, length: int) -> None:
        """A frame (`what`, such as "DATA") delivering the range [offset, offset + length): it
        must be one the plan gives the trainer and not have come yet."""
        if (offset, length) not in self.left:
            why = "a second time" if (offset, length) in self.planned else "which the plan does not give it"
            raise TransferError(self.peer, f"sent {what} for bytes [{offset}, {offset + length}) of version "
                                           f"{self.version}, {why}")
        self.left.discard((offset, length))
        self.frames += 1
        self.nbytes += length

    def take_patch(self, offset: int, size: int, limit: int) -> int:
        """A PATCH of `size` payload bytes for the range at `offset`; returns the range's length.
        The patch may carry at most limit(range length) bytes."""
        length = self.lengths.get(offset)
        if length is None or (offset, length) not in self.left or size > limit(length):
            why = "a second time" if length is not None and (offset, length) in self.planned and size <= limit(length) \
                else "which the plan does not give it"
            raise TransferError(self.peer, f"sent a {size}-byte PATCH for bytes at {offset} of version {self.version}, "
                                           f"{why}")
        self.take("PATCH", offset, length)
        return length

    def end(self, frames: int, nbytes: int) -> None:
        """The END frame: every range has come, and the sender counts what arrived."""
        if self.left:
            raise TransferError(self.peer, f"ended version {self.version} with {len(self.left)} of {len(self.ranges)} "
                                           f"ranges missing, first at byte {min(self.left)[0]}")
        if (frames, nbytes) != (self.frames, self.nbytes):
            raise TransferError(self.peer, f"says it sent {frames} ranges / {nbytes} bytes, "
                                           f"{self.frames} / {self.nbytes} arrived")

    def again(self, offsets: list[int]) -> None:
        """After a NEED: the ranges at `offsets` come once more, whole, then another END."""
        self.left = {(o, self.lengths[o]) for o in offsets}
        self.frames = self.nbytes = 0

    def checksum(self, offset: int, length: int, sent: int, received: int) -> None:
        if sent != received:
            raise ChecksumMismatch(self.peer, f"checksum mismatch for bytes [{offset}, {offset + length}) of version "
                                           f"{self.version}: sent {sent:016x}, received {received:016x}")
