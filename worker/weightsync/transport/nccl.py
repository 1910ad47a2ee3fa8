"""NCCL transport: the same interface over torch.distributed point-to-point on GPU tensors.

One process group spans every trainer and inference rank: trainers are ranks 0..M-1, inference
ranks M..M+N-1. It is a group of its own (built on the job's store under the prefix
"weightsync-nccl"), so it lives beside the trainers' DDP group. The caller may also hand in a
ready group with that rank order. The same code runs on host tensors over gloo (backend="gloo"):
point-to-point works there too, so the framing, the bookkeeping and every failure path run on
machines without a GPU.

Each range travels as a small header tensor (int64: kind, version, offset, length, checksum),
then its bytes, received straight into the staging tensor. Point-to-point messages between two
ranks keep their order, which is all the framing needs; the receiver checks every frame against
the plan (ledger.py). Before the first range, each sender proves through the store that it holds
the job token: an HMAC over a fresh nonce that the receiver published when it started listening,
so that a proof from an earlier run (or an earlier life of the receiver) does not pass.

Waiting, failing, and why the process survives it:
- Every send and receive is polled until the time left, never waited on inside NCCL (nccl_wait.py):
  a timeout, a dead peer, or an error of the backend becomes a TransferError naming the peer.
- NCCL's own watchdog would end the process on a timeout or error: the group is formed so that
  it does not (nccl_group.py), and a failed version aborts the group itself, so that no pending
  operation is left for the watchdog. An aborted group carries no more versions: every later call
  says so (the job fails, naming the first failure). The abort is bounded (ABORT_SECONDS): where
  NCCL's own abort hangs, the failure is still reported.
- NCCL creates a communicator for each pair of ranks at their first operation, which blocks
  both until the other arrives and cannot be interrupted; several threads doing it at once on
  one group can hang. So each end meets its peers first on one thread, in one global order
  (trainer rank, then inference rank), before any thread of its own sends or receives: the
  sender at its first send, the receiver at its first receive. Each first operation runs on a
  helper thread with the deadline, so a peer that never comes is named, not waited for.
"""

from __future__ import annotations

import logging
import secrets
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable

from weightsync.job.token import mac, same
from weightsync.transport.base import (
    Capabilities,
    Filling,
    RankContext,
    Receiver,
    Sender,
    Tally,
    TransferError,
    Transport,
    TransportUnavailable,
    bounded,
    cuda_unavailable_reason,
    each_peer,
    settle,
)
from weightsync.transport.checksum import bucket_checksum
from weightsync.transport.ledger import Ledger
from weightsync.transport.nccl_group import PREFIX, form_group
from weightsync.transport.nccl_wait import first_frame, wait_work
from weightsync.transport.wire import DATA, END

log = logging.getLogger("weightsync.transport")

STORE_PREFIX = "transfer/"  # the transport's keys in a job's store, apart from the rendezvous's
BACKENDS = ("nccl", "gloo")
HELLO = 0  # the header kind of the first frame between two ranks (it creates their communicator)
# How long aborting the group may take before the failure is reported without it
ABORT_SECONDS = 10.0


