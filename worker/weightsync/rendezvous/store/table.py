"""The store's keys and values, with the semantics of torch's TCPStore and the bounds of Limits,
and the errors every side of the store raises. The server's clients and the server's own process
(the controller) use the same Table methods.
"""

from __future__ import annotations

import datetime
import math
import threading
from dataclasses import dataclass

from weightsync.job import reasons
from weightsync.job.errors import JobFailed, TimedOut
from weightsync.rendezvous.store.wire import SET, UNSET, as_bytes

MAX_WAIT = 86400.0  # the longest a client may ask the server to wait for keys
KEY_OVERHEAD = 64  # bytes counted per key on top of its name and value (the table's own cost)


class StoreError(RuntimeError):
    """The store refused a request, or the connection to it failed (the message says which). Not
    a failure of the job by itself (the controller's own store failing is a bug); the kinds below
    that are say why."""


class StoreTimeout(StoreError, TimedOut):
    """A deadline passed: keys not set in time, or a server that did not answer in time."""


class StoreFull(StoreError, JobFailed):
    """A request would take the store over one of its bounds (Limits)."""

    reason = reasons.STORE_FULL


class StoreRefused(StoreError, JobFailed):
    """The handshake failed: the client or the server does not hold the job's token."""

    reason = reasons.TOKEN_PROOF_FAILED


@dataclass(frozen=True)
class Limits:
    """What clients may make the server hold."""

    value_bytes: int = 64 << 20  # one value, and all values of one request
    total_bytes: int = 256 << 20  # keys and values together, KEY_OVERHEAD per key included
    keys: int = 100_000
    key_bytes: int = 4096
    connections: int = 512  # connections that proved the token (the others count in pending)
    pending: int = 64  # connections that have not proven the token yet

    @property
    def frame_bytes(self) -> int:
        return self.value_bytes + (1 << 20)


@dataclass(frozen=True)
class Held:
    """The store's size and load: its keys, their bytes, the requests its clients made (None where not known)."""

    keys: int
    bytes: int | None = None
    requests: int | None = None


def as_seconds(timeout) -> float:
    """A timeout given as a timedelta (torch's way) or as seconds, in seconds."""
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def _shown(key: bytes) -> str:
    return key.decode(errors="replace")


