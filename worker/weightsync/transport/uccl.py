"""UCCL P2P transport: one-sided RDMA writes straight into the inference rank's staging buffer.

Written for the `uccl` package's P2P engine at exactly version UCCL_VERSION (`from uccl import
p2p`): `p2p.Endpoint(local_gpu_idx)`, `get_metadata()` / `Endpoint.parse_metadata()`, `connect()`
/ `accept()`, `reg(ptr, size)` to register memory once, `advertise(conn_id, mr_id, ptr, size)` for
the 64-byte descriptor of a remote-writable region, `write_async(conn_id, mr_id, ptr, size,
descriptor)` and `poll_async(transfer_id)`. uccl reads its settings from UCCL_P2P_RDMA_DEV,
UCCL_P2P_RDMA_GID_INDEX, UCCL_P2P_RDMA_TC, UCCL_P2P_RDMA_SL and UCCL_SOCKET_IFNAME (the job
contract sets them). It runs over RDMA devices; without one, its engine ends the process (an
assertion in its NIC setup, seen on a GPU machine without RDMA NICs), unless
UCCL_P2P_TRANSPORT=tcp selects its TCP mode. So a machine without RDMA devices is refused here,
with that reason, before any engine starts.

Control travels over the TCP transport's authenticated connection and frames (wire.py): the
HMAC handshake first, then, before the verdict, the receiver's endpoint metadata, the RDMA
connect/accept, and the sender's own metadata. For each version the receiver advertises every
range it expects from that trainer (an ADVERT frame); the trainer RDMA-writes each bucket from its
registered send buffer into place, then sends a WRITTEN frame with the bucket's checksum, which
the receiver verifies over the landed bytes; END closes the version as over TCP.

What uccl cannot tell, the transport checks. In this version connect, write and poll report
success whatever happens and accept never times out, so:
- accept() runs on a thread of its own for the receiver's life (Acceptor); an admission waits,
  with a deadline, for the accepted connection that comes from the address and GPU the trainer
  names over its authenticated socket, and never holds a lock while uccl blocks. Whoever
  connects over RDMA without passing the handshake is never matched to a trainer.
- connect() runs on a helper thread with a deadline (base.bounded); a write's completion is
  polled until the transfer timeout; a write that reported success and landed nothing fails the
  bucket's checksum.
- A transfer size is 32-bit: ranges of 4 GiB or more are refused (its capabilities' range_limit,
  which the planner keeps buckets under).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from weightsync.transport import wire
from weightsync.transport.base import (
    Capabilities,
    Filling,
    RankContext,
    TransferError,
    Transport,
    TransportUnavailable,
    bounded,
    cuda_unavailable_reason,
)
from weightsync.transport.checksum import bucket_checksum
from weightsync.transport.landing import Landing
from weightsync.transport.sockets import client_handshake, recv_exact, send_all
from weightsync.transport.tcp import TcpSender
from weightsync.transport.tcp_receiver import TcpReceiver
from weightsync.transport.wire import ADVERT, WRITTEN

log = logging.getLogger("weightsync.transport")

ADVERT_ENTRY = struct.Struct("<QQ64s")  # offset, length, the engine's 64-byte descriptor
# One entry per bucket a trainer rank sends an inference rank in a version: a million 1 MiB
# buckets (the smallest) is a terabyte from one trainer rank. The entries are read a batch at a
# time, so memory follows the bytes that arrive, never the count a peer announces.
MAX_ADVERT_ENTRIES = 1 << 20
ADVERT_BATCH = 4096
UCCL_VERSION = "0.1.1"  # the uccl release this transport is written against (pyproject pins it)
# The longest an admission waits for the trainer's RDMA connection to be accepted.
ACCEPT_SECONDS = 30.0
# Accepted RDMA connections no trainer claimed, kept to be matched (the oldest go first).
UNCLAIMED_KEPT = 64
POLL_PAUSE = 20e-6  # between polls of a write's completion: the other connections' threads need the GIL
METADATA_MAX = 1024  # bytes of an endpoint's metadata (an address, a port, a GPU index)
SYSFS_RDMA = "/sys/class/infiniband"  # where the kernel lists RDMA devices (InfiniBand, RoCE, EFA)


def unavailable_reason() -> str | None:
    """Why UCCL P2P cannot run here, or None."""
    from importlib import metadata

    try:
        installed = metadata.version("uccl")
    except metadata.PackageNotFoundError:
        return f"the uccl package is not installed (pip install uccl=={UCCL_VERSION})"
    if installed != UCCL_VERSION:
        return f"uccl {installed} is installed; this transport is written for uccl=={UCCL_VERSION}"
    try:
        import uccl.p2p  # noqa: F401 - the package's __init__ hides this import's own error
    except ImportError as e:
        hint = (" (its engine is built for CUDA 12: put CUDA 12's runtime on the library path, as CUDA 12 images "
                "have it, or pip install nvidia-cuda-runtime-cu12 and add its lib folder to LD_LIBRARY_PATH)"
                if "libcudart.so.12" in str(e) else "")
        return f"uccl {installed}'s P2P engine does not load here: {e}{hint}"
    return rdma_unavailable_reason() or cuda_unavailable_reason()


def rdma_unavailable_reason() -> str | None:
    """Why uccl's engine would end this process (no RDMA device, and not its TCP mode), or None."""
    if os.environ.get("UCCL_P2P_TRANSPORT", "").lower() == "tcp":
        return None
    try:
        devices = os.listdir(SYSFS_RDMA)
    except OSError:
        devices = []
    if devices:
        return None
    return (f"no RDMA device here ({SYSFS_RDMA} lists none), and uccl {UCCL_VERSION}'s engine ends the process "
            "without one; UCCL_P2P_TRANSPORT=tcp selects its TCP mode")