def unavailable_reason(backend: str = "nccl") -> str | None:
    """Why the point-to-point transport cannot run here on `backend`, or None."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if backend == "gloo":
        return None if dist.is_gloo_available() else "this torch build has no gloo support"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL support"
    return cuda_unavailable_reason()


def shared_gpu_env(host: str) -> dict[str, str]:
    """The environment of one of several processes that share a GPU over NCCL: NCCL refuses two
    ranks on one GPU unless each process names a host of its own (`host`); its socket transport
    then carries the bytes between them."""
    return {"NCCL_HOSTID": host, "NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "1"}


def _signed(u: int) -> int:
    return struct.unpack("<q", struct.pack("<Q", u))[0]


def _unsigned(s: int) -> int:
    return struct.unpack("<Q", struct.pack("<q", s))[0]


def _hello_mac(token: bytes, nonce: bytes, trainer: int, inference: int) -> str:
    return mac(token, b"nccl hello|", nonce, f"|{trainer}->{inference}").hex()


@dataclass(frozen=True)
class NcclOptions:
    trainers: int  # the job's trainer ranks (the group's ranks 0..M-1)
    inferences: int  # the job's inference ranks (the group's ranks M..M+N-1)
    store: Any = None  # a torch.distributed Store shared by every rank, where the group forms
    group: Any = None  # or a ready process group with that rank order
    device: int | None = None  # this rank's GPU index
    backend: str = "nccl"  # or "gloo": the same code on host tensors (machines without GPUs, tests)


class NcclTransport(Transport):
    name = "nccl"
    # ranges go from registered send buffers on the GPU (on the host over gloo: see __init__),
    # each whole into one run
    capabilities = Capabilities(buffer_device="cuda")
    Options = NcclOptions

    def __init__(self, token: bytes, timeout: float, options: NcclOptions):
        if options.backend not in BACKENDS:
            raise ValueError(f"unknown backend {options.backend!r}; use one of {', '.join(BACKENDS)}")
        reason = unavailable_reason(options.backend)
        if reason:
            raise TransportUnavailable(f"nccl: {reason}")
        if options.store is None and options.group is None:
            raise ValueError("the nccl transport needs the job's store (or a ready process group)")
        self.token, self.timeout, self.backend = token, timeout, options.backend
        self.trainers, self.inferences = options.trainers, options.inferences
        self.store, self.group, self.device = options.store, options.group, options.device
        self.failure: str | None = None  # why the group was aborted, once it was
        self.lock = threading.Lock()
        if self.host:
            self.capabilities = replace(self.capabilities, buffer_device="cpu")

    @classmethod
    def options_for(cls, context: RankContext) -> NcclOptions:
        """The group forms on the job's store, under a prefix of its own."""
        import torch.distributed as dist

        return NcclOptions(context.trainers, context.inferences, store=dist.PrefixStore(STORE_PREFIX, context.store()),
                           device=None if context.device is None else context.device.index)

    @property
    def host(self) -> bool:
        """Whether this transport moves host tensors (gloo) rather than GPU tensors (NCCL)."""
        return self.backend == "gloo"

    @property
    def polls(self) -> bool:
        """Whether its operations are polled rather than waited on (NCCL's: see the docstring)."""
        return not self.host

    def _group(self, global_rank: int):
        if self.device is not None and not self.host:
            import torch

            torch.cuda.set_device(self.device)
        if self.group is None:
            self.group = form_group(self.store, global_rank, self.trainers + self.inferences, self.timeout, self.host,
                                    self._name)
        return self.group

    def _name(self, global_rank: int) -> str:
        if global_rank < self.trainers:
            return f"trainer rank {global_rank}"
        return f"inference rank {global_rank - self.trainers}"

    def abort(self, why: str) -> None:
        """Give the group up: pending operations end, and no later version may use it."""
        with self.lock:
            if self.failure is None:
                self.failure = why
            group = self.group
        if group is not None and hasattr(group, "abort"):
            try:
                bounded(group.abort, ABORT_SECONDS, f"aborting the {self.backend} group")
            except Exception as e:  # noqa: BLE001 - an abort that fails or hangs leaves nothing more to do
                log.warning("aborting the %s group failed: %s; the failure stands (%s)", self.backend, e, why)

    def check(self, peer: str) -> None:
        """Raise if the group was aborted: the ranks' streams of frames are out of step."""
        if self.failure is not None:
            raise TransferError(peer, f"the {self.backend} group was aborted after an earlier failure "
                                      f"({self.failure}); it carries no more versions")

    def sender(self, rank: int) -> "NcclSender":
        return NcclSender(self, rank)

    def receiver(self, rank: int) -> "NcclReceiver":
        return NcclReceiver(self, rank)


