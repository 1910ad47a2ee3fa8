"""The colocated transport (`ipc`): trainer and inference processes on one node, sharing a GPU or
seeing each other's, hand versions over through CUDA IPC (the colocated mode of
checkpoint-engine and verl).

Each inference rank exports a CUDA IPC handle of each of its staging buffers once; a trainer
opens each handle once (registered once: the buffers stay for the job) and copies every bucket
from its send buffer straight into place in the receiver's staging buffer, a device-to-device
copy on a stream of its own, then says so with a WRITTEN frame carrying the bucket's ws64. The
receiver checks ws64 over the landed bytes on a stream of its own, as the uccl transport does.

Control travels over the TCP transport's authenticated connection and frames (wire.py), as for
uccl: the HMAC handshake, then per version an ADVERT from the receiver naming the buffer the
version lands in (its GPU's UUID and the handle), WRITTEN per bucket, END. A trainer finds the
receiver's GPU by UUID among the GPUs it sees; a GPU it cannot see is a clear error, never a
fallback to another transport.
"""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from weightsync.transport import wire
from weightsync.transport.base import (
    Capabilities,
    Filling,
    RankContext,
    Transport,
    TransportUnavailable,
    cuda_unavailable_reason,
)
from weightsync.transport.checksum import bucket_checksum
from weightsync.transport.landing import Landing
from weightsync.transport.sockets import recv_exact, send_all
from weightsync.transport.tcp import TcpSender
from weightsync.transport.tcp_receiver import TcpReceiver
from weightsync.transport.wire import ADVERT, WRITTEN

ADVERT_MAX = 4096  # bytes of an advertisement: a GPU's UUID and one IPC handle


def unavailable_reason() -> str | None:
    """Why CUDA IPC cannot run here, or None."""
    return cuda_unavailable_reason()


def gpu_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def export(buffer) -> dict:
    """What another process needs to open `buffer` (a CUDA tensor): its GPU, its storage's IPC
    handle and where the tensor lies in that storage."""
    storage = buffer.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return {"gpu": gpu_uuid(buffer.device.index), "handle": handle.hex(), "size": size, "offset": offset,
            "ref_handle": ref_handle.hex(), "ref_offset": ref_offset, "event_handle": event_handle.hex(),
            "event_sync": bool(event_sync), "start": buffer.storage_offset() * buffer.element_size(),
            "bytes": buffer.numel() * buffer.element_size()}


def open_exported(desc: dict, device: int):
    """The uint8 tensor another process exported (export()), opened on local GPU `device`."""
    import torch

    storage = torch.UntypedStorage._new_shared_cuda(
        device, bytes.fromhex(desc["handle"]), desc["size"], desc["offset"], bytes.fromhex(desc["ref_handle"]),
        desc["ref_offset"], bytes.fromhex(desc["event_handle"]), desc["event_sync"])
    whole = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device))
    whole.set_(storage, 0, (desc["size"],))
    return whole[desc["start"]:desc["start"] + desc["bytes"]]


@dataclass(frozen=True)
class IpcOptions:
    """None: the ranks find each other's GPUs by UUID."""


class IpcTransport(Transport):
    name = "ipc"
    # copies out of send buffers on the GPU, each whole into one run
    capabilities = Capabilities(buffer_device="cuda")
    Options = IpcOptions

    def __init__(self, token: bytes, timeout: float, options: IpcOptions = IpcOptions()):
        reason = unavailable_reason()
        if reason:
            raise TransportUnavailable(f"ipc: {reason}")
        self.token, self.timeout = token, timeout

    @classmethod
    def options_for(cls, context: RankContext) -> IpcOptions:
        return IpcOptions()

    def sender(self, rank: int) -> "IpcSender":
        return IpcSender(self, rank)

    def receiver(self, rank: int) -> "IpcReceiver":
        return IpcReceiver(self, rank)