@dataclass(frozen=True)
class UcclOptions:
    gpu: int = 0  # the local GPU index of this rank's engine


class UcclTransport(Transport):
    name = "uccl"
    # one-sided writes from registered GPU memory, each whole into one run, with a 32-bit size
    capabilities = Capabilities(buffer_device="cuda", range_limit=(1 << 32) - 1)
    Options = UcclOptions

    def __init__(self, token: bytes, timeout: float, options: UcclOptions = UcclOptions()):
        reason = unavailable_reason()
        if reason:
            raise TransportUnavailable(f"uccl: {reason}")
        from uccl import p2p

        self.p2p, self.token, self.timeout, self.gpu = p2p, token, timeout, options.gpu
        self._endpoint = None
        self.lock = threading.Lock()

    @classmethod
    def options_for(cls, context: RankContext) -> UcclOptions:
        return UcclOptions(gpu=context.device.index)

    @property
    def endpoint(self):
        with self.lock:
            if self._endpoint is None:
                self._endpoint = self.p2p.Endpoint(self.gpu)
            return self._endpoint

    def sender(self, rank: int) -> "UcclSender":
        return UcclSender(self, rank)

    def receiver(self, rank: int) -> "UcclReceiver":
        return UcclReceiver(self, rank)


class Registered:
    """Memory regions registered once with the engine, found again by address."""

    def __init__(self, endpoint):
        self.endpoint = endpoint
        self.regions: list[tuple[int, int, int]] = []  # (ptr, size, mr_id)

    def add(self, tensors: list) -> None:
        for t in tensors:
            ptr, size = t.data_ptr(), t.numel() * t.element_size()
            if self.find(ptr, size) is None:
                ok, mr_id = self.endpoint.reg(ptr, size)
                if not ok:
                    raise TransferError("uccl", f"registering {size} bytes at {ptr:#x} failed")
                self.regions.append((ptr, size, mr_id))

    def find(self, ptr: int, size: int) -> int | None:
        for base, n, mr_id in self.regions:
            if base <= ptr and ptr + size <= base + n:
                return mr_id
        return None


