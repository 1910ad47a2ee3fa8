"""The store's server: the table, served on one address (the pod's own) to clients that prove
the job's token (wire.py defines the bytes), within the bounds of its Limits. The controller runs
it; a connection that does not prove the token within HANDSHAKE_SECONDS is closed, and refused
connections are logged at most once per LOG_EVERY. Connections that have not proven the token
have a budget of their own (Limits.pending): one more closes the oldest of them, which a client
that holds the token is not, since it answers within a round trip; so clients without the token,
however many and however often they come back, never take a slot from the job's ranks
(Limits.connections counts the authenticated ones).
"""

from __future__ import annotations

import atexit
import collections
import logging
import secrets
import socket
import struct
import threading
import time

from weightsync.job.token import same
from weightsync.rendezvous.store.table import Limits, StoreError, StoreFull, StoreTimeout, Table
from weightsync.rendezvous.store.wire import (
    ERROR,
    FULL,
    HELLO,
    LENGTH,
    MAGIC,
    OK,
    OPS,
    PROOF,
    TIMEOUT,
    VERDICT,
    frame_length,
    handshake_macs,
    open_frame,
    pack,
    seal,
    unpack_tagged,
)
from weightsync.transport.sockets import PeerClosed, hang_up, recv_exact, send_all

log = logging.getLogger("weightsync.rendezvous.store")

HANDSHAKE_SECONDS = 5.0  # a connection must prove the token within this
IO_SECONDS = 60.0  # the server's limit for receiving the rest of a frame, and for sending one
DRAIN_SECONDS = 2.0  # a closing server's wait for the answers it is sending
LOG_EVERY = 1.0  # seconds between two log lines about refused connections
RECV_BYTES = 8 << 10  # a connection's buffer for requests (larger for a larger frame, while it comes)


