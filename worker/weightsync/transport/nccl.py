"""NCCL transport: the same interface over torch.distributed NCCL point-to-point on GPU tensors.

One NCCL process group spans every trainer and inference rank: trainers are ranks 0..M-1,
inference ranks M..M+N-1. It is a group of its own (ProcessGroupNCCL built on the job's store
under the prefix "weightsync-nccl"), so it lives beside the trainers' DDP group. The caller may
also hand in a ready group with that rank order.

Each range travels as a small header tensor (int64: kind, version, offset, length, checksum),
then its bytes, received straight into the staging tensor. NCCL keeps point-to-point messages
between two ranks in order, which is all the framing needs. Checksums are xxh3_64 of the bytes
as in every transport (computed from a host copy of the bucket). Before the first range, each
sender proves through the store that it holds the job token: an HMAC over a fresh nonce that the
receiver published when it started listening, so that a proof from an earlier run (or an earlier
life of the receiver) does not pass.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from weightsync.transport.base import (Filling, Receiver, Sender, Tally, TransferError, Transport, TransportUnavailable,
                                       each_peer, wait_all)
from weightsync.transport.checksum import bucket_checksum
from weightsync.transport.wire import DATA, END

PREFIX = "weightsync-nccl"


def unavailable_reason() -> str | None:
    """Why NCCL cannot run here, or None."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not dist.is_available() or not dist.is_nccl_available():
        return "this torch build has no NCCL support"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return None


def _signed(u: int) -> int:
    return struct.unpack("<q", struct.pack("<Q", u))[0]


def _unsigned(s: int) -> int:
    return struct.unpack("<Q", struct.pack("<q", s))[0]


def _hello_mac(token: bytes, nonce: bytes, trainer: int, inference: int) -> str:
    return hmac.new(token, b"nccl hello|" + nonce + f"|{trainer}->{inference}".encode(), hashlib.sha256).hexdigest()


class NcclTransport(Transport):
    name = "nccl"

    def __init__(self, token: bytes, timeout: float, trainers: int, inferences: int, store=None, group=None,
                 device: int | None = None):
        reason = unavailable_reason()
        if reason:
            raise TransportUnavailable(f"nccl: {reason}")
        if store is None and group is None:
            raise ValueError("the nccl transport needs the job's store (or a ready NCCL process group)")
        self.token, self.timeout = token, timeout
        self.trainers, self.inferences = trainers, inferences
        self.store, self.group, self.device = store, group, device

    def _group(self, global_rank: int):
        import torch
        import torch.distributed as dist

        if self.device is not None:
            torch.cuda.set_device(self.device)
        if self.group is None:
            prefixed = dist.PrefixStore(PREFIX, self.store)
            self.group = dist.ProcessGroupNCCL(prefixed, global_rank, self.trainers + self.inferences,
                                               datetime.timedelta(seconds=self.timeout))
        return self.group

    def sender(self, rank: int) -> "NcclSender":
        return NcclSender(self, rank)

    def receiver(self, rank: int) -> "NcclReceiver":
        return NcclReceiver(self, rank)


def _wait(work, deadline: float, peer: str, what: str, abandon: threading.Event | None = None) -> None:
    """Wait for an NCCL work item; give up at `deadline`, or as soon as `abandon` is set (another
    peer's failure has lost the version)."""
    while not work.is_completed():
        if abandon is not None and abandon.is_set():
            raise TransferError(peer, f"{what} was abandoned: the version failed on another connection")
        if time.monotonic() > deadline:
            raise TransferError(peer, f"{what} did not complete in time")
        time.sleep(0.0005)
    if not work.is_success():
        raise TransferError(peer, f"{what} failed: {work.exception()}")


class NcclSender(Sender):
    in_place = False  # ranges are sent from registered GPU send buffers
    buffer_device = "cuda"

    def __init__(self, transport: NcclTransport, rank: int):
        import torch

        self.t, self.rank = transport, rank
        self.group = transport._group(rank)
        # the sending threads start on cuda:0 (the current device is per thread): name this rank's
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.peers: list[int] = []
        self.pools: dict[int, ThreadPoolExecutor] = {}
        self.pending: dict[int, list[tuple[int, Future]]] = {}
        self.tally = Tally()

    def connect(self, peers: dict[int, str]) -> None:
        for peer in peers:
            if self.t.store is not None:  # the receiver published its nonce before it joined
                nonce = self.t.store.get(f"{PREFIX}/nonce/{peer}")
                self.t.store.set(f"{PREFIX}/hello/{self.rank}/{peer}", _hello_mac(self.t.token, nonce, self.rank, peer))
            self.pools.setdefault(peer, ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nccl-to-{peer}"))
            if peer not in self.peers:
                self.peers.append(peer)

    def _submit(self, peer: int, version: int, header: Callable[[], list[int]], data) -> Future:
        """Send header() (called on the peer's thread, where it may wait for the bytes) and then
        `data`; the future gives the header's checksum."""
        import torch

        dst = self.t.trainers + peer
        name = f"inference rank {peer}"

        def run() -> int:
            fields = header()
            deadline = time.monotonic() + self.t.timeout
            head = torch.tensor(fields, dtype=torch.int64, device=self.device)
            _wait(self.group.send([head], dst, 0), deadline, name, f"header of version {version}")
            if data is not None:
                _wait(self.group.send([data], dst, 0), deadline, name, f"bytes at {fields[2]} of version {version}")
            return _unsigned(fields[4])

        future = self.pools[peer].submit(run)
        self.pending.setdefault(version, []).append((peer, future))
        return future

    def send(self, peer: int, version: int, offset: int, data: Any, filling: Filling | None = None) -> Future:
        if not hasattr(data, "data_ptr") or data.device.type != "cuda":
            raise ValueError("the nccl transport sends GPU tensors (uint8)")
        length = data.numel() * data.element_size()
        self.tally.add(version, peer, length)

        def header() -> list[int]:
            digest = bucket_checksum(data, filling)
            return [DATA, version, offset, length, _signed(digest)]

        return self._submit(peer, version, header, data)

    def end_version(self, version: int) -> None:
        for peer in self.peers:
            frames, nbytes = self.tally.pop(version, peer)
            self._submit(peer, version, lambda f=frames, n=nbytes: [END, version, f, n, 0], None)
        wait_all(f for _, f in self.pending.pop(version, []))

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)