class Acceptor:
    """uccl's accept(), run on a thread of its own for the receiver's life (it blocks, with no
    deadline, and names no peer); admissions claim the connection that came from the address
    and GPU their trainer names, waiting for it until their deadline."""

    def __init__(self, endpoint, name: str):
        self.endpoint = endpoint
        self.accepted: list[tuple[str, int, int]] = []  # (ip, gpu, conn_id), not claimed yet
        self.cond = threading.Condition()
        self.closed = False
        threading.Thread(target=self._run, daemon=True, name=f"uccl-accept-{name}").start()

    def _run(self) -> None:
        while not self.closed:
            try:
                ok, ip, gpu, conn_id = self.endpoint.accept()
            except Exception as e:  # noqa: BLE001 - the engine is gone: admissions then time out, saying so
                log.warning("UCCL accept stopped: %s", e)
                return
            with self.cond:
                if not ok:
                    log.warning("a UCCL accept failed")
                    continue
                self.accepted.append((ip, gpu, conn_id))
                del self.accepted[:-UNCLAIMED_KEPT]
                self.cond.notify_all()

    def claim(self, ip: str, gpu: int, seconds: float) -> int:
        """The conn_id of the RDMA connection from (ip, gpu), once it is accepted."""
        deadline = time.monotonic() + seconds
        with self.cond:
            while True:
                for i, (a, g, conn_id) in enumerate(self.accepted):
                    if (a, g) == (ip, gpu):
                        del self.accepted[i]
                        return conn_id
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    raise ConnectionError(f"no RDMA connection from {ip} (GPU {gpu}) was accepted within {seconds:g}s")
                self.cond.wait(left)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class UcclSender(TcpSender):
    capabilities = UcclTransport.capabilities

    def __init__(self, transport: UcclTransport, rank: int):
        super().__init__(rank, transport.token, transport.timeout)
        self.t = transport
        self.memory = Registered(transport.endpoint)
        self.rdma: dict[int, int] = {}  # inference rank -> engine conn_id
        # inference rank -> (version, {offset: (length, descriptor)}); each entry is read and
        # written only by the thread of that rank's connection
        self.adverts: dict[int, tuple[int, dict[int, tuple[int, bytes]]]] = {}

    def handshake(self, sock: socket.socket, peer: int) -> None:
        def rdma_connect(s: socket.socket) -> None:
            (n,) = struct.unpack("<I", recv_exact(s, 4))
            if n > METADATA_MAX:
                raise ConnectionError(f"{n} bytes of endpoint metadata (at most {METADATA_MAX})")
            ip, port, gpu = self.t.p2p.Endpoint.parse_metadata(recv_exact(s, n))
            ok, conn_id = bounded(lambda: self.t.endpoint.connect(ip, gpu, remote_port=port),
                                      min(self.timeout, ACCEPT_SECONDS), f"UCCL connect to {ip}:{port}")
            if not ok:
                raise ConnectionError(f"UCCL connect to {ip}:{port} failed")
            mine = bytes(self.t.endpoint.get_metadata())  # so that the receiver claims this connection
            s.sendall(struct.pack("<I", len(mine)) + mine)
            self.rdma[peer] = conn_id

        client_handshake(sock, self.token, self.rank, peer, before_verdict=rdma_connect)

    def register(self, buffers: list) -> None:
        self.memory.add(buffers)

    def drop(self, peer: int) -> None:
        super().drop(peer)
        self.rdma.pop(peer, None)
        self.adverts.pop(peer, None)

    def _advert(self, sock: socket.socket, peer: int, version: int, offset: int) -> tuple[int, bytes]:
        seen = self.adverts.get(peer)
        if seen is None or seen[0] != version:
            kind, v, count, length, _ = wire.parse_header(recv_exact(sock, wire.HEADER.size))
            if kind != ADVERT or v != version:
                raise ConnectionError(f"expected the advertisement of version {version}, got kind {kind} version {v}")
            if count > MAX_ADVERT_ENTRIES or length != count * ADVERT_ENTRY.size:
                raise ConnectionError(f"an advertisement of {count} entries in {length} bytes (entries are "
                                      f"{ADVERT_ENTRY.size} bytes, at most {MAX_ADVERT_ENTRIES})")
            entries: dict[int, tuple[int, bytes]] = {}
            for first in range(0, count, ADVERT_BATCH):
                n = min(ADVERT_BATCH, count - first)
                for o, size, blob in ADVERT_ENTRY.iter_unpack(recv_exact(sock, n * ADVERT_ENTRY.size)):
                    entries[o] = (size, blob)
            self.adverts[peer] = (version, entries)
        try:
            return self.adverts[peer][1][offset]
        except KeyError:
            raise ConnectionError(f"inference rank {peer} did not advertise byte {offset} of version {version}") from None

    def send(self, peer: int, version: int, offset: int, data: Any, filling: Filling | None = None) -> Future:
        length = data.numel() * data.element_size()
        limit = self.capabilities.range_limit
        if length > limit:
            raise ValueError(f"a {length}-byte bucket: uccl moves at most {limit} bytes at a time")
        mr_id = self.memory.find(data.data_ptr(), length)
        if mr_id is None:
            raise ValueError("UCCL writes from registered memory: register() the send buffers first")
        self.tally.add(version, peer, length)
        endpoint, conn_id = self.t.endpoint, self.rdma[peer]

        def work(conn) -> int:
            digest = bucket_checksum(data, filling)  # waits until the bytes are whole
            size, blob = self._advert(conn.sock, peer, version, offset)
            if size != length:
                raise ConnectionError(f"advertised {size} bytes at {offset}, the bucket has {length}")
            ok, transfer = endpoint.write_async(conn_id, mr_id, data.data_ptr(), length, blob)
            if not ok:
                raise ConnectionError(f"RDMA write of bytes [{offset}, {offset + length}) could not start")
            deadline = time.monotonic() + self.timeout
            while True:
                ok, done = endpoint.poll_async(transfer)
                if not ok:
                    raise ConnectionError(f"RDMA write of bytes [{offset}, {offset + length}) failed")
                if done:
                    break
                if time.monotonic() > deadline:
                    raise socket.timeout()
                time.sleep(POLL_PAUSE)
            send_all(conn.sock, [memoryview(wire.header(WRITTEN, version, offset, length, digest))])
            return digest

        return self.submit(peer, version, work)