class IpcSender(TcpSender):
    capabilities = IpcTransport.capabilities

    def __init__(self, transport: IpcTransport, rank: int):
        super().__init__(rank, transport.token, transport.timeout)
        self.opened: dict[tuple, Any] = {}  # (IPC handle, offsets) -> the receiver's buffer, opened once
        self.landing: dict[int, tuple[int, Any]] = {}  # inference rank -> (version, its buffer for it)
        self.lock = threading.Lock()
        self.streams: dict[int, Any] = {}  # inference rank -> the stream its copies run on

    def _local_gpu(self, uuid: str) -> int:
        import torch

        for i in range(torch.cuda.device_count()):
            if gpu_uuid(i) == uuid:
                return i
        raise ConnectionError(f"the inference rank's GPU {uuid} is not visible to this trainer rank: the ipc transport "
                              "needs trainer and inference ranks on one node, with that GPU visible to both")

    def _target(self, sock: socket.socket, peer: int, version: int):
        seen = self.landing.get(peer)
        if seen is None or seen[0] != version:
            kind, v, _, length, _ = wire.parse_header(recv_exact(sock, wire.HEADER.size))
            if kind != ADVERT or v != version or length > ADVERT_MAX:
                raise ConnectionError(f"expected the advertisement of version {version}, got kind {kind} version {v} "
                                      f"({length} bytes)")
            desc = json.loads(recv_exact(sock, length))
            # one allocation of the receiver's may hold several buffers: the handle names the
            # allocation, the offsets the buffer
            key = (desc["handle"], desc["offset"], desc["start"], desc["bytes"])
            with self.lock:
                if key not in self.opened:
                    self.opened[key] = open_exported(desc, self._local_gpu(desc["gpu"]))
                buffer = self.opened[key]
            self.landing[peer] = (version, buffer)
        return self.landing[peer][1]

    def drop(self, peer: int) -> None:
        super().drop(peer)
        self.landing.pop(peer, None)

    def send(self, peer: int, version: int, offset: int, data: Any, filling: Filling | None = None) -> Future:
        import torch

        if not hasattr(data, "data_ptr") or data.device.type != "cuda":
            raise ValueError("the ipc transport sends GPU tensors")
        length = data.numel() * data.element_size()
        self.tally.add(version, peer, length)

        def work(conn) -> int:
            digest = bucket_checksum(data, filling)  # waits until the bytes are whole
            target = self._target(conn.sock, peer, version)
            if offset < 0 or offset + length > target.numel():
                raise ConnectionError(f"bytes [{offset}, {offset + length}) do not fit inference rank {peer}'s "
                                      f"{target.numel()}-byte buffer")
            if peer not in self.streams:
                self.streams[peer] = torch.cuda.Stream(data.device)
            stream = self.streams[peer]
            with torch.cuda.stream(stream):
                target[offset:offset + length].copy_(data.view(torch.uint8).reshape(-1), non_blocking=True)
            stream.synchronize()  # in place before WRITTEN says so (this stream only)
            send_all(conn.sock, [memoryview(wire.header(WRITTEN, version, offset, length, digest))])
            return digest

        return self.submit(peer, version, work)


class IpcReceiver(TcpReceiver):
    name = "ipc"
    capabilities = IpcTransport.capabilities
    carried = (WRITTEN,)  # the sender copies into place and never sends DATA, nor PATCH

    def __init__(self, transport: IpcTransport, rank: int):
        super().__init__(rank, transport.token, transport.timeout)
        self.exported: dict[int, dict] = {}  # data_ptr of a staging buffer -> its export()
        self.streams = threading.local()

    def register(self, buffers: list) -> None:
        for b in buffers:
            if b.device.type != "cuda":
                raise ValueError("the ipc transport receives into GPU tensors")
            self.exported.setdefault(b.data_ptr(), export(b))

    def before_receive(self, sock: socket.socket, trainer: int, version: int, landing: Landing,
                       ranges: list[tuple[int, int]]) -> None:
        if landing.device is None:
            raise ValueError("the ipc transport receives into a GPU tensor")
        desc = self.exported.get(landing.device.data_ptr())
        if desc is None:
            raise ValueError("the staging buffer is not registered: call register() once first")
        payload = json.dumps(desc).encode()
        send_all(sock, [memoryview(wire.header(ADVERT, version, 1, len(payload))), memoryview(payload)])

    def written(self, landing: Landing, offset: int, length: int) -> int:
        """ws64 of a range the trainer copied into place, on this thread's own stream (the copy
        finished before WRITTEN was sent)."""
        import torch

        stream = getattr(self.streams, "stream", None)
        if stream is None:
            stream = self.streams.stream = torch.cuda.Stream(landing.device.device)
        with torch.cuda.stream(stream):
            return bucket_checksum(landing.device.view(torch.uint8).reshape(-1)[offset:offset + length])
