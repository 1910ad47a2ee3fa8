"""The rendezvous store: a small key-value store that only the job's own processes can use.

The controller runs the server; every rank talks to it through a client that is also a
torch.distributed Store, so the trainers' gloo group and the NCCL transport meet through it too.
It replaces torch's TCPStore, which serves anyone who reaches its port (no authentication: a
stranger could read the plan and the endpoints, forge the keys that end a job, or fill the
controller's memory) and whose client's check() ignores the client's timeout (against a controller
stopped with SIGSTOP it blocked far past it). Here:

- A client proves it holds the job's token, bound to the job's identity (namespace/name) and to
  nonces from both sides, before the server reads anything else from it; the server proves the
  same back. Every request and response then carries a strictly increasing sequence number and an
  HMAC under a key derived for this connection alone, so nothing can be altered, replayed,
  reordered, or carried over from another connection or another job. Messages are authenticated,
  not encrypted: the token never crosses the wire, and nothing the store holds is a secret.
- The server binds one address (the pod's own), never every interface, and bounds what a client
  can make it hold: bytes per value, bytes and keys in all, connections, and unauthenticated
  connections, which must prove the token within HANDSHAKE_SECONDS. Going over a bound is an
  error that says which bound.
- Every client call has a deadline: a blocking call (get, wait) is answered by the server before
  the client's timeout, and every send and receive of the client has a socket timeout, so a
  frozen or dead controller is an error within the timeout, never a hang.

Wire format (big-endian; this is the one place it is defined)
-------------------------------------------------------------
  server -> client  HELLO    b"WSKV" | u8 1 | server nonce (32 bytes)                         37 bytes
                             (u8 0 and a zero nonce: at the connection limit; the server closes)
  client -> server  PROOF    b"WSKV" | client nonce (32) | HMAC(token, "client", job, both nonces)  68
  server -> client  VERDICT  u8 1 | HMAC(token, "server", job, both nonces)                     33
                             (u8 0 and 32 zero bytes: refused; the server closes)
  Then frames, both ways:    u32 n | u64 sequence | payload | HMAC(session key, direction | sequence | payload)
  n counts what follows it. The session key is HMAC(token, "session", job, both nonces); direction
  is b"C" (requests) or b"S" (responses); the client numbers its requests 1, 2, 3, ... and the
  server answers request k with sequence k. A request's payload is u8 op | arguments, a response's
  u8 status | results, each value tagged: b"b" u32 length | bytes, b"i" i64, b"f" f64, b"?" u8,
  b"l" u32 count | (u32 length | bytes) per item. A frame out of sequence or with a wrong HMAC
  closes the connection.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from weightsync.job.token import mac, same

log = logging.getLogger("weightsync.rendezvous.store")

MAGIC = b"WSKV"
HELLO = struct.Struct(">4sB32s")
PROOF = struct.Struct(">4s32s32s")
VERDICT = struct.Struct(">B32s")
LENGTH = struct.Struct(">I")
SEQ = struct.Struct(">Q")
MAC_BYTES = 32
HANDSHAKE_SECONDS = 5.0  # a connection must prove the token within this
IO_SECONDS = 60.0  # the server's limit for receiving the rest of a frame, and for sending one
DRAIN_SECONDS = 2.0  # a closing server's wait for the answers it is sending
MAX_WAIT = 86400.0  # the longest a client may ask the server to wait for keys
KEY_OVERHEAD = 64  # bytes counted per key on top of its name and value (the table's own cost)
LOG_EVERY = 1.0  # seconds between two log lines about refused connections

# op code: (name, argument tags)
OPS = {1: ("set", "bb"), 2: ("get", "bf"), 3: ("add", "bi"), 4: ("check", "l"), 5: ("wait", "lf"),
       6: ("compare_set", "bbb"), 7: ("delete_key", "b"), 8: ("num_keys", ""), 9: ("append", "bb"),
       10: ("multi_get", "lf"), 11: ("multi_set", "ll")}
CODES = {name: code for code, (name, _) in OPS.items()}
BLOCKING = {"get", "wait", "multi_get"}  # their last argument is how long the server may wait
OK, ERROR, TIMEOUT, FULL = 0, 1, 2, 3


class StoreError(RuntimeError):
    """The store refused a request, or the connection to it failed (the message says which)."""


class StoreTimeout(StoreError, TimeoutError):
    """A deadline passed: keys not set in time, or a server that did not answer in time."""


class StoreFull(StoreError):
    """A request would take the store over one of its bounds (Limits)."""


class StoreRefused(StoreError):
    """The handshake failed: the client or the server does not hold the job's token."""