class UcclReceiver(TcpReceiver):
    name = "uccl"
    capabilities = UcclTransport.capabilities
    carried = (WRITTEN,)  # the sender writes one-sided and never sends DATA, nor PATCH

    def __init__(self, transport: UcclTransport, rank: int):
        super().__init__(rank, transport.token, transport.timeout)
        self.t = transport
        self.memory = Registered(transport.endpoint)
        self.rdma: dict[int, int] = {}  # trainer rank -> engine conn_id
        self.acceptor: Acceptor | None = None

    def register(self, buffers: list) -> None:
        self.memory.add(buffers)

    def listen(self, host: str, port: int) -> str:
        self.acceptor = Acceptor(self.t.endpoint, f"inference-{self.rank}")  # before the door lets anyone in
        return super().listen(host, port)

    def after_handshake(self, sock: socket.socket, trainer: int) -> None:
        """On the door's thread for this connection only: the trainer connects over RDMA, names
        where it connects from, and this rank claims that connection."""
        meta = bytes(self.t.endpoint.get_metadata())
        sock.sendall(struct.pack("<I", len(meta)) + meta)
        (n,) = struct.unpack("<I", recv_exact(sock, 4))
        if n > METADATA_MAX:
            raise ConnectionError(f"{n} bytes of endpoint metadata (at most {METADATA_MAX})")
        ip, _, gpu = self.t.p2p.Endpoint.parse_metadata(recv_exact(sock, n))
        self.rdma[trainer] = self.acceptor.claim(ip, gpu, min(self.timeout, ACCEPT_SECONDS))

    def before_receive(self, sock: socket.socket, trainer: int, version: int, landing: Landing,
                       ranges: list[tuple[int, int]]) -> None:
        buffer = landing.device
        if buffer is None:
            raise ValueError("the uccl transport receives into a GPU tensor")
        base = buffer.data_ptr()
        mr_id = self.memory.find(base, landing.size)
        if mr_id is None:
            raise ValueError("the staging buffer is not registered: call register() once first")
        entries, limit = [], self.capabilities.range_limit
        for offset, length in ranges:
            if length > limit:
                raise ValueError(f"a {length}-byte range: uccl moves at most {limit} bytes at a time")
            ok, blob = self.t.endpoint.advertise(self.rdma[trainer], mr_id, base + offset, length)
            if not ok:
                raise ConnectionError(f"advertising bytes [{offset}, {offset + length}) failed")
            entries.append(ADVERT_ENTRY.pack(offset, length, blob))
        payload = b"".join(entries)
        send_all(sock, [memoryview(wire.header(ADVERT, version, len(entries), len(payload))), memoryview(payload)])

    def written(self, landing: Landing, offset: int, length: int) -> int:
        """The checksum of a range the sender wrote: its write completed before it sent WRITTEN,
        so the bytes are in place for any stream (no device-wide synchronize, which would stall
        inference)."""
        import torch

        return bucket_checksum(landing.device.view(torch.uint8).reshape(-1)[offset:offset + length])

    def close(self) -> None:
        if self.acceptor is not None:
            self.acceptor.close()
        super().close()
