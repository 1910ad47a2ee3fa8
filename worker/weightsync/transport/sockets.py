"""The socket toolkit of the socket transports (tcp, and the control channel of uccl), and of the
rendezvous store above them.

Sending a list of byte views without joining them, receiving exactly n bytes, closing a socket so
that a blocked thread wakes up, dialing a peer that may not listen yet, and the sender's side of
the handshake (wire.py defines its bytes; door.py is the receiver's side). Every call here runs
under the socket's own timeout, or within a deadline where the caller gives one, so the callers
turn a silent peer into an error of their own (a TransferError, a store's timeout).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Callable

from weightsync.transport import wire

IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) - 1  # one entry left for the header
# 0 leaves the socket buffers to the kernel's autotuning: a fixed size turns it off, which was
# slower on loopback and caps the window on long links
SOCKET_BUFFER = 0


def tune(sock: socket.socket, buffer_bytes: int, timeout: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    sock.settimeout(timeout)


def within(sock: socket.socket, deadline: float) -> None:
    """Give the socket's next call the time left until `deadline` (time.monotonic()) as its
    timeout: socket.timeout once it has passed."""
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))


def send_all(sock: socket.socket, views: list[memoryview], deadline: float | None = None) -> None:
    """sendmsg until every byte of `views` is on its way (no copies into a joined buffer); with a
    deadline, all of it before then."""
    views = [v for v in views if len(v)]
    i = 0
    while i < len(views):
        if deadline is not None:
            within(sock, deadline)
        sent = sock.sendmsg(views[i:i + IOV_MAX])
        while sent:
            n = len(views[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


class ByteCursor:
    """Walks a list of byte views front to back, handing out the next bytes as views (no copies)."""

    def __init__(self, views: list[memoryview]):
        self.views = [v for v in views if len(v)]
        self.i = self.pos = 0

    def take(self, n: int) -> list[memoryview]:
        out = []
        while n and self.i < len(self.views):
            v = self.views[self.i]
            k = min(n, len(v) - self.pos)
            out.append(v[self.pos:self.pos + k])
            self.pos += k
            n -= k
            if self.pos == len(v):
                self.i, self.pos = self.i + 1, 0
        return out


class PeerClosed(ConnectionError):
    """The peer closed the connection."""


def recv_into_all(sock: socket.socket, view: memoryview, deadline: float | None = None,
                  progress: Callable[[int], None] | None = None) -> None:
    """Fill `view` from the socket (PeerClosed if the peer closes first); with a deadline, all of
    it before then; progress(bytes there so far) after every read, where given."""
    got = 0
    while got < len(view):
        if deadline is not None:
            within(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PeerClosed(f"connection closed after {got} of {len(view)} bytes")
        got += n
        if progress is not None:
            progress(got)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into_all(sock, memoryview(buf), deadline)
    return bytes(buf)


def hang_up(sock: socket.socket) -> None:
    """Close a socket so that a thread blocked on it (recv, accept) wakes up at once: close()
    alone leaves such a call, and a listening socket, running on Linux."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------- sender (trainer rank)


def dial(host: str, port: int, deadline: float, buffer_bytes: int, timeout: float) -> socket.socket:
    """Connect, retrying while the peer is not listening yet, until `deadline`."""
    delay = 0.02
    while True:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        tune(sock, buffer_bytes, max(0.1, min(timeout, deadline - time.monotonic())))
        try:
            sock.connect((host, port))
            sock.settimeout(timeout)
            return sock
        except (ConnectionRefusedError, socket.timeout, OSError) as e:
            sock.close()
            if time.monotonic() + delay > deadline:
                raise TimeoutError(f"could not connect to {host}:{port}: {e}") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def client_handshake(sock: socket.socket, token: bytes, rank: int, peer_rank: int,
                     before_verdict: Callable[[socket.socket], None] | None = None) -> None:
    """The sender's side of the handshake; raises ConnectionError if the receiver refuses us or
    cannot prove it knows the token. `before_verdict` runs the transport's own set-up steps
    (RDMA) between the answer and the verdict."""
    challenge = recv_exact(sock, wire.CHALLENGE.size)
    their_rank = wire.parse_challenge(challenge)
    if their_rank != peer_rank:
        raise ConnectionError(f"the endpoint belongs to inference rank {their_rank}, not {peer_rank}")
    answer = wire.answer(token, challenge, rank, peer_rank)
    sock.sendall(answer)
    try:
        if before_verdict is not None:
            before_verdict(sock)
        verdict = recv_exact(sock, wire.VERDICT.size)
    except (PeerClosed, ConnectionResetError):
        raise ConnectionError("the peer refused the handshake (wrong job token?)") from None
    wire.check_verdict(token, challenge, answer, verdict)