@dataclass(frozen=True)
class Limits:
    """What clients may make the server hold."""

    value_bytes: int = 64 << 20  # one value, and all values of one request
    total_bytes: int = 256 << 20  # keys and values together, KEY_OVERHEAD per key included
    keys: int = 100_000
    key_bytes: int = 4096
    connections: int = 512  # open connections, authenticated or not
    pending: int = 64  # connections that have not proven the token yet

    @property
    def frame_bytes(self) -> int:
        return self.value_bytes + (1 << 20)


def _b(x: str | bytes) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


def _shown(key: bytes) -> str:
    return key.decode(errors="replace")


def _seconds(timeout) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def handshake_macs(token: bytes, job: str, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes, bytes]:
    """(client proof, server proof, session key) for one connection."""
    return tuple(mac(token, b"weightsync store " + what, job, server_nonce, client_nonce, lengths=LENGTH.format)
                 for what in (b"client", b"server", b"session"))


# ---------------------------------------------------------------- values on the wire


def pack(values) -> bytes:
    out = []
    for v in values:
        if isinstance(v, bool):
            out.append(b"?" + bytes([v]))
        elif isinstance(v, int):
            out.append(b"i" + struct.pack(">q", v))
        elif isinstance(v, float):
            out.append(b"f" + struct.pack(">d", v))
        elif isinstance(v, (bytes, str)):
            v = _b(v)
            out.append(b"b" + LENGTH.pack(len(v)) + v)
        else:  # a list of bytes
            items = [_b(x) for x in v]
            out.append(b"l" + LENGTH.pack(len(items)) + b"".join(LENGTH.pack(len(x)) + x for x in items))
    return b"".join(out)


def unpack(data: bytes) -> list:
    view, at, out = memoryview(data), 0, []

    def take(n: int) -> bytes:
        nonlocal at
        if at + n > len(view):
            raise ValueError("a value runs past the end of the message")
        at += n
        return bytes(view[at - n:at])

    while at < len(view):
        tag = take(1)
        if tag == b"?":
            out.append(take(1) != b"\0")
        elif tag == b"i":
            out.append(struct.unpack(">q", take(8))[0])
        elif tag == b"f":
            out.append(struct.unpack(">d", take(8))[0])
        elif tag == b"b":
            out.append(take(LENGTH.unpack(take(4))[0]))
        elif tag == b"l":
            count = LENGTH.unpack(take(4))[0]
            if count > len(view) - at:
                raise ValueError("a list longer than the message")
            out.append([take(LENGTH.unpack(take(4))[0]) for _ in range(count)])
        else:
            raise ValueError(f"unknown value tag {tag!r}")
    return out


def seal(key: bytes, direction: bytes, seq: int, payload: bytes) -> bytes:
    head = SEQ.pack(seq)
    tag = mac(key, direction, head, payload)
    return LENGTH.pack(len(head) + len(payload) + MAC_BYTES) + head + payload + tag


def frame_length(head: bytes, max_bytes: int) -> int:
    n = LENGTH.unpack(head)[0]
    if n > max_bytes or n < SEQ.size + MAC_BYTES:
        raise ValueError(f"a frame of {n} bytes (the limit is {max_bytes})")
    return n


def read_frame(sock: socket.socket, key: bytes, direction: bytes, expect_seq: int, max_bytes: int,
               deadline: float | None = None) -> bytes:
    """The payload of the next frame; ValueError if it is too long, out of sequence or forged."""
    n = frame_length(recv_exact(sock, LENGTH.size, deadline), max_bytes)
    return open_frame(recv_exact(sock, n, deadline), key, direction, expect_seq)