class StoreServer(Table):
    """The table, served on one address to clients that prove the job's token. The process that
    runs it uses the Table methods directly."""

    def __init__(self, address: str, port: int, token: bytes, job: str, limits: Limits = Limits(),
                 timeout: float = 60.0):
        super().__init__(limits, timeout)
        if address in ("", "0.0.0.0", "::"):
            raise ValueError(f"the store binds one address (the pod's own), not every interface ({address!r})")
        family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind(sockaddr)
        except OSError as e:
            self._listener.close()
            raise OSError(e.errno, f"the rendezvous store cannot listen on {address}:{port}: {e.strerror}") from None
        self._listener.listen(256)
        self.address, self.port = address, self._listener.getsockname()[1]
        self._token, self._job = token, job
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._open: set[socket.socket] = set()
        # Unauthenticated connections, oldest first, and a count of authenticated ones: two budgets,
        # so that connections that never prove the token cannot take what the job's ranks need.
        self._handshaking: collections.OrderedDict[socket.socket, str] = collections.OrderedDict()
        self._authenticated = self._answering = 0
        self.requests = 0  # the clients' requests answered or being answered: what the store's load is made of
        self._closed = False
        self._refused, self._last_log = 0, 0.0
        threading.Thread(target=self._accept, name="store-accept", daemon=True).start()
        atexit.register(self.close)

    def close(self) -> None:
        """Stop serving: requests being answered get their answer first (for up to DRAIN_SECONDS),
        and waits end at once. The process that exits closes its server: a client whose last
        request was applied must not lose the answer to the race with the exit."""
        if self._closed:
            return
        self._closed = True
        hang_up(self._listener)
        self.end_waits()
        with self._idle:
            self._idle.wait_for(lambda: self._answering == 0, DRAIN_SECONDS)
            for sock in list(self._open):
                hang_up(sock)

    def _note_refused(self, message: str) -> None:
        """Log a refused connection: at most one line per LOG_EVERY, counting the rest."""
        with self._lock:
            self._refused += 1
            now = time.monotonic()
            if now - self._last_log < LOG_EVERY:
                return
            count, self._refused, self._last_log = self._refused, 0, now
        more = f" ({count - 1} more refused since the last report)" if count > 1 else ""
        log.warning("rendezvous store: %s%s", message, more)

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                log.warning("rendezvous store: accept failed: %s", e)
                time.sleep(0.1)  # out of file descriptors: let connections close
                continue
            evicted = None
            with self._lock:
                busy = self._authenticated >= self.limits.connections
                if not busy:
                    if len(self._handshaking) >= self.limits.pending:
                        evicted = self._handshaking.popitem(last=False)
                    self._handshaking[sock] = f"{peer[0]}:{peer[1]}"
                    self._open.add(sock)
            if evicted is not None:  # its thread wakes to a shut socket, closes it and ends
                try:
                    evicted[0].shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._note_refused(f"closed {evicted[1]}, the oldest of {self.limits.pending} connections that had "
                                   f"not proven the job token, to let {peer[0]}:{peer[1]} try")
            if busy:
                try:
                    sock.settimeout(1.0)
                    sock.sendall(HELLO.pack(MAGIC, 0, bytes(32)))
                except OSError:
                    pass
                hang_up(sock)
                self._note_refused(f"turned away {peer[0]}:{peer[1]}: at the limit of {self.limits.connections} "
                                   "authenticated connections")
                continue
            threading.Thread(target=self._serve, args=(sock, peer), name="store-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer) -> None:
        who = f"{peer[0]}:{peer[1]}"
        counted = False
        try:
            try:
                key = self._handshake(sock, who)
            finally:
                with self._lock:
                    self._handshaking.pop(sock, None)
            counted = key is not None  # _handshake counted it among the authenticated connections
            if counted:
                self._requests(sock, who, key)
        except OSError:
            pass  # the client went away
        finally:
            with self._lock:
                self._open.discard(sock)
                self._authenticated -= counted
            hang_up(sock)

    def _handshake(self, sock: socket.socket, who: str) -> bytes | None:
        deadline = time.monotonic() + HANDSHAKE_SECONDS
        server_nonce = secrets.token_bytes(32)
        try:
            send_all(sock, [HELLO.pack(MAGIC, 1, server_nonce)], deadline)
            magic, client_nonce, proof = PROOF.unpack(recv_exact(sock, PROOF.size, deadline))
        except socket.timeout:
            self._note_refused(f"closed {who}: it sent no proof of the job token within {HANDSHAKE_SECONDS:.0f}s")
            return None
        except OSError:  # a TCP probe or a port scan: not worth a line in the log
            log.debug("rendezvous store: %s hung up without proving the job token", who)
            return None
        want, answer, key = handshake_macs(self._token, self._job, server_nonce, client_nonce)
        if magic != MAGIC or not same(proof, want):
            self._note_refused(f"refused {who}: its proof does not match this job's token")
            try:
                send_all(sock, [VERDICT.pack(0, bytes(32))], deadline)
            except OSError:
                pass
            return None
        with self._lock:  # counted before the verdict: a client that was let in holds its slot
            full = self._authenticated >= self.limits.connections
            self._authenticated += not full
        if full:  # others proved the token since this one was accepted: closed, and the client tries again
            self._note_refused(f"closed {who}: at the limit of {self.limits.connections} authenticated connections")
            return None
        try:
            send_all(sock, [VERDICT.pack(1, answer)], deadline)
        except OSError:
            with self._lock:
                self._authenticated -= 1
            raise
        return key

    def _requests(self, sock: socket.socket, who: str, key: bytes) -> None:
        """Answer the connection's requests, one frame at a time, until it closes. The socket blocks,
        with the kernel's own timeouts (SO_RCVTIMEO, SO_SNDTIMEO: IO_SECONDS for the rest of a frame
        once its first bytes came, and for an answer): a request then gives up the GIL about twice
        (one receive, one send), not at every poll, receive and send, which with a thread per
        connection and a thousand ranks was much of what the controller's process spent per request."""
        if hasattr(socket, "TCP_KEEPIDLE"):  # find clients that vanished without closing
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        sock.settimeout(None)
        frames = _Frames(sock, key, self.limits.frame_bytes)
        _kernel_timeout(sock, socket.SO_SNDTIMEO, IO_SECONDS)
        seq = 0
        while True:
            seq += 1
            try:
                payload = frames.next(seq)  # an authenticated client may stay idle as long as it likes
            except ValueError as e:
                log.warning("rendezvous store: closed %s after %s", who, e)
                return
            if payload is None:
                return
            with self._lock:
                self._answering += 1
                self.requests += 1
            try:
                status, results = self._dispatch(payload)
                sock.sendall(seal(key, b"S", seq, bytes([status]) + pack(results)))
            finally:
                with self._idle:
                    self._answering -= 1
                    if self._closed:  # only a closing server waits for the answers under way
                        self._idle.notify_all()

    def _dispatch(self, payload: bytes) -> tuple[int, list]:
        try:
            name, wanted = OPS.get(payload[0], (None, ""))
            if name is None:
                raise StoreError(f"unknown operation {payload[0]}")
            args, given = unpack_tagged(payload[1:])
            if given != wanted:
                raise StoreError(f"{name}: malformed arguments")
            result = getattr(self, name)(*args)
            return OK, [] if result is None else [result]
        except StoreTimeout as e:
            return TIMEOUT, [str(e)]
        except StoreFull as e:
            return FULL, [str(e)]
        except (StoreError, ValueError, IndexError) as e:
            return ERROR, [str(e)]


def _kernel_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    """The kernel's timeout `option` (SO_RCVTIMEO, SO_SNDTIMEO) of a blocking socket: 0, none."""
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))


