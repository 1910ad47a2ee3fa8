"""The store's client: a connection that proves the job's token (wire.py defines the bytes) and is
a torch.distributed Store, so that PrefixStore, init_process_group and ProcessGroupNCCL take it.
Every call has a deadline (the client's timeout): a frozen or dead controller is an error within
it, never a hang.
"""

from __future__ import annotations

import datetime
import secrets
import socket
import struct
import threading
import time

import torch.distributed as dist

from weightsync.job.token import same
from weightsync.rendezvous.store.table import Limits, StoreError, StoreFull, StoreRefused, StoreTimeout, as_seconds
from weightsync.rendezvous.store.wire import (
    BLOCKING,
    CODES,
    FULL,
    HELLO,
    LENGTH,
    MAGIC,
    OK,
    PROOF,
    TIMEOUT,
    VERDICT,
    as_bytes,
    frame_length,
    handshake_macs,
    open_frame,
    pack,
    seal,
    unpack,
)
from weightsync.transport.sockets import PeerClosed, hang_up, recv_exact, send_all


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
        send_all(sock, [PROOF.pack(MAGIC, client_nonce, proof)], deadline)
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
        limit = as_seconds(self.timeout)
        if name in BLOCKING:
            want = limit if wait is None else as_seconds(wait)
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
                raise PeerClosed(f"the connection closed after {got} of {need} bytes")
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
        self._call("set", as_bytes(key), as_bytes(value))

    def get(self, key, wait=None) -> bytes:
        """The key's value, once it is set (at most `wait` seconds, the timeout by default)."""
        return self._call("get", as_bytes(key), wait=wait)

    def add(self, key, value: int) -> int:
        return self._call("add", as_bytes(key), int(value))

    def check(self, keys) -> bool:
        return self._call("check", [as_bytes(k) for k in keys])

    def wait(self, keys, timeout=None) -> None:
        self._call("wait", [as_bytes(k) for k in keys], wait=timeout)

    def wait_get(self, keys, stops, looks, timeout=None) -> list[bytes]:
        """Table.wait_get: wait until every key or one of `stops` is set (at most `timeout`), then
        the values of the keys, the stops and `looks` in peek's form, in one round trip."""
        return self._call("wait_get", [as_bytes(k) for k in keys], [as_bytes(k) for k in stops],
                          [as_bytes(k) for k in looks], wait=timeout)

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call("compare_set", as_bytes(key), as_bytes(expected), as_bytes(desired))

    def delete_key(self, key) -> bool:
        return self._call("delete_key", as_bytes(key))

    def num_keys(self) -> int:
        return self._call("num_keys")

    def append(self, key, value) -> None:
        self._call("append", as_bytes(key), as_bytes(value))

    def multi_get(self, keys) -> list[bytes]:
        return self._call("multi_get", [as_bytes(k) for k in keys])

    def peek(self, keys) -> list[bytes]:
        """The keys' values now, in one round trip and without waiting (Table.peek's form)."""
        return self._call("peek", [as_bytes(k) for k in keys])

    def multi_set(self, keys, values) -> None:
        self._call("multi_set", [as_bytes(k) for k in keys], [as_bytes(v) for v in values])

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> "StoreClient":
        return StoreClient(self.host, self.port, self._token, self._job, as_seconds(self.timeout), limits=self.limits)

    deleteKey = delete_key  # noqa: N815 - the names PrefixStore's C++ side calls
    getNumKeys = num_keys  # noqa: N815


_OPEN: set[StoreClient] = set()
