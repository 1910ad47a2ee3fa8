"""TCP transport: sockets between every trainer rank and every inference rank.

Bytes leave straight from the sender's buffers (sendmsg of memoryviews, no joining) and land
straight in place in the receiver's staging buffer (recv_into). Both sides move a range in
cache-sized chunks and hash each chunk while it is still in cache; the sender streams a buffer
that is still being filled (a Filling) right behind its producer. One connection per (trainer,
inference) pair, opened once and kept across versions; a rank runs its connections in parallel
threads (socket calls and xxh3 release the GIL). Every socket call has a timeout, so a dead or
silent peer becomes a TransferError naming its rank, never a hang.

The receiver, the inference rank's side, is tcp_receiver.py (what it lets a trainer send, and how
it lands the bytes); this module is the transport and its sender, the trainer rank's side.

A range may also go as a patch against bytes the receiver holds (delta versions): a PATCH frame
where the patch was all made when its connection got to it, else a STREAM frame that carries its
pieces as they are made, so the wire overlaps the encoding. The receiver applies it with the
caller's Patcher while it arrives, and after the version's END it tells the sender which
patches it could not apply (NEED); the sender sends those ranges whole from the bytes the caller
kept, so a refused patch costs one round trip and never a wrong byte.

The wire format (handshake and frames) is defined in wire.py, the socket calls in sockets.py, the
checks of what a trainer may send for a version in ledger.py, checksums in checksum.py.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import xxhash

from weightsync.transport import wire
from weightsync.transport.base import Filling, Pieces, RankContext, Sender, Tally, TransferError, Transport, settle
from weightsync.transport.checksum import CHUNK, as_views, checksum_of
from weightsync.transport.sockets import (
    SOCKET_BUFFER,
    ByteCursor,
    client_handshake,
    dial,
    hang_up,
    parse_endpoint,
    recv_exact,
    send_all,
)
from weightsync.transport.tcp_receiver import TcpReceiver
from weightsync.transport.wire import DATA, END, KIND_NAMES, NEED, PATCH, PIECE, STREAM, STREAM_TRAILER, TRAILER

log = logging.getLogger("weightsync.transport")

# A STREAM's pieces go out once this many bytes of them are at hand (or the patch is done): a
# bucket's patch in tens of calls rather than two per 1 MiB chunk, a few chunks' encoding behind.
STREAM_BATCH = 256 << 10


@dataclass(frozen=True)
class TcpOptions:
    socket_buffer: int = SOCKET_BUFFER  # bytes of each socket's kernel buffers (0: the kernel's autotuning)


class TcpTransport(Transport):
    name = "tcp"
    capabilities = TcpReceiver.capabilities  # what its frames carry: patches, ranges in several runs
    Options = TcpOptions

    def __init__(self, token: bytes, timeout: float = 300.0, options: TcpOptions = TcpOptions()):
        self.token, self.timeout, self.socket_buffer = token, timeout, options.socket_buffer

    @classmethod
    def options_for(cls, context: RankContext) -> TcpOptions:
        return TcpOptions()

    def sender(self, rank: int) -> "TcpSender":
        return TcpSender(rank, self.token, self.timeout, self.socket_buffer)

    def receiver(self, rank: int) -> "TcpReceiver":
        return TcpReceiver(rank, self.token, self.timeout, self.socket_buffer)


# ---------------------------------------------------------------- sender (trainer rank)


class Connection:
    """One authenticated socket to a peer, with the single thread that writes to it."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=peer.replace(" ", "-"))

    def close(self) -> None:
        hang_up(self.sock)
        self.pool.shutdown(wait=False, cancel_futures=True)