class _Frames:
    """A connection's requests as they come: one receive usually brings a whole frame (a client
    sends one request and waits for its answer); what comes beyond a frame is kept for the next."""

    def __init__(self, sock: socket.socket, key: bytes, max_bytes: int):
        self.sock, self.key, self.max_bytes = sock, key, max_bytes
        self.buf = bytearray(RECV_BYTES)
        self.have = 0  # bytes of buf received and not yet handed out
        self.limit: float | None = None  # the receive timeout the socket has (0: none)

    def _more(self) -> bool:
        """Receive what is there (blocking); False once the client closed."""
        if self.have == len(self.buf):
            self.buf += bytearray(len(self.buf))
        n = self.sock.recv_into(memoryview(self.buf)[self.have:])
        self.have += n
        return n > 0

    def next(self, seq: int) -> bytes | None:
        """The payload of request `seq`, None where the client closed between two requests;
        ValueError for a frame too long, out of sequence or forged, OSError for a connection
        that failed or a frame that did not come whole within IO_SECONDS."""
        if not self.have:
            self._limit(0.0)  # idle between two requests: no limit
            if not self._more():
                return None
        deadline = time.monotonic() + IO_SECONDS
        while self.have < LENGTH.size:
            self._receive(deadline)
        need = LENGTH.size + frame_length(bytes(self.buf[:LENGTH.size]), self.max_bytes)
        if need > len(self.buf):
            self.buf += bytearray(need - len(self.buf))
        while self.have < need:
            self._receive(deadline)
        body = bytes(self.buf[LENGTH.size:need])
        rest = self.buf[need:self.have]
        if len(self.buf) > RECV_BYTES and len(rest) <= RECV_BYTES:  # a large frame's buffer is not kept
            self.buf = bytearray(RECV_BYTES)
        self.buf[:len(rest)] = rest
        self.have = len(rest)
        return open_frame(body, self.key, b"C", seq)

    def _receive(self, deadline: float) -> None:
        """More of a frame whose first bytes came, within what is left until `deadline`."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"a frame did not come whole within {IO_SECONDS:.0f}s")
        self._limit(left)
        if not self._more():
            raise PeerClosed(f"the connection closed within a frame ({self.have} bytes of it)")

    def _limit(self, seconds: float) -> None:
        if seconds != self.limit:
            _kernel_timeout(self.sock, socket.SO_RCVTIMEO, seconds)
            self.limit = seconds