class Table:
    """The keys and values, with the store's semantics (those of torch's TCPStore) and bounds.
    The server's clients and its own process use the same methods."""

    def __init__(self, limits: Limits, timeout: float):
        self.limits, self.timeout = limits, timeout
        self._data: dict[bytes, bytes] = {}
        self._bytes = 0
        self._lock = threading.RLock()
        # Each wait has a condition of its own, under every key it waits for: a set wakes the waits
        # for its keys alone. One condition for all would wake every waiting client at every set,
        # and a job's every heartbeat is a set: N ranks waiting, N beats a second, N^2 wake-ups.
        self._waiting: dict[bytes, set[threading.Condition]] = {}
        self._arrivals: dict[bytes, set[Arrivals]] = {}  # the in-process watches of keys' sets, by key
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
            for waiter in self._waiting.get(key, ()):
                waiter.notify()
            for watch in self._arrivals.get(key, ()):
                watch.arrived(key)

    def _limit(self, timeout, what: str) -> float:
        """A client's timeout (None: the store's own) as the seconds a wait may take."""
        seconds = as_seconds(self.timeout if timeout is None else timeout)
        if not math.isfinite(seconds):  # NaN would make a wait spin for ever
            raise StoreError(f"{what}: a timeout of {seconds} seconds is no number of seconds")
        return min(max(seconds, 0.0), MAX_WAIT)

    def _await(self, keys: list[bytes], timeout, what: str) -> None:
        """Wait, holding the lock, until every key is set; StoreTimeout past `timeout` seconds."""
        limit = self._limit(timeout, what)
        if not self._wait_for(keys, limit):
            missing = ", ".join(_shown(k) for k in keys if k not in self._data)
            raise StoreTimeout(f"{what}: {missing} not set within {limit:.1f}s")
        if not all(k in self._data for k in keys):
            raise StoreError(f"{what}: the store is closing (its process is ending)")

    def _wait_for(self, keys: list[bytes], limit: float, every: bool = True, stops: list[bytes] = ()) -> bool:
        """Wait, holding the lock, until every key is set (not `every`: one of them), one of `stops`
        is, or the store closes; False past `limit` seconds."""
        def there() -> bool:
            return self._closing or (all if every else any)(k in self._data for k in keys) or \
                any(k in self._data for k in stops)

        if there():
            return True
        waiter = threading.Condition(self._lock)
        watched = set(keys) | set(stops)
        for k in watched:
            self._waiting.setdefault(k, set()).add(waiter)
        try:
            return waiter.wait_for(there, limit)
        finally:
            for k in watched:
                waiters = self._waiting[k]
                waiters.discard(waiter)
                if not waiters:
                    del self._waiting[k]

    def wait_any(self, keys, timeout: float) -> bool:
        """Wait until one of `keys` is set, at most `timeout` seconds; whether one is. For the store's
        own process (the controller collecting its ranks' reports), which no client asks it."""
        keys = [as_bytes(k) for k in keys]
        with self._lock:
            return self._wait_for(keys, min(max(timeout, 0.0), MAX_WAIT), every=False) and any(k in self._data for k in keys)

    def arrivals(self, keys) -> Arrivals:
        """A watch of `keys` that hands out each of them once it is set (those set already first):
        for the store's own process (the controller collecting a round's records from a thousand
        ranks), which reads each record as it comes, never every key again at each one's arrival.
        Close it (or use it as a context manager) once done."""
        watch = Arrivals(self, [as_bytes(k) for k in keys])
        with self._lock:
            for k in watch.keys:
                self._arrivals.setdefault(k, set()).add(watch)
                if k in self._data:
                    watch.come.append(k)
        return watch

    def _unwatch(self, watch: Arrivals) -> None:
        with self._lock:
            for k in watch.keys:
                watches = self._arrivals.get(k)
                if watches is not None:
                    watches.discard(watch)
                    if not watches:
                        del self._arrivals[k]

    def end_waits(self) -> None:
        """The store is closing: every wait ends now (and every later one at once)."""
        with self._lock:
            self._closing = True
            for waiters in self._waiting.values():
                for waiter in waiters:
                    waiter.notify_all()
            for watches in self._arrivals.values():
                for watch in watches:
                    watch.ready.notify_all()

    @property
    def waits(self) -> int:
        """The waits in progress (each counted once per key it waits for)."""
        with self._lock:
            return sum(len(w) for w in self._waiting.values())

    def set(self, key, value) -> None:
        with self._lock:
            self._put([(as_bytes(key), as_bytes(value))])

    def get(self, key, timeout=None) -> bytes:
        key = as_bytes(key)
        with self._lock:
            self._await([key], timeout, "get")
            return self._data[key]

    def add(self, key, amount: int) -> int:
        key = as_bytes(key)
        with self._lock:
            old = self._data.get(key, b"0")
            try:
                value = int(old) + int(amount)
            except ValueError:
                raise StoreError(f"add: {_shown(key)!r} holds {old[:32]!r}, not a number") from None
            self._put([(key, str(value).encode())])
            return value

    def wait_get(self, keys, stops, looks, timeout=None) -> list[bytes]:
        """Wait until every key is set or one of `stops` is, at most `timeout` seconds; then the
        values of the keys, the stops and `looks`, in that order, as peek gives them (past the
        timeout too, with a key unset and no stop set). A rank's wait, the read of what it waited
        for and the look of its check in one request, where they were three: a wait, a get, and
        a peek or check every second it waited."""
        keys, stops, looks = ([as_bytes(k) for k in ks] for ks in (keys, stops, looks))
        with self._lock:
            self._wait_for(keys, self._limit(timeout, "wait_get"), stops=stops)
            if self._closing and not all(k in self._data for k in keys) and not any(k in self._data for k in stops):
                raise StoreError("wait_get: the store is closing (its process is ending)")
            return [UNSET if v is None else SET + v for v in (self._data.get(k) for k in keys + stops + looks)]

    def check(self, keys) -> bool:
        with self._lock:
            return all(as_bytes(k) in self._data for k in keys)

    def wait(self, keys, timeout=None) -> None:
        with self._lock:
            self._await([as_bytes(k) for k in keys], timeout, "wait")

    def compare_set(self, key, expected, desired) -> bytes:
        """As TCPStore: set `desired` if the key holds `expected` (or is unset and `expected` is
        empty); return what the key holds afterwards (`expected` if it stays unset)."""
        key, expected, desired = as_bytes(key), as_bytes(expected), as_bytes(desired)
        with self._lock:
            current = self._data.get(key)
            if (current is None and not expected) or (current is not None and current == expected):
                self._put([(key, desired)])
                return desired
            return expected if current is None else current

    def delete_key(self, key) -> bool:
        key = as_bytes(key)
        with self._lock:
            value = self._data.pop(key, None)
            if value is None:
                return False
            self._bytes -= len(key) + len(value) + KEY_OVERHEAD
            return True

    def num_keys(self) -> int:
        with self._lock:
            return len(self._data)

    def append(self, key, value) -> None:
        key = as_bytes(key)
        with self._lock:
            self._put([(key, self._data.get(key, b"") + as_bytes(value))])

    def multi_get(self, keys, timeout=None) -> list[bytes]:
        keys = [as_bytes(k) for k in keys]
        with self._lock:
            self._await(keys, timeout, "multi_get")
            return [self._data[k] for k in keys]

    def peek(self, keys) -> list[bytes]:
        """The keys' values as they are now, without waiting, as the wire carries them: SET and the
        value of a key that is set, UNSET for one that is not (Channel.peek reads them)."""
        with self._lock:
            return [UNSET if v is None else SET + v for v in (self._data.get(as_bytes(k)) for k in keys)]

    def multi_set(self, keys, values) -> None:
        if len(keys) != len(values):
            raise StoreError(f"multi_set: {len(keys)} keys but {len(values)} values")
        with self._lock:
            self._put([(as_bytes(k), as_bytes(v)) for k, v in zip(keys, values)])


class Arrivals:
    """Keys of a Table handed out as they are set (Table.arrivals), each once."""

    def __init__(self, table: Table, keys: list[bytes]):
        self.table, self.keys = table, keys
        self.come: list[bytes] = []  # set since the last take
        self.ready = threading.Condition(table._lock)

    def arrived(self, key: bytes) -> None:
        """`key` was set (the table's lock held)."""
        self.come.append(key)
        self.ready.notify()

    def take(self, timeout: float) -> list[str]:
        """The keys set since the last take (each once), waiting up to `timeout` seconds for one;
        [] past it, or once the store closes."""
        with self.ready:
            if not self.come and not self.table._closing:
                self.ready.wait(min(max(timeout, 0.0), MAX_WAIT))
            come, self.come = self.come, []
        return [k.decode() for k in dict.fromkeys(come)]

    def close(self) -> None:
        self.table._unwatch(self)

    def __enter__(self) -> Arrivals:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
