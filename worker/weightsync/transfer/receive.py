"""Receiving one weight version and verifying it: the inference side of a transfer.

The inference roles, the vLLM backend and `weightsync bench` all use exactly this code. An
inference rank receives every trainer's buckets straight into its staging buffer (the whole
version, or over slices its own local layout), each bucket checked against the xxh3_64 checksum
its sender computed while producing it, and gets back the version's digest. The controller makes
the reference that digest is checked against from what the trainers report (reference_digests),
so a version is only taken when every byte of it is the trainers'.

With delta versions on (delta.py), a bucket may come as a patch against the version this rank
holds; the receiver applies it into the staging buffer, reading the base only (and patching
staging in place where it holds the version before the base, held.py). The checksums,
and so the digest, are of the new bytes either way: a patched version is verified exactly like a
whole one.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from weightsync.plan.interface import TransferPlan
from weightsync.transfer.delta import Patcher
from weightsync.transfer.held import Trail
from weightsync.transfer.sums import digest_of, version_digest
from weightsync.transport.base import Receiver, TransferError


def reference_digests(plan: TransferPlan, sent: list, receivers) -> str | dict[int, str]:
    """What the controller publishes as a round's reference (rendezvous.messages.Reference), from
    the trainers' reports of what they sent (each with checksums {offset: xxh3_64}, or over slices
    receiver_checksums {receiver: {offset: xxh3_64}}, as SentVersion has them): the version's
    digest, or over slices {receiver: its own digest}."""
    if not plan.sliced:
        return digest_of(s.checksums for s in sent)
    by_receiver: dict[int, list] = {}  # each report's part for each receiver, in the trainers' order
    for s in sent:  # (once over the reports: not every report looked at for every receiver)
        for r, sums in s.receiver_checksums.items():
            by_receiver.setdefault(r, []).append(sums)
    return {r: digest_of(by_receiver.get(r, ())) for r in receivers}


def settle_heap() -> None:
    """Put every object made so far (the libraries, the model) out of the garbage collector's
    reach: a full collection would otherwise walk them all again while a version is on the
    wire, holding the GIL the connection threads need. Every rank process (trainers too) calls
    it once, after start-up."""
    gc.collect()
    gc.freeze()


@dataclass
class ReceivedVersion:
    version: int
    bytes: int
    seconds: float
    checksums: dict
    digest: str
    patched: int = 0  # buckets that came as patches and were applied
    refused: list = field(default_factory=list)  # why other patches were not (those buckets came again, whole)
    phases: dict = field(default_factory=dict)  # {phase: seconds} of applying patches (phases.py), of every thread


class VersionReceiver:
    """Receives versions on one inference rank into a staging buffer (a 1-d uint8 tensor of at
    least plan.bytes_for(rank): the whole version, or over slices this rank's local layout;
    registered once with the transport by the caller or on first use), verifying every bucket.
    A version may come as patches against `base`, (the version this rank holds, its buffer),
    which is only read; `trail` keeps the entries of the last version's patches, with which the
    next one patches its staging buffer in place where it can (held.py)."""

    def __init__(self, receiver: Receiver, plan: TransferPlan, inference_rank: int):
        self.receiver, self.plan, self.rank = receiver, plan, inference_rank
        self.expected = plan.expected_for(inference_rank)
        self.scatter = plan.scatter_for(inference_rank)
        self.nbytes = plan.bytes_for(inference_rank)
        self.registered: set[int] = set()
        self.trail = Trail()
        receiver.expect_trainers(plan.trainers)

    def receive(self, version: int, staging, timeout: float, base: tuple[int, object] | None = None) -> ReceivedVersion:
        if staging.numel() * staging.element_size() < self.nbytes:
            raise ValueError(f"the staging buffer holds {staging.numel() * staging.element_size()} bytes, "
                             f"a version needs {self.nbytes}")
        if staging.data_ptr() not in self.registered:
            self.receiver.register([staging])
            self.registered.add(staging.data_ptr())
        patcher = None
        redo = self.trail.redo(staging, base)
        if self.receiver.capabilities.patches:
            if base is not None and base[1].data_ptr() == staging.data_ptr():
                raise ValueError("the base of a delta version must be another buffer than the staging buffer")
            patcher = Patcher(base[0], base[1], staging, self.scatter, redo) if base is not None else Patcher(None)
        start = time.monotonic()
        sums = self.receiver.receive(version, staging, self.expected, timeout, patcher, self.scatter)
        want = {o for ranges in self.expected.values() for o, _ in ranges}
        if set(sums) != want:
            missing = sorted(want - set(sums))
            raise TransferError(f"inference rank {self.rank}", f"version {version} is missing buckets at {missing[:5]}")
        if patcher is not None:
            self.trail.keep(version, staging, base, patcher.entries)
        return ReceivedVersion(version, self.nbytes, time.monotonic() - start, sums, version_digest(sums),
                               patched=patcher.applied if patcher else 0, refused=patcher.refused if patcher else [],
                               phases=patcher.phases.take() if patcher else {})