class NcclSender(Sender):
    def __init__(self, transport: NcclTransport, rank: int):
        import torch

        self.t, self.rank, self.capabilities = transport, rank, transport.capabilities
        self.group = transport._group(rank)
        # the sending threads start on cuda:0 (the current device is per thread): name this rank's
        self.device = torch.device("cpu") if transport.host else torch.device("cuda", torch.cuda.current_device())
        self.peers: list[int] = []
        self.met: set[int] = set()
        self.pools: dict[int, ThreadPoolExecutor] = {}
        self.pending: dict[int, list[tuple[int, Future]]] = {}
        self.tally = Tally()

    def connect(self, peers: dict[int, str]) -> None:
        for peer in sorted(peers):
            if self.t.store is not None:  # the receiver published its nonce before it joined
                nonce = self.t.store.get(f"{PREFIX}/nonce/{peer}")
                self.t.store.set(f"{PREFIX}/hello/{self.rank}/{peer}", _hello_mac(self.t.token, nonce, self.rank, peer))
            self.pools.setdefault(peer, ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nccl-to-{peer}"))
            if peer not in self.peers:
                self.peers.append(peer)
        self.peers.sort()

    def connected(self, peer: int) -> bool:
        return peer in self.peers

    def _meet(self) -> None:
        """The first frame to every peer, on this thread, in rank order (see the module's
        docstring): afterwards no sending thread creates a communicator."""
        import torch

        for peer in self.peers:
            if peer in self.met:
                continue
            name = f"inference rank {peer}"
            self.t.check(name)
            head = torch.tensor([HELLO, 0, 0, 0, 0], dtype=torch.int64, device=self.device)
            try:
                first_frame(lambda: self.group.send([head], self.t.trainers + peer, 0),
                             time.monotonic() + self.t.timeout, name, self.t.polls)
            except TransferError as e:
                self.t.abort(str(e))
                raise
            self.met.add(peer)

    def _submit(self, peer: int, version: int, header: Callable[[], list[int]], data) -> Future:
        """Send header() (called on the peer's thread, where it may wait for the bytes) and then
        `data`; the future gives the header's checksum."""
        import torch

        dst = self.t.trainers + peer
        name = f"inference rank {peer}"

        def run() -> int:
            self.t.check(name)
            fields = header()
            deadline = time.monotonic() + self.t.timeout
            head = torch.tensor(fields, dtype=torch.int64, device=self.device)
            try:
                wait_work(self.group.send([head], dst, 0), deadline, name, f"the header of version {version}",
                      self.t.polls)
                if data is not None:
                    wait_work(self.group.send([data], dst, 0), deadline, name, f"bytes at {fields[2]} of version {version}",
                          self.t.polls)
            except TransferError as e:
                self.t.abort(str(e))
                raise
            return _unsigned(fields[4])

        future = self.pools[peer].submit(run)
        self.pending.setdefault(version, []).append((peer, future))
        return future

    def send(self, peer: int, version: int, offset: int, data: Any, filling: Filling | None = None) -> Future:
        if not hasattr(data, "data_ptr") or data.device.type != self.device.type or data.dtype.itemsize != 1:
            raise ValueError(f"the nccl transport over {self.t.backend} sends {self.device.type} tensors of bytes "
                             "(uint8)")
        if peer not in self.peers:
            raise TransferError(f"inference rank {peer}", "not connected")
        self._meet()
        length = data.numel()
        self.tally.add(version, peer, length)

        def header() -> list[int]:
            return [DATA, version, offset, length, _signed(bucket_checksum(data, filling))]

        return self._submit(peer, version, header, data)

    def end_version(self, version: int) -> None:
        for peer in self.peers:
            frames, nbytes = self.tally.pop(version, peer)
            self._submit(peer, version, lambda f=frames, n=nbytes: [END, version, f, n, 0], None)
        settle(self.pending.pop(version, []))

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self.t.abort("the sender closed")


class NcclReceiver(Receiver):
    def __init__(self, transport: NcclTransport, rank: int):
        self.t, self.rank, self.capabilities = transport, rank, transport.capabilities
        self.group = transport._group(transport.trainers + rank)
        self.proven: set[int] = set()
        self.met: set[int] = set()
        self.nonce = secrets.token_hex(16).encode()

    def listen(self, host: str, port: int) -> str:
        if self.t.store is not None:
            self.t.store.set(f"{PREFIX}/nonce/{self.rank}", self.nonce)
        return f"nccl:{self.t.trainers + self.rank}"

    def _prove(self, trainer: int, deadline: float) -> None:
        if trainer in self.proven or self.t.store is None:
            return
        key = f"{PREFIX}/hello/{trainer}/{self.rank}"
        while not self.t.store.check([key]):
            if time.monotonic() > deadline:
                raise TransferError(f"trainer rank {trainer}", "did not announce itself in time")
            time.sleep(0.01)
        proof = _hello_mac(self.t.token, self.nonce, trainer, self.rank)
        if not same(self.t.store.get(key).decode(), proof):
            raise TransferError(f"trainer rank {trainer}", "its announcement does not prove the job token")
        self.proven.add(trainer)

    def _meet(self, trainers: list[int], deadline: float, device) -> None:
        """Each trainer's first frame, on this thread, in rank order (see the module's docstring)."""
        import torch

        for trainer in sorted(trainers):
            if trainer in self.met:
                continue
            peer = f"trainer rank {trainer}"
            self._prove(trainer, deadline)
            head = torch.empty(5, dtype=torch.int64, device=device)
            first_frame(lambda: self.group.recv([head], trainer, 0), deadline, peer, self.t.polls)
            if int(head[0]) != HELLO:
                raise TransferError(peer, f"sent a frame of kind {int(head[0])} before its first frame")
            self.met.add(trainer)

    def receive(self, version: int, buffer: Any, expected: dict[int, list[tuple[int, int]]], timeout: float,
                patcher: Any = None, scatter: Any = None) -> dict[int, int]:
        import torch

        if patcher is not None:
            raise ValueError("the nccl transport carries no patches: receive whole versions")
        if scatter:
            raise ValueError("the nccl transport lands every range in one run; this plan bundles runs of several "
                             "tensors into one bucket (a plan made for tcp)")
        kind = "cpu" if self.t.host else "cuda"
        if not hasattr(buffer, "data_ptr") or buffer.device.type != kind:
            raise ValueError(f"the nccl transport over {self.t.backend} receives into a {kind} tensor")
        flat = buffer.view(torch.uint8).reshape(-1)
        for trainer, ranges in expected.items():
            for offset, length in ranges:
                if offset < 0 or offset + length > flat.numel():
                    raise ValueError(f"trainer rank {trainer}'s range at {offset} ({length} bytes) does not fit the "
                                     f"{flat.numel()}-byte buffer")
        self.t.check(f"inference rank {self.rank}")
        deadline = time.monotonic() + timeout
        try:
            self._meet(list(expected), deadline, buffer.device)
            results = each_peer(expected, lambda t: self._from(t, version, flat, expected[t], deadline),
                                lambda e: self.t.abort(str(e)))
        except TransferError as e:
            self.t.abort(str(e))
            raise
        return {offset: digest for sums in results.values() for offset, digest in sums.items()}

    def _from(self, trainer: int, version: int, flat, ranges: list[tuple[int, int]], deadline: float) -> dict[int, int]:
        """One version's frames from one trainer: its ranges, each once, then END."""
        import torch

        if flat.device.type == "cuda":
            # this thread's own stream: each wait orders it after the receive, the checksum runs
            # on it, and reading the checksum waits for it alone (not the device, nor the legacy
            # default stream, which would wait for inference's work)
            with torch.cuda.stream(torch.cuda.Stream(flat.device)):
                return self._frames(trainer, version, flat, ranges, deadline)
        return self._frames(trainer, version, flat, ranges, deadline)

    def _frames(self, trainer: int, version: int, flat, ranges: list[tuple[int, int]],
                deadline: float) -> dict[int, int]:
        import torch

        peer = f"trainer rank {trainer}"
        book = Ledger(trainer, version, ranges)
        sums: dict[int, int] = {}
        head = torch.empty(5, dtype=torch.int64, device=flat.device)
        while True:
            self.t.check(peer)
            head.zero_()  # a receive that failed unnoticed reads as a frame of kind 0, never as the last header
            wait_work(self.group.recv([head], trainer, 0), deadline, peer, f"a header of version {version}", self.t.polls)
            kind, v, offset, length, digest = (int(x) for x in head.cpu())
            book.check_version(v)
            if kind == END:
                book.end(offset, length)
                return sums
            if kind != DATA:
                raise TransferError(peer, f"sent a frame of kind {kind} for bytes at {offset} of version {version}")
            book.take("DATA", offset, length)
            target = flat[offset:offset + length]
            wait_work(self.group.recv([target], trainer, 0), deadline, peer, f"bytes at {offset} of version {version}",
                  self.t.polls)
            got = bucket_checksum(target)  # on the current stream, which the wait ordered after the receive
            book.checksum(offset, length, _unsigned(digest), got)
            sums[offset] = got

    def close(self) -> None:
        self.t.abort("the receiver closed")