def open_frame(body: bytes, key: bytes, direction: bytes, expect_seq: int) -> bytes:
    """The payload of a frame's body (what follows its length), checked."""
    head, payload, tag = body[:SEQ.size], body[SEQ.size:-MAC_BYTES], body[-MAC_BYTES:]
    if not same(tag, mac(key, direction, head, payload)):
        raise ValueError("a frame with a wrong HMAC (altered, or from another connection)")
    if SEQ.unpack(head)[0] != expect_seq:
        raise ValueError(f"a frame numbered {SEQ.unpack(head)[0]} where {expect_seq} was due (replayed or reordered)")
    return payload


class Closed(ConnectionError):
    pass


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """n bytes; with a deadline every receive has a timeout (socket.timeout past it)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise Closed(f"the connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send_all(sock: socket.socket, data: bytes, deadline: float | None = None) -> None:
    if deadline is not None:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.sendall(data)


def hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# ---------------------------------------------------------------- the table


class Table:
    """The keys and values, with the store's semantics (those of torch's TCPStore) and bounds.
    The server's clients and its own process use the same methods."""

    def __init__(self, limits: Limits, timeout: float):
        self.limits, self.timeout = limits, timeout
        self._data: dict[bytes, bytes] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self._closing = False

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def _room(self, items: list[tuple[bytes, bytes]]) -> None:
        """Raise StoreFull unless every (key, value) fits; the caller holds the lock."""
        lim = self.limits
        total, keys, new = self._bytes, len(self._data), set()
        for key, value in items:
            if len(key) > lim.key_bytes:
                raise StoreFull(f"a key of {len(key)} bytes is over the store's limit of {lim.key_bytes}")
            if len(value) > lim.value_bytes:
                raise StoreFull(f"a value of {len(value)} bytes for {_shown(key)!r} is over the store's limit of "
                                f"{lim.value_bytes} bytes per value")
            old = self._data.get(key)
            if old is None and key not in new:
                new.add(key)
                keys += 1
                total += len(key) + len(value) + KEY_OVERHEAD
            else:
                total += len(value) - len(old or b"")
            if keys > lim.keys:
                raise StoreFull(f"the store holds its limit of {lim.keys} keys; {_shown(key)!r} was not added")
            if total > lim.total_bytes:
                raise StoreFull(f"{_shown(key)!r} would take the store to {total} bytes, over its limit of "
                                f"{lim.total_bytes} bytes")

    def _put(self, items: list[tuple[bytes, bytes]]) -> None:
        self._room(items)
        for key, value in items:
            old = self._data.get(key)
            self._bytes += len(value) + (len(key) + KEY_OVERHEAD if old is None else -len(old))
            self._data[key] = value
        self._cond.notify_all()

    def _await(self, keys: list[bytes], timeout, what: str) -> None:
        """Wait, holding the lock, until every key is set; StoreTimeout past `timeout` seconds."""
        seconds = min(max(_seconds(self.timeout if timeout is None else timeout), 0.0), MAX_WAIT)
        if not self._cond.wait_for(lambda: self._closing or all(k in self._data for k in keys), seconds):
            missing = ", ".join(_shown(k) for k in keys if k not in self._data)
            raise StoreTimeout(f"{what}: {missing} not set within {seconds:.1f}s")
        if not all(k in self._data for k in keys):
            raise StoreError(f"{what}: the store is closing (its process is ending)")

    def set(self, key, value) -> None:
        with self._cond:
            self._put([(_b(key), _b(value))])

    def get(self, key, timeout=None) -> bytes:
        key = _b(key)
        with self._cond:
            self._await([key], timeout, "get")
            return self._data[key]

    def add(self, key, amount: int) -> int:
        key = _b(key)
        with self._cond:
            old = self._data.get(key, b"0")
            try:
                value = int(old) + int(amount)
            except ValueError:
                raise StoreError(f"add: {_shown(key)!r} holds {old[:32]!r}, not a number") from None
            self._put([(key, str(value).encode())])
            return value

    def check(self, keys) -> bool:
        with self._cond:
            return all(_b(k) in self._data for k in keys)

    def wait(self, keys, timeout=None) -> None:
        with self._cond:
            self._await([_b(k) for k in keys], timeout, "wait")

    def compare_set(self, key, expected, desired) -> bytes:
        """As TCPStore: set `desired` if the key holds `expected` (or is unset and `expected` is
        empty); return what the key holds afterwards (`expected` if it stays unset)."""
        key, expected, desired = _b(key), _b(expected), _b(desired)
        with self._cond:
            current = self._data.get(key)
            if (current is None and not expected) or (current is not None and current == expected):
                self._put([(key, desired)])
                return desired
            return expected if current is None else current

    def delete_key(self, key) -> bool:
        key = _b(key)
        with self._cond:
            value = self._data.pop(key, None)
            if value is None:
                return False
            self._bytes -= len(key) + len(value) + KEY_OVERHEAD
            return True

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    def append(self, key, value) -> None:
        key = _b(key)
        with self._cond:
            self._put([(key, self._data.get(key, b"") + _b(value))])

    def multi_get(self, keys, timeout=None) -> list[bytes]:
        keys = [_b(k) for k in keys]
        with self._cond:
            self._await(keys, timeout, "multi_get")
            return [self._data[k] for k in keys]

    def multi_set(self, keys, values) -> None:
        if len(keys) != len(values):
            raise StoreError(f"multi_set: {len(keys)} keys but {len(values)} values")
        with self._cond:
            self._put([(_b(k), _b(v)) for k, v in zip(keys, values)])