class TcpSender(Sender):
    capabilities = TcpTransport.capabilities

    def __init__(self, rank: int, token: bytes, timeout: float = 300.0, socket_buffer: int = SOCKET_BUFFER):
        if len(token) < 16:
            raise ValueError("the job token must be at least 16 bytes")
        self.rank, self.token, self.timeout, self.socket_buffer = rank, token, timeout, socket_buffer
        self.conns: dict[int, Connection] = {}
        self.pending: dict[int, list[tuple[int, Future]]] = {}
        self.tally = Tally()
        # (version, peer) -> {offset: (length, whole)} of the ranges sent as patches
        self.patched: dict[tuple[int, int], dict[int, tuple[int, Callable[[], Any]]]] = {}

    def connect(self, peers: dict[int, str]) -> None:
        deadline = time.monotonic() + self.timeout

        def one(peer: int, endpoint: str) -> Connection:
            host, port = parse_endpoint(endpoint)
            name = f"inference rank {peer}"
            try:
                sock = dial(host, port, deadline, self.socket_buffer, self.timeout)
            except TimeoutError as e:
                raise TransferError(name, str(e)) from None
            try:
                self.handshake(sock, peer)
            except (OSError, ConnectionError) as e:
                sock.close()
                raise TransferError(name, f"handshake with {endpoint} failed: {e}") from None
            return Connection(sock, name)

        new = {p: e for p, e in peers.items() if p not in self.conns}
        with ThreadPoolExecutor(max_workers=max(1, len(new))) as pool:
            futures = {p: pool.submit(one, p, e) for p, e in new.items()}
        errors = []
        for p, f in futures.items():
            if f.exception():
                errors.append(f.exception())
            else:
                self.conns[p] = f.result()
        if errors:
            raise errors[0]

    def handshake(self, sock: socket.socket, peer: int) -> None:
        client_handshake(sock, self.token, self.rank, peer)

    def connected(self, peer: int) -> bool:
        return peer in self.conns

    def cut(self, peer: int) -> None:
        conn = self.conns.get(peer)
        if conn is not None:
            try:  # shut down, not closed: the threads that use the socket still hold its descriptor
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def drop(self, peer: int) -> None:
        conn = self.conns.pop(peer, None)
        if conn is not None:
            conn.close()

    def _conn(self, peer: int) -> Connection:
        try:
            return self.conns[peer]
        except KeyError:
            raise TransferError(f"inference rank {peer}", "not connected") from None

    def submit(self, peer: int, version: int, work: Callable[[Connection], Any]) -> Future:
        """Run `work` on the peer's connection thread, in order with its other work; the future
        gives what it returns. Failures become TransferError naming the peer."""
        conn = self._conn(peer)

        def run():
            try:
                return work(conn)
            except socket.timeout:
                raise TransferError(conn.peer, f"no progress for {self.timeout:g}s while sending version {version}") from None
            except (OSError, ConnectionError) as e:
                raise TransferError(conn.peer, f"connection lost while sending version {version}: {e}") from None

        future = conn.pool.submit(run)
        self.pending.setdefault(version, []).append((peer, future))
        return future

    def send(self, peer: int, version: int, offset: int, data: Any, filling: Filling | None = None) -> Future:
        views = as_views(data)
        length = sum(len(v) for v in views)
        self.tally.add(version, peer, length)
        header = wire.header(DATA, version, offset, length)

        def stream(conn: Connection) -> int:
            h = xxhash.xxh3_64() if filling is None else None  # else the producer hashes
            cursor, sent, first = ByteCursor(views), 0, [memoryview(header)]
            try:
                while sent < length:
                    ready = length if filling is None else filling.wait(sent + 1)
                    n = min(ready - sent, CHUNK)
                    chunk = cursor.take(n)
                    send_all(conn.sock, first + chunk)
                    first = []
                    if h is not None:
                        for v in chunk:
                            h.update(v)
                    sent += n
                checksum = h.intdigest() if h is not None else filling.result()
                send_all(conn.sock, first + [memoryview(TRAILER.pack(checksum))])
                return checksum
            except BaseException:
                hang_up(conn.sock)  # the frame is cut short: the peer must not wait for the rest
                raise

        return self.submit(peer, version, stream)

    def send_patch(self, peer: int, version: int, offset: int, length: int, payload: list | Pieces,
                   checksum: int | Filling, whole: Callable[[], Any], trailer: int | None = None) -> Future:
        pieces, filling = ready(payload, checksum, length)
        self.tally.add(version, peer, length)
        self.patched.setdefault((version, peer), {})[offset] = (length, whole)
        limit = wire.patch_limit(length)

        def work(conn: Connection) -> int:
            try:
                got = pieces.wait(0)
                if pieces.closed and len(got) == len(pieces.items):  # all made already: one PATCH frame
                    views = as_views(got)
                    size, checksum = sum(len(v) for v in views), filling.result()
                    if size > limit:
                        raise ValueError(f"a {size}-byte patch of a {length}-byte range: send the range whole")
                    own = checksum_of(views) if trailer is None else trailer
                    send_all(conn.sock, [memoryview(wire.header(PATCH, version, offset, size, checksum))] + views
                             + [memoryview(TRAILER.pack(own))])
                    return checksum
                return self._stream(conn, version, offset, limit, pieces, filling, got)
            except BaseException:
                hang_up(conn.sock)  # the frame is cut short: the peer must not wait for the rest
                raise

        return self.submit(peer, version, work)

    @staticmethod
    def _stream(conn: Connection, version: int, offset: int, limit: int, pieces: Pieces, filling: Filling,
                got: list) -> int:
        """A STREAM frame: the patch's pieces as they are made, those at hand sent as one counted
        piece once they hold STREAM_BATCH bytes (fewer wake-ups and calls on both sides), then
        its trailer."""
        h, size, have = xxhash.xxh3_64(), 0, 0
        out = [memoryview(wire.header(STREAM, version, offset, 0))]
        while got:
            views = as_views(got)
            n = sum(len(v) for v in views)
            for v in views:
                h.update(v)
            size += n
            if size > limit:
                raise ValueError(f"a patch of more than {limit} bytes: send the range whole")
            send_all(conn.sock, out + [memoryview(PIECE.pack(n))] + views)
            have += len(got)
            out, got = [], pieces.wait(have, STREAM_BATCH)
        checksum = filling.result()
        send_all(conn.sock, [memoryview(PIECE.pack(0) + STREAM_TRAILER.pack(checksum, h.intdigest()))])
        return checksum

    def end_version(self, version: int) -> None:
        for peer in self.conns:
            frames, nbytes = self.tally.pop(version, peer)
            header = wire.header(END, version, frames, nbytes)
            patched = self.patched.pop((version, peer), None)

            def end(c: Connection, h=header, patched=patched) -> None:
                c.sock.sendall(h)
                if patched:
                    self._resend(c, version, patched)

            self.submit(peer, version, end)
        self.wait(version)

    def _resend(self, conn: Connection, version: int, patched: dict[int, tuple[int, Callable[[], Any]]]) -> None:
        """Read the peer's NEED for `version` and send whole the patched ranges it could not
        apply, then END again."""
        frame = wire.parse_header(recv_exact(conn.sock, wire.HEADER.size))
        if frame.kind != NEED or frame.version != version or frame.offset > len(patched):
            raise wire.WireError(f"answered the patches of version {version} with {KIND_NAMES.get(frame.kind, frame.kind)} "
                                 f"for version {frame.version} ({frame.offset} ranges)")
        offsets = wire.parse_need(frame, recv_exact(conn.sock, frame.length))
        if not offsets:
            return
        nbytes = 0
        for offset in offsets:
            if offset not in patched:
                raise wire.WireError(f"asked again for bytes at {offset} of version {version}, which were not sent as a patch")
            length, whole = patched[offset]
            views = as_views(whole())
            send_all(conn.sock, [memoryview(wire.header(DATA, version, offset, length))] + views
                     + [memoryview(TRAILER.pack(checksum_of(views)))])
            nbytes += length
        log.warning("%s could not apply %d patch(es) of version %d; sent those %d bytes whole",
                    conn.peer, len(offsets), version, nbytes)
        conn.sock.sendall(wire.header(END, version, len(offsets), nbytes))

    def wait(self, version: int) -> None:
        """Wait for every queued send of `version` (base.settle)."""
        settle(self.pending.pop(version, []))

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()


def ready(payload: list | Pieces, checksum: int | Filling, length: int) -> tuple[Pieces, Filling]:
    """send_patch()'s patch and checksum as a Pieces and a Filling, also where they are ready."""
    if not isinstance(payload, Pieces):
        pieces = Pieces()
        pieces.put(list(payload))
        pieces.close()
        payload = pieces
    if not isinstance(checksum, Filling):
        filling = Filling(length)
        filling.finish(checksum)
        checksum = filling
    return payload, checksum
