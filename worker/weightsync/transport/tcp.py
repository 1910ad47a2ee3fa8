"""TCP transport: sockets between every trainer rank and every inference rank.

Bytes leave straight from the sender's buffers (sendmsg of memoryviews, no joining) and land
straight in place in the receiver's staging buffer (recv_into). Both sides move a range in
cache-sized chunks and hash each chunk while it is still in cache; the sender streams a buffer
that is still being filled (a Filling) right behind its producer. One connection per (trainer,
inference) pair, opened once and kept across versions; a rank runs its connections in parallel
threads (socket calls and xxh3 release the GIL). Every socket call has a timeout, so a dead or
silent peer becomes a TransferError naming its rank, never a hang.

The receiver's port is open to anyone who can reach it. Its door (door.py) accepts and
challenges every connection in one thread, caps those that have not proven the job token and
times them out; only a connection that proves the token gets a thread. After that, a trainer
may send exactly the ranges the plan gives it, once each, and an END that counts them: any
other frame cuts its connection off and fails the version, naming the trainer rank.

A range may also go as a PATCH against bytes the receiver holds (delta versions): the receiver
applies it with the caller's Patcher, and after the version's END it tells the sender which
patches it could not apply (NEED); the sender sends those ranges whole from the bytes the caller
kept, so a refused patch costs one round trip and never a wrong byte.

The wire format (handshake and frames) is defined in wire.py, the socket calls in sockets.py, the
checks of what a trainer may send for a version in ledger.py, checksums in checksum.py.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import xxhash

from weightsync.transport import wire
from weightsync.transport.base import (
    Capabilities,
    Filling,
    Patcher,
    RankContext,
    Receiver,
    Sender,
    Tally,
    TransferError,
    Transport,
    each_peer,
    settle,
)
from weightsync.transport.checksum import CHUNK, as_views, checksum_of
from weightsync.transport.door import Door
from weightsync.transport.landing import Landing
from weightsync.transport.ledger import Ledger
from weightsync.transport.sockets import (
    ByteCursor,
    client_handshake,
    dial,
    hang_up,
    parse_endpoint,
    recv_exact,
    recv_into_all,
    send_all,
    tune,
)
from weightsync.transport.wire import DATA, END, KIND_NAMES, NEED, PATCH, TRAILER

log = logging.getLogger("weightsync.transport")

# 0 leaves the socket buffers to the kernel's autotuning: a fixed size turns it off, which was
# slower on loopback and caps the window on long links
SOCKET_BUFFER = 0
# connections the kernel queues before the door accepts them (they cost no thread)
BACKLOG = 64
# refusal reasons kept, to say why a trainer never connected
REFUSED_KEPT = 8


@dataclass(frozen=True)
class TcpOptions:
    socket_buffer: int = SOCKET_BUFFER  # bytes of each socket's kernel buffers (0: the kernel's autotuning)


class TcpTransport(Transport):
    name = "tcp"
    # bytes leave from lists of memoryviews of host memory, ranges may go as patches, and a
    # receiver lands a DATA frame in several runs
    capabilities = Capabilities(patches=True, scatters=True, in_place=True, buffer_device="cpu")
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

    def send_patch(self, peer: int, version: int, offset: int, length: int, payload: list, checksum: int,
                   whole: Callable[[], Any], trailer: int | None = None) -> Future:
        views = as_views(payload)
        size = sum(len(v) for v in views)
        if size > wire.patch_limit(length):
            raise ValueError(f"a {size}-byte patch of a {length}-byte range: send the range whole")
        self.tally.add(version, peer, length)
        self.patched.setdefault((version, peer), {})[offset] = (length, whole)
        header = wire.header(PATCH, version, offset, size, checksum)

        def work(conn: Connection) -> int:
            try:
                own = checksum_of(views) if trailer is None else trailer
                send_all(conn.sock, [memoryview(header)] + views + [memoryview(TRAILER.pack(own))])
            except BaseException:
                hang_up(conn.sock)
                raise
            return checksum

        return self.submit(peer, version, work)

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


# ---------------------------------------------------------------- receiver (inference rank)


class TcpReceiver(Receiver):
    name = "tcp"
    capabilities = TcpTransport.capabilities
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
            if kind == PATCH:
                if not self.capabilities.patches:
                    raise TransferError(book.peer, f"sent a PATCH for bytes at {offset} of version {version}: a sender "
                                                   f"never sends PATCH over the {self.name} transport")
                size = book.take_patch(offset, length, wire.patch_limit)
                if self.patch(sock, offset, size, length, digest, patcher, bounce):
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
        if patcher is None:
            return False
        if xxhash.xxh3_64_intdigest(payload) != trailer:
            patcher.refuse(offset, size, "the patch was damaged in transit (its checksum differs)")
            return False
        return patcher.end(applying, offset, size, payload, checksum)

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
