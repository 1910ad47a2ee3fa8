"""The data port's door: accepts connections and runs the unauthenticated part of the handshake
for all of them in one thread.

A connection that has not proven the job token yet gets no thread and almost no memory: the door
keeps it in one selector with the challenge it was sent and the bytes of its answer so far (at
most the 44 of an ANSWER; nothing beyond the answer is ever read). At most `cap` connections are
pending at once. One more closes the oldest pending one: a real trainer answers within a round
trip, so the oldest is the one most likely idle, and a flood of idle sockets cannot lock the
trainers out (a trainer that arrives always gets a slot, and needs it for a millisecond). A
connection that has not answered within HANDSHAKE_TIMEOUT is closed. Every connection closed
here is logged with its address, rate-limited (one line per LOG_INTERVAL, with the count of
those not logged), so that a flood cannot fill the log either. A connection that proves the
token leaves the door: `admit` gets it on a thread of its own (the transport's own set-up, the
verdict), so only peers that hold the token ever cost a thread.
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from weightsync.transport import wire

log = logging.getLogger("weightsync.transport")

# A trainer answers the challenge after one round trip and one HMAC, well under a millisecond on
# a cluster network; 5 s leaves room for a CPU-starved pod or a long pause in the trainer's
# process, and still frees the slot of an idle client quickly.
HANDSHAKE_TIMEOUT = 5.0
# Connections pending beyond the plan's trainer ranks (each of which opens one connection to this
# port, and one more when it reconnects): room for a reconnect that races its old attempt, and
# for probes and port scans, which then cost no trainer its slot.
PENDING_HEADROOM = 8
# Before the plan says how many trainer ranks there are. A pending connection costs a socket and
# a few hundred bytes, no thread, so this can be larger than a plan's cap: a large job's
# trainers may all connect at once before this rank has read the plan.
PENDING_BEFORE_PLAN = 64
# At most one log line per this many seconds about refused connections.
LOG_INTERVAL = 5.0
# How long the door stops accepting when the process is out of file descriptors.
FULL_PAUSE = 0.1
# Connections accepted at a time before the door reads answers and checks deadlines again.
ACCEPT_BATCH = 64


def address(addr) -> str:
    return f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"


class RateLimitedLog:
    """Log one line per `interval`; the next line says how many were left out meanwhile."""

    def __init__(self, prefix: str, interval: float = LOG_INTERVAL):
        self.prefix, self.interval = prefix, interval
        self.last = -interval
        self.left_out = 0

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if now - self.last < self.interval:
            self.left_out += 1
            return
        more = f" ({self.left_out} more not logged since the last such line)" if self.left_out else ""
        log.warning("%s %s%s", self.prefix, message, more)
        self.last, self.left_out = now, 0

    def flush_at(self) -> float | None:
        """When the count of lines left out is due (monotonic time), or None."""
        return self.last + self.interval if self.left_out else None

    def flush(self) -> None:
        if self.left_out and time.monotonic() - self.last >= self.interval:
            log.warning("%s refused %d more connections not logged since the last such line", self.prefix, self.left_out)
            self.last, self.left_out = time.monotonic(), 0


@dataclass
class Pending:
    sock: socket.socket
    addr: str
    challenge: bytes
    deadline: float
    fd: int  # its descriptor when it was registered: the key it is pending under, also once it is closed
    answer: bytearray = field(default_factory=bytearray)
    left: bool = False  # it left the door (proven, refused or dropped); a readiness event for it is stale


class Door:
    """Accepts on `listener` and challenges every connection; see the module docstring.

    challenge() makes a CHALLENGE; prove(challenge, answer) returns the trainer rank an ANSWER
    proves or raises ConnectionError saying why not; admit(sock, addr, trainer, challenge, answer)
    takes a proven connection (blocking, on its own thread); refused(reason) hears of every
    connection closed here."""

    def __init__(self, listener: socket.socket, name: str, challenge: Callable[[], bytes],
                 prove: Callable[[bytes, bytes], int], admit: Callable[..., None], refused: Callable[[str], None]):
        self.listener, self.name = listener, name
        self.challenge, self.prove, self.admit, self.refused = challenge, prove, admit, refused
        self.cap = PENDING_BEFORE_PLAN
        self.pending: collections.OrderedDict[int, Pending] = collections.OrderedDict()  # oldest first
        self.say = RateLimitedLog(name)
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        self.closed = False
        self.paused_until: float | None = None
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._run, name=f"door-{name.replace(' ', '-')}", daemon=True)
        self.thread.start()

    def set_cap(self, trainers: int) -> None:
        """The plan has `trainers` trainer ranks: at most that many plus PENDING_HEADROOM pending."""
        self.cap = trainers + PENDING_HEADROOM

    def close(self) -> None:
        self.closed = True
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(10)
        self.listener.close()  # no thread blocks on it but the door's, which has ended

    # ------------------------------------------------------------ the door's thread

    def _run(self) -> None:
        try:
            while not self.closed:
                for key, _ in self.selector.select(self._wait()):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj is self.wake_r:
                        pass
                    elif not key.data.left:  # not closed by an earlier event of the same batch
                        self._read(key.data)
                self._expire()
                self.say.flush()
        except Exception:  # noqa: BLE001 - the port would stop accepting: say so loudly
            log.exception("%s: the data port stopped accepting connections", self.name)
            raise
        finally:
            for p in list(self.pending.values()):
                self._drop(p)
            self.listener.close()
            self.selector.close()
            self.wake_r.close()
            self.wake_w.close()

    def _wait(self) -> float | None:
        """Seconds until the next deadline of the door (oldest pending, log flush, pause end)."""
        times = [t for t in (self.say.flush_at(), self.paused_until) if t is not None]
        if self.pending:
            times.append(next(iter(self.pending.values())).deadline)
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):  # then answers and deadlines, even under a steady flood
            if self.closed:
                return
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: make room, or stop accepting for a moment rather than spin
                    if self.pending:
                        self._refuse(next(iter(self.pending.values())), f"closed to make room: {e.strerror}")
                    else:
                        self.selector.unregister(self.listener)
                        self.paused_until = time.monotonic() + FULL_PAUSE
                    return
                if self.closed:
                    return
                raise
            self._greet(sock, address(addr))

    def _greet(self, sock: socket.socket, addr: str) -> None:
        while len(self.pending) >= self.cap:
            self._refuse(next(iter(self.pending.values())),
                         f"{len(self.pending)} unauthenticated connections were pending (the cap); this was the oldest")
        sock.setblocking(False)
        challenge = self.challenge()
        try:
            sent = sock.send(challenge)
        except OSError as e:
            sent, why = 0, str(e)
        else:
            why = "the socket did not take the challenge"
        if sent != len(challenge):
            self._refused_now(sock, addr, f"could not send the challenge: {why}")
            return
        p = Pending(sock, addr, challenge, time.monotonic() + HANDSHAKE_TIMEOUT, sock.fileno())
        self.pending[p.fd] = p
        self.selector.register(sock, selectors.EVENT_READ, p)

    def _read(self, p: Pending) -> None:
        try:
            got = p.sock.recv(wire.ANSWER.size - len(p.answer))  # never a byte beyond the answer
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._refuse(p, f"connection lost during the handshake: {e}")
            return
        if not got:
            self._refuse(p, f"closed after {len(p.answer)} of the {wire.ANSWER.size} bytes of a handshake answer")
            return
        p.answer += got
        if len(p.answer) < wire.ANSWER.size:
            return
        self._leave(p)
        answer = bytes(p.answer)
        try:
            trainer = self.prove(p.challenge, answer)
        except (ConnectionError, ValueError) as e:
            self._refused_now(p.sock, p.addr, str(e))
            return
        threading.Thread(target=self.admit, args=(p.sock, p.addr, trainer, p.challenge, answer),
                         name=f"admit-{self.name.replace(' ', '-')}-trainer-{trainer}", daemon=True).start()

    def _expire(self) -> None:
        now = time.monotonic()
        while self.pending:
            p = next(iter(self.pending.values()))
            if p.deadline > now:
                break
            self._refuse(p, f"no handshake answer within {HANDSHAKE_TIMEOUT:g}s")
        if self.paused_until is not None and now >= self.paused_until:
            self.paused_until = None
            self.selector.register(self.listener, selectors.EVENT_READ)

    def _leave(self, p: Pending) -> None:
        """Out of the pending set and the selector, once: by its registered descriptor, which stays
        its key after the socket is closed (a closed socket's fileno() is -1)."""
        if p.left:
            return
        p.left = True
        self.pending.pop(p.fd, None)
        self.selector.unregister(p.fd)

    def _drop(self, p: Pending) -> None:
        self._leave(p)
        p.sock.close()

    def _refuse(self, p: Pending, reason: str) -> None:
        self._leave(p)
        self._refused_now(p.sock, p.addr, reason)

    def _refused_now(self, sock: socket.socket, addr: str, reason: str) -> None:
        self._note(addr, reason)  # before the peer can see the close
        sock.close()

    def _note(self, addr: str, reason: str) -> None:
        message = f"refused connection from {addr}: {reason}"
        self.say(message)
        self.refused(message)