class NcclReceiver(Receiver):
    def __init__(self, transport: NcclTransport, rank: int):
        self.t, self.rank = transport, rank
        self.group = transport._group(transport.trainers + rank)
        self.proven: set[int] = set()
        self.nonce = secrets.token_hex(16).encode()

    def listen(self, host: str, port: int) -> str:
        if self.t.store is not None:
            self.t.store.set(f"{PREFIX}/nonce/{self.rank}", self.nonce)
        return f"nccl:{self.t.trainers + self.rank}"

    def _prove(self, trainer: int, deadline: float, abandon: threading.Event) -> None:
        if trainer in self.proven or self.t.store is None:
            return
        key = f"{PREFIX}/hello/{trainer}/{self.rank}"
        while not self.t.store.check([key]):
            if abandon.is_set():
                raise TransferError(f"trainer rank {trainer}", "had not announced itself when the version failed")
            if time.monotonic() > deadline:
                raise TransferError(f"trainer rank {trainer}", "did not announce itself in time")
            time.sleep(0.01)
        if not hmac.compare_digest(self.t.store.get(key).decode(), _hello_mac(self.t.token, self.nonce, trainer, self.rank)):
            raise TransferError(f"trainer rank {trainer}", "its announcement does not prove the job token")
        self.proven.add(trainer)

    def receive(self, version: int, buffer: Any, expected: dict[int, list[tuple[int, int]]], timeout: float,
                patcher: Any = None, scatter: Any = None) -> dict[int, int]:
        import torch

        if patcher is not None:
            raise ValueError("the nccl transport carries no patches: receive whole versions")
        if scatter:
            raise ValueError("the nccl transport lands every range in one run; this plan bundles runs of several "
                             "tensors into one bucket (a plan made for tcp)")

        if not hasattr(buffer, "data_ptr") or buffer.device.type != "cuda":
            raise ValueError("the nccl transport receives into a GPU tensor")
        flat = buffer.view(torch.uint8).reshape(-1)
        deadline = time.monotonic() + timeout
        abandon = threading.Event()  # one trainer's failure loses the version: the others stop waiting

        def run(trainer: int) -> dict[int, int]:
            peer = f"trainer rank {trainer}"
            self._prove(trainer, deadline, abandon)
            left = set(expected[trainer])
            sums: dict[int, int] = {}
            frames = nbytes = 0
            head = torch.empty(5, dtype=torch.int64, device=buffer.device)
            while True:
                _wait(self.group.recv([head], trainer, 0), deadline, peer, f"header of version {version}", abandon)
                kind, v, offset, length, digest = (int(x) for x in head.cpu())
                if v != version:
                    raise TransferError(peer, f"sent version {v} while version {version} was expected")
                if kind == END:
                    if left or (offset, length) != (frames, nbytes):
                        raise TransferError(peer, f"ended version {version} with {len(left)} ranges missing")
                    return sums
                if kind != DATA or (offset, length) not in left:
                    raise TransferError(peer, f"sent bytes [{offset}, {offset + length}) the plan does not give it")
                left.discard((offset, length))
                target = flat[offset:offset + length]
                _wait(self.group.recv([target], trainer, 0), deadline, peer, f"bytes at {offset} of version {version}",
                      abandon)
                torch.cuda.current_stream(buffer.device).synchronize()
                got = bucket_checksum(target)
                if got != _unsigned(digest):
                    raise TransferError(peer, f"checksum mismatch for bytes [{offset}, {offset + length}) of version {version}")
                sums[offset] = got
                frames += 1
                nbytes += length

        try:
            results = each_peer(expected, run, lambda _: abandon.set())
        except Exception:
            if hasattr(self.group, "abort"):
                self.group.abort()
            raise
        return {offset: digest for sums in results.values() for offset, digest in sums.items()}

    def close(self) -> None:
        pass
