"""Where a receiver lands a range's bytes: in place in a host staging buffer, or on a device
staging buffer through a pinned host bounce buffer, copied on to the device while the next bytes
arrive. Used by the socket transports (tcp, and the control channel of uccl and ipc, whose
receivers name their device buffer through it).
"""

from __future__ import annotations

import socket
from typing import Any, Sequence

import xxhash

from weightsync.transport.checksum import as_views
from weightsync.transport.sockets import PeerClosed

# bytes received at a time into the landing buffer and hashed at once (measured best with
# `weightsync bench`)
RECV_CHUNK = 128 << 10
# bytes landed in the pinned bounce buffer before they are copied on to a device staging buffer
COPY_STEP = 4 << 20


class Landing:
    """Where received ranges land: a host buffer directly, or a device tensor through a pinned
    host bounce buffer (TCP carries host memory): the bytes that have arrived are copied on to
    the device on a stream of the receiving thread's own while the next ones arrive, and the
    range is on the device when receive() returns."""

    def __init__(self, buffer: Any):
        self.device = None
        if hasattr(buffer, "data_ptr") and buffer.device.type != "cpu":
            self.device = buffer
            self.size = buffer.numel() * buffer.element_size()
        else:
            self.view = as_views(buffer)[0]
            self.size = len(self.view)

    def receive(self, sock: socket.socket, offset: int, length: int, bounce: dict,
                runs: Sequence[tuple[int, int]] | None = None) -> int:
        """Receive `length` bytes for `offset` (or for `runs`, (offset, length) in turn), hashing
        each chunk as it arrives; returns the xxh3_64. `bounce` is the receiving thread's own."""
        runs = runs or ((offset, length),)
        if self.device is None:
            targets = [self.view[o:o + n] for o, n in runs]
            onward = None
        else:
            onward = DeviceCopier(self.device, runs, length, bounce)
            targets = [onward.host]
        h, got = xxhash.xxh3_64(), 0
        for target in targets:
            at = 0
            while at < len(target):
                n = sock.recv_into(target[at:at + RECV_CHUNK])
                if n == 0:
                    raise PeerClosed(f"connection closed after {got + at} of {length} bytes of the range at {offset}")
                h.update(target[at:at + n])
                at += n
                if onward is not None:
                    onward.arrived(at)
            got += at
        if onward is not None:
            onward.finish()
        return h.intdigest()


class DeviceCopier:
    """The bytes of one range, landed in a pinned host buffer, copied on to their runs of a
    device tensor in steps of COPY_STEP bytes as they arrive (non-blocking, on a stream of the
    receiving thread's own); finish() waits for that stream alone."""

    def __init__(self, device_buffer, runs: Sequence[tuple[int, int]], length: int, bounce: dict):
        import torch

        if bounce.get("pinned") is None or bounce["pinned"].numel() < length:
            bounce["pinned"] = torch.empty(length, dtype=torch.uint8, pin_memory=True)
        if bounce.get("stream") is None:
            bounce["stream"] = torch.cuda.Stream(device_buffer.device)
        self.pinned, self.stream = bounce["pinned"][:length], bounce["stream"]
        self.host = memoryview(self.pinned.numpy())
        self.device = device_buffer.view(torch.uint8).reshape(-1)
        self.runs, self.length, self.copied = list(runs), length, 0

    def arrived(self, ready: int) -> None:
        if ready - self.copied >= COPY_STEP or ready == self.length:
            self._copy(ready)

    def _copy(self, ready: int) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            at = 0
            for o, n in self.runs:  # the part of [copied, ready) of the range's bytes in each run
                lo, hi = max(self.copied, at), min(ready, at + n)
                if lo < hi:
                    self.device[o + lo - at:o + hi - at].copy_(self.pinned[lo:hi], non_blocking=True)
                at += n
        self.copied = ready

    def finish(self) -> None:
        if self.copied < self.length:
            self._copy(self.length)
        self.stream.synchronize()
