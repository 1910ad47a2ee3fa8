"""The TCP transport's receiver, an inference rank's side (tcp.py is the transport and its sender).

The receiver's port is open to anyone who can reach it. Its door (door.py) accepts and
challenges every connection in one thread, caps those that have not proven the job token and
times them out; only a connection that proves the token gets a thread. After that, a trainer
may send exactly the ranges the plan gives it, once each (ledger.py keeps the count), and an END
that counts them: any other frame cuts its connection off and fails the version, naming the
trainer rank. Each DATA frame lands straight in place in the staging buffer (recv_into), in the
runs of the plan's bucket where it bundles several; a patch (PATCH, or STREAM while it is made) is
applied with the caller's Patcher as it arrives, and after the version's END the receiver tells
the sender which patches it could not apply (NEED).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from typing import Any, Mapping, Sequence

import xxhash

from weightsync.transport import wire
from weightsync.transport.base import Capabilities, Patcher, Receiver, TransferError, each_peer
from weightsync.transport.door import Door
from weightsync.transport.landing import Landing
from weightsync.transport.ledger import Ledger
from weightsync.transport.sockets import SOCKET_BUFFER, hang_up, recv_exact, recv_into_all, tune
from weightsync.transport.wire import DATA, END, KIND_NAMES, PATCH, PIECE, STREAM, STREAM_TRAILER, TRAILER

log = logging.getLogger("weightsync.transport")

# connections the kernel queues before the door accepts them (they cost no thread)
BACKLOG = 64
# refusal reasons kept, to say why a trainer never connected
REFUSED_KEPT = 8


class TcpReceiver(Receiver):
    name = "tcp"
    # bytes leave from lists of memoryviews of host memory, ranges may go as patches, and a
    # receiver lands a DATA frame in several runs
    capabilities = Capabilities(patches=True, scatters=True, in_place=True, buffer_device="cpu")
    carried = (DATA,)  # the frame kinds that deliver a range whole over this transport

    def __init__(self, rank: int, token: bytes, timeout: float = 300.0, socket_buffer: int = SOCKET_BUFFER):
        if len(token) < 16:
            raise ValueError("the job token must be at least 16 bytes")
        self.rank, self.token, self.timeout, self.socket_buffer = rank, token, timeout, socket_buffer
        self.conns: dict[int, socket.socket] = {}
        self.refused: collections.deque[str] = collections.deque(maxlen=REFUSED_KEPT)  # why the latest were refused
        self.trainers: int | None = None  # the plan's trainer ranks, once known
        self.cond = threading.Condition()
        self.door: Door | None = None
        self.closed = False

    def listen(self, host: str, port: int) -> str:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(BACKLOG)
        endpoint = f"{host}:{listener.getsockname()[1]}"
        self.door = Door(listener, f"inference rank {self.rank}", lambda: wire.challenge(self.rank), self._prove,
                         self._admit, self._refused)
        if self.trainers is not None:
            self.door.set_cap(self.trainers)
        return endpoint

    def expect_trainers(self, trainers: int) -> None:
        self.trainers = trainers
        if self.door is not None:
            self.door.set_cap(trainers)

    def _prove(self, challenge: bytes, answer: bytes) -> int:
        """The trainer rank an ANSWER proves; raises without having read anything beyond it."""
        trainer, target = wire.check_answer(self.token, challenge, answer)
        if target != self.rank:
            raise ConnectionError(f"trainer rank {trainer} meant inference rank {target}, this is {self.rank}")
        if self.trainers is not None and trainer >= self.trainers:
            raise ConnectionError(f"trainer rank {trainer} is not in the plan, which has {self.trainers} trainer ranks")
        return trainer

    def _refused(self, reason: str) -> None:
        with self.cond:
            self.refused.append(reason)
            self.cond.notify_all()

    def _admit(self, sock: socket.socket, addr: str, trainer: int, challenge: bytes, answer: bytes) -> None:
        """A connection that proved the token: the transport's own set-up, the verdict, then it
        is the trainer's connection (on the door's thread for this one connection)."""
        tune(sock, self.socket_buffer, min(self.timeout, 30.0))
        try:
            self.after_handshake(sock, trainer)
            sock.sendall(wire.verdict(self.token, challenge, answer))
        except (OSError, ConnectionError, ValueError) as e:
            reason = f"refused connection from {addr}: trainer rank {trainer}'s set-up failed: {e}"
            log.warning("inference rank %d %s", self.rank, reason)
            self._refused(reason)
            hang_up(sock)
            return
        sock.settimeout(self.timeout)
        with self.cond:
            if self.closed:
                sock.close()
                return
            old = self.conns.pop(trainer, None)
            if old is not None:
                log.warning("inference rank %d: trainer rank %d reconnected; dropping its old connection", self.rank, trainer)
                hang_up(old)
            self.conns[trainer] = sock
            self.cond.notify_all()

    def after_handshake(self, sock: socket.socket, trainer: int) -> None:
        """Hook for transports that set up more per connection (RDMA) before the verdict."""

    def wait_connection(self, trainer: int, deadline: float, abandon: threading.Event) -> socket.socket:
        """The trainer's connection, once it has proven itself; gives up at `deadline` or as soon
        as `abandon` (another peer's failure) is set."""
        start = time.monotonic()
        with self.cond:
            while trainer not in self.conns:
                left = deadline - time.monotonic()
                if abandon.is_set():
                    raise TransferError(f"trainer rank {trainer}", "not connected when the version was abandoned")
                if left <= 0 or self.closed:
                    refused = f" (refused meanwhile: {'; '.join(list(self.refused)[-3:])})" if self.refused else ""
                    raise TransferError(f"trainer rank {trainer}",
                                        f"did not connect within {time.monotonic() - start:.0f}s{refused}")
                self.cond.wait(left)
            return self.conns[trainer]

    def drop(self, trainer: int) -> None:
        with self.cond:
            sock = self.conns.pop(trainer, None)
        if sock is not None:
            hang_up(sock)

    def receive(self, version: int, buffer: Any, expected: dict[int, list[tuple[int, int]]], timeout: float,
                patcher: Patcher | None = None, scatter: Mapping[int, Sequence[tuple[int, int]]] | None = None,
                ) -> dict[int, int]:
        landing = Landing(buffer)
        scatter = scatter or {}
        if scatter and not self.capabilities.scatters:
            raise ValueError(f"the {self.name} transport lands every range in one run; this plan bundles runs of "
                             "several tensors into one bucket (a plan made for a transport that scatters, as tcp)")
        for trainer, ranges in expected.items():
            for offset, length in ranges:
                runs = scatter.get(offset, ((offset, length),))
                if sum(n for _, n in runs) != length or any(o < 0 or o + n > landing.size for o, n in runs):
                    raise ValueError(f"trainer rank {trainer}'s range at {offset} ({length} bytes in runs {list(runs)[:4]}) "
                                     f"does not fit the {landing.size}-byte buffer")
        deadline = time.monotonic() + timeout
        abandon = threading.Event()

        def lost(_: Exception) -> None:  # unblock the others: this version is lost
            with self.cond:
                abandon.set()
                self.cond.notify_all()
            for other in expected:
                self.drop(other)

        results = each_peer(expected, lambda t: self.receive_from(t, version, landing, expected[t], deadline, abandon,
                                                                  patcher, scatter), lost)
        return {offset: digest for sums in results.values() for offset, digest in sums.items()}

    def receive_from(self, trainer: int, version: int, landing: Landing, ranges: list[tuple[int, int]],
                     deadline: float, abandon: threading.Event, patcher: Patcher | None = None,
                     scatter: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> dict[int, int]:
        peer = f"trainer rank {trainer}"
        sock = self.wait_connection(trainer, deadline, abandon)
        try:
            return self._frames(sock, trainer, version, landing, ranges, patcher, scatter or {})
        except socket.timeout:
            error = TransferError(peer, f"silent for {self.timeout:g}s during version {version}")
        except wire.WireError as e:
            error = TransferError(peer, f"{e} during version {version}")
        except TransferError as e:
            error = e
        except (OSError, ConnectionError) as e:
            error = TransferError(peer, f"connection lost during version {version}: {e}")
        # cut off at once: nothing more it sends is read, and the version fails (never verified)
        log.warning("inference rank %d cut off %s", self.rank, error)
        self.drop(trainer)
        raise error

    def _frames(self, sock: socket.socket, trainer: int, version: int, landing: Landing,
                ranges: list[tuple[int, int]], patcher: Patcher | None,
                scatter: Mapping[int, Sequence[tuple[int, int]]]) -> dict[int, int]:
        """Read one version's frames from a trainer: each range the plan gives it exactly once
        (whole, or as a PATCH), then END with the right counts; after an END that closed patches,
        NEED names the patched ranges to send again whole, and those follow with another END.
        Any frame beyond that is refused before a byte of its payload is read, and no buffer is
        ever sized by a length the peer sent beyond what the plan allows (the payload of a range
        lands in place, or in a bounce buffer of at most that range or its patch limit)."""
        book = Ledger(trainer, version, ranges)
        sums: dict[int, int] = {}
        bounce: dict = {}
        patches = 0
        need: list[int] = []  # patched ranges to ask for again, whole
        self.before_receive(sock, trainer, version, landing, ranges)
        while True:
            kind, v, offset, length, digest = wire.parse_header(recv_exact(sock, wire.HEADER.size))
            book.check_version(v)
            if kind == END:
                book.end(offset, length)
                if not patches:
                    return sums
                sock.sendall(wire.need(version, need))  # the sender waits for this verdict on its patches
                if not need:
                    return sums
                book.again(need)
                patches, need = 0, []
                continue
            if kind in (PATCH, STREAM):
                if not self.capabilities.patches:
                    raise TransferError(book.peer, f"sent a {KIND_NAMES[kind]} for bytes at {offset} of version "
                                                   f"{version}: a sender never sends patches over the {self.name} "
                                                   "transport")
                if kind == STREAM and length:
                    raise TransferError(book.peer, f"sent a STREAM of {length} bytes for bytes at {offset} of version "
                                                   f"{version}: a STREAM's length is 0, its pieces count its bytes")
                size = book.take_patch(offset, length, wire.patch_limit)
                if kind == STREAM:
                    applied, digest = self.stream(sock, offset, size, patcher, bounce, book)
                else:
                    applied = self.patch(sock, offset, size, length, digest, patcher, bounce)
                if applied:
                    sums[offset] = digest
                else:
                    need.append(offset)
                patches += 1
                continue
            if kind not in self.carried:
                raise TransferError(book.peer, f"sent {KIND_NAMES[kind]} for bytes [{offset}, {offset + length}) of "
                                               f"version {version}: a sender never sends {KIND_NAMES[kind]} over the "
                                               f"{self.name} transport")
            book.take(KIND_NAMES[kind], offset, length)
            if kind == DATA:
                got = landing.receive(sock, offset, length, bounce, scatter.get(offset))
                (digest,) = TRAILER.unpack(recv_exact(sock, TRAILER.size))
            else:
                got = self.written(landing, offset, length)
            book.checksum(offset, length, digest, got)
            sums[offset] = got

    @staticmethod
    def patch(sock: socket.socket, offset: int, size: int, length: int, checksum: int, patcher: Patcher | None,
              bounce: dict) -> bool:
        """Receive a PATCH's `length` payload bytes and its trailer, and apply it to the range
        [offset, offset + size), chunk by chunk as they arrive; False when it is not applied
        (then the range must come whole). Only a patch whose bytes match its trailer and whose
        new bytes match `checksum` counts as applied."""
        scratch = bounce.get("patch")
        if scratch is None or len(scratch) < length:
            scratch = bounce["patch"] = bytearray(length)
        payload = memoryview(scratch)[:length]
        applying = patcher.begin(offset, size) if patcher is not None else None
        recv_into_all(sock, payload, progress=None if applying is None else lambda got: applying.feed(payload, got))
        (trailer,) = TRAILER.unpack(recv_exact(sock, TRAILER.size))
        return verdict(patcher, applying, offset, size, payload, trailer, checksum)

    @staticmethod
    def stream(sock: socket.socket, offset: int, size: int, patcher: Patcher | None, bounce: dict,
               book: Ledger) -> tuple[bool, int]:
        """Receive a STREAM's pieces and trailer, applying the patch to the range [offset, offset
        + size) as they arrive; (applied, the new bytes' checksum), as patch() decides. More than
        patch_limit(size) bytes of patch is refused before they are read."""
        limit = wire.patch_limit(size)
        scratch = bounce.get("patch")
        applying = patcher.begin(offset, size) if patcher is not None else None
        at = 0
        while True:
            (n,) = PIECE.unpack(recv_exact(sock, PIECE.size))
            if n == 0:
                break
            if at + n > limit:
                raise TransferError(book.peer, f"sent more than {limit} bytes of patch for bytes at {offset} of "
                                               f"version {book.version}")
            if scratch is None or len(scratch) < at + n:  # grows to the largest patch, then is kept
                grown = bytearray(min(limit, max(at + n, 2 * len(scratch or b""), 1 << 20)))
                grown[:at] = memoryview(scratch)[:at] if scratch is not None else b""
                scratch = bounce["patch"] = grown
            view = memoryview(scratch)
            recv_into_all(sock, view[at:at + n],
                          progress=None if applying is None else lambda got, at=at: applying.feed(view, at + got))
            at += n
        checksum, trailer = STREAM_TRAILER.unpack(recv_exact(sock, STREAM_TRAILER.size))
        return verdict(patcher, applying, offset, size, memoryview(scratch)[:at] if at else b"", trailer,
                       checksum), checksum

    def before_receive(self, sock: socket.socket, trainer: int, version: int, landing: Landing,
                       ranges: list[tuple[int, int]]) -> None:
        """Hook for transports that tell the sender where to write (RDMA advertisements)."""

    def written(self, landing: Landing, offset: int, length: int) -> int:
        """Checksum of a range the sender wrote one-sided (RDMA transports only, which carry
        WRITTEN frames)."""
        raise NotImplementedError(f"{type(self).__name__} receives no one-sided writes: only the RDMA and IPC "
                                  "transports send WRITTEN frames")

    def close(self) -> None:
        if self.door is not None:
            self.door.close()
        with self.cond:
            self.closed = True
            socks = list(self.conns.values())
            self.conns.clear()
            self.cond.notify_all()
        for s in socks:
            hang_up(s)


def verdict(patcher: Patcher | None, applying, offset: int, size: int, payload, trailer: int, checksum: int) -> bool:
    """Whether a patch that has all arrived is applied: its bytes match their trailer, and the new
    bytes theirs (`checksum`); else the patcher notes why not, and the range must come whole."""
    if patcher is None:
        return False
    if xxhash.xxh3_64_intdigest(payload) != trailer:
        patcher.refuse(offset, size, "the patch was damaged in transit (its checksum differs)")
        return False
    return patcher.end(applying, offset, size, payload, checksum)