# ---------------------------------------------------------------- the server


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
        self._pending = self._answering = 0
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
        with self._cond:
            self._closing = True
            self._cond.notify_all()
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
            with self._lock:
                busy = len(self._open) >= self.limits.connections or self._pending >= self.limits.pending
                if not busy:
                    self._open.add(sock)
                    self._pending += 1
            if busy:
                try:
                    sock.settimeout(1.0)
                    sock.sendall(HELLO.pack(MAGIC, 0, bytes(32)))
                except OSError:
                    pass
                hang_up(sock)
                self._note_refused(f"turned away {peer[0]}:{peer[1]}: at the limit of {self.limits.connections} "
                                   f"connections or {self.limits.pending} unauthenticated ones")
                continue
            threading.Thread(target=self._serve, args=(sock, peer), name="store-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer) -> None:
        who = f"{peer[0]}:{peer[1]}"
        try:
            try:
                key = self._handshake(sock, who)
            finally:
                with self._lock:
                    self._pending -= 1
            if key is not None:
                self._requests(sock, who, key)
        except OSError:
            pass  # the client went away
        finally:
            with self._lock:
                self._open.discard(sock)
            hang_up(sock)

    def _handshake(self, sock: socket.socket, who: str) -> bytes | None:
        deadline = time.monotonic() + HANDSHAKE_SECONDS
        server_nonce = secrets.token_bytes(32)
        try:
            send_all(sock, HELLO.pack(MAGIC, 1, server_nonce), deadline)
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
                send_all(sock, VERDICT.pack(0, bytes(32)), deadline)
            except OSError:
                pass
            return None
        send_all(sock, VERDICT.pack(1, answer), deadline)
        return key

    def _requests(self, sock: socket.socket, who: str, key: bytes) -> None:
        if hasattr(socket, "TCP_KEEPIDLE"):  # find clients that vanished without closing
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        seq = 0
        while True:
            seq += 1
            sock.settimeout(None)  # an authenticated client may stay idle as long as it likes
            try:
                head = sock.recv(1, socket.MSG_PEEK)
                if not head:
                    return
                payload = read_frame(sock, key, b"C", seq, self.limits.frame_bytes, time.monotonic() + IO_SECONDS)
            except ValueError as e:
                log.warning("rendezvous store: closed %s after %s", who, e)
                return
            with self._lock:
                self._answering += 1
            try:
                status, results = self._dispatch(payload)
                send_all(sock, seal(key, b"S", seq, bytes([status]) + pack(results)), time.monotonic() + IO_SECONDS)
            finally:
                with self._idle:
                    self._answering -= 1
                    self._idle.notify_all()

    def _dispatch(self, payload: bytes) -> tuple[int, list]:
        try:
            name, tags = OPS.get(payload[0], (None, ""))
            if name is None:
                raise StoreError(f"unknown operation {payload[0]}")
            args = unpack(payload[1:])
            if "".join(_tag(a) for a in args) != tags:
                raise StoreError(f"{name}: malformed arguments")
            result = getattr(self, name)(*args)
            return OK, [] if result is None else [result]
        except StoreTimeout as e:
            return TIMEOUT, [str(e)]
        except StoreFull as e:
            return FULL, [str(e)]
        except (StoreError, ValueError, IndexError) as e:
            return ERROR, [str(e)]


def _tag(value) -> str:
    return {bool: "?", int: "i", float: "f", bytes: "b", list: "l"}[type(value)]


# ---------------------------------------------------------------- the client


class StoreClient(dist.Store):
    """A connection to the store, usable wherever torch.distributed takes a Store (PrefixStore,
    init_process_group, ProcessGroupNCCL). One call at a time (a lock serializes threads; a blocking
    call holds it). `timeout` bounds every call, and is how long get() waits for a key. A call
    that fails on the connection (server frozen, gone) loses the connection: every later call
    says so at once; open a new client."""

    def __init__(self, host: str, port: int, token: bytes, job: str, timeout: float,
                 connect_timeout: float | None = None, limits: Limits = Limits()):
        super().__init__()
        self.set_timeout(datetime.timedelta(seconds=timeout))
        self.host, self.port, self.limits = host, port, limits
        self._token, self._job = token, job
        self._where = f"the rendezvous store at {host}:{port}"
        self._lock = threading.Lock()
        self._seq = 0
        self._lost: str | None = None
        self._sock, self._key = self._connect(timeout if connect_timeout is None else connect_timeout)
        self._sock.settimeout(None)  # blocking, with the kernel's timeouts (_exchange)
        self._buf = bytearray(1 << 16)  # answers are read into it (a larger one gets a larger buffer)
        # torch holds a Python store only through its C++ part: without a reference of our own,
        # a client handed straight to PrefixStore would be collected and its calls would fail.
        _OPEN.add(self)

    def _connect(self, within: float) -> tuple[socket.socket, bytes]:
        """Connect and prove the token; retry while the server is not up yet or is busy."""
        deadline = time.monotonic() + within
        pause, last = 0.05, "no attempt"
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(deadline - time.monotonic(), 1e-3))
            except OSError as e:
                last = str(e)
            else:
                try:
                    return sock, self._handshake(sock, deadline)
                except StoreRefused:
                    hang_up(sock)
                    raise
                except (OSError, StoreError) as e:  # busy, closed, or out of time
                    hang_up(sock)
                    last = str(e)
            if time.monotonic() + pause > deadline:
                raise StoreError(f"cannot reach {self._where} within {within:.0f}s: {last}")
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _handshake(self, sock: socket.socket, deadline: float) -> bytes:
        magic, version, server_nonce = HELLO.unpack(recv_exact(sock, HELLO.size, deadline))
        if magic != MAGIC:
            raise StoreRefused(f"{self._where} is not a weightsync rendezvous store (it sent {magic!r})")
        if version == 0:
            raise StoreError(f"{self._where} is at its connection limit")
        client_nonce = secrets.token_bytes(32)
        proof, answer, key = handshake_macs(self._token, self._job, server_nonce, client_nonce)
        send_all(sock, PROOF.pack(MAGIC, client_nonce, proof), deadline)
        ok, server_proof = VERDICT.unpack(recv_exact(sock, VERDICT.size, deadline))
        if not ok:
            raise StoreRefused(f"{self._where} refused this client's proof: its token differs from the one of "
                               f"job {self._job}, or the store belongs to another job")
        if not same(server_proof, answer):
            raise StoreRefused(f"{self._where} did not prove it holds the token of job {self._job}: it is not this "
                               "job's controller")
        return key

    def close(self) -> None:
        _OPEN.discard(self)
        with self._lock:
            self._lost = self._lost or "the client was closed"
            hang_up(self._sock)

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, name: str, *args, wait=None):
        """One round trip within the client's timeout. `wait`: how long a blocking call may wait
        for keys (default: the timeout); the server answers a little before the deadline, so that
        its answer arrives in time, and a wait longer than the timeout moves the deadline."""
        limit = _seconds(self.timeout)
        if name in BLOCKING:
            want = limit if wait is None else _seconds(wait)
            limit = max(limit, want)
            args = (*args, max(0.0, min(want, limit - min(1.0, limit / 10))))
        payload = bytes([CODES[name]]) + pack(args)
        if len(payload) > self.limits.frame_bytes - 64:
            raise StoreFull(f"{name}: {len(payload)} bytes in one request, over the store's limit of "
                            f"{self.limits.value_bytes} bytes per value")
        with self._lock:
            if self._lost:
                raise StoreError(f"{self._where}: the connection was lost earlier ({self._lost}); open a new client")
            deadline = time.monotonic() + limit
            self._seq += 1
            try:
                reply = self._exchange(seal(self._key, b"C", self._seq, payload), deadline)
            except (socket.timeout, BlockingIOError):
                self._lose(f"no answer to {name} within {limit:.1f}s")
                raise StoreTimeout(f"{self._where} did not answer {name} within {limit:.1f}s "
                                   "(the controller is frozen, overloaded or gone)") from None
            except (OSError, ValueError) as e:
                self._lose(f"{name}: {e}")
                raise StoreError(f"{self._where}: the connection failed during {name}: {e}") from None
        status, results = reply[0], unpack(reply[1:])
        if status == OK:
            return results[0] if results else None
        message = f"{self._where}: {results[0].decode()}"
        raise {TIMEOUT: StoreTimeout, FULL: StoreFull}.get(status, StoreError)(message)

    def _exchange(self, frame: bytes, deadline: float) -> bytes:
        """Send a request, receive the answer's payload. The socket blocks, with the kernel's own
        timeouts (SO_SNDTIMEO, SO_RCVTIMEO) set to the time left: then a round trip gives up the
        GIL about twice (one send, usually one receive), not at every poll and receive, which
        matters in a process whose other threads keep the GIL busy (generation, training)."""
        sock, buf = self._sock, self._buf
        self._arm(deadline)
        sock.sendall(frame)
        got, need = 0, LENGTH.size
        while got < need:
            if got:
                self._arm(deadline)
            n = sock.recv_into(memoryview(buf)[got:])
            if n == 0:
                raise Closed(f"the connection closed after {got} of {need} bytes")
            got += n
            if need == LENGTH.size and got >= LENGTH.size:
                need += frame_length(bytes(buf[:LENGTH.size]), self.limits.frame_bytes)
                if need > len(buf):
                    buf = buf + bytearray(need - len(buf))
        return open_frame(bytes(buf[LENGTH.size:need]), self._key, b"S", self._seq)

    def _arm(self, deadline: float) -> None:
        left = max(deadline - time.monotonic(), 1e-3)
        tv = struct.pack("ll", int(left), int(left % 1 * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)

    def _lose(self, why: str) -> None:
        self._lost = why
        hang_up(self._sock)

    # the torch.distributed Store interface (PrefixStore's C++ side calls the camelCase names)

    def set(self, key, value) -> None:
        self._call("set", _b(key), _b(value))

    def get(self, key) -> bytes:
        return self._call("get", _b(key))

    def add(self, key, value: int) -> int:
        return self._call("add", _b(key), int(value))

    def check(self, keys) -> bool:
        return self._call("check", [_b(k) for k in keys])

    def wait(self, keys, timeout=None) -> None:
        self._call("wait", [_b(k) for k in keys], wait=timeout)

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call("compare_set", _b(key), _b(expected), _b(desired))

    def delete_key(self, key) -> bool:
        return self._call("delete_key", _b(key))

    def num_keys(self) -> int:
        return self._call("num_keys")

    def append(self, key, value) -> None:
        self._call("append", _b(key), _b(value))

    def multi_get(self, keys) -> list[bytes]:
        return self._call("multi_get", [_b(k) for k in keys])

    def multi_set(self, keys, values) -> None:
        self._call("multi_set", [_b(k) for k in keys], [_b(v) for v in values])

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> "StoreClient":
        return StoreClient(self.host, self.port, self._token, self._job, _seconds(self.timeout), limits=self.limits)

    deleteKey = delete_key
    getNumKeys = num_keys


_OPEN: set[StoreClient] = set()
