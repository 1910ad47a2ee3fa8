"""Loopback ports for the processes of a run on one machine, picked so that nothing else takes
them between the pick and the bind of the process they are for (seconds later: it must start first).

Two things can take a port picked free that way. The kernel hands the ports of its ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range) to outgoing connections, so a port picked there can be
some client's source port a moment later; ports here come from below that range. And two runs on
one machine (two terminals, two test workers) can each find the same port free before either binds
it; so every port picked is leased: a lock on its byte of one file in the temp directory, which
every weightsync process on the machine takes before it picks, held until the run releases it or
its process ends (the kernel drops the locks of a process that ends, however it ends).

POSIX record locks belong to the process, and closing any descriptor of the file drops them all:
the file is opened once per process and never closed; leases within the process are kept here."""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import threading
from pathlib import Path

LOOPBACK = "127.0.0.1"
LOWEST = 20000  # above the ports servers are usually configured on (kubelet's 10250, Prometheus' 9090)
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
LEASES = Path(tempfile.gettempdir()) / "weightsync-ports.lock"

_guard = threading.Lock()
_fd: int | None = None
_leased: dict[int, int] = {}  # first port of each leased run -> its length


def span() -> range:
    """The ports picked from: LOWEST up to the kernel's ephemeral range, or, where that range
    starts lower, from its end to 65535."""
    try:
        low, high = (int(p) for p in EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    if low - LOWEST >= 1000:
        return range(LOWEST, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    raise OSError(f"no room for weightsync's ports outside the ephemeral range {low}-{high} ({EPHEMERAL}): "
                  f"leave at least 1000 ports free of it between {LOWEST} and 65535")


def lease(runs: list[int]) -> list[int]:
    """For each n in `runs`, the first of n consecutive loopback ports, free now and leased to
    this process until release() (all distinct)."""
    with _guard:
        fd = _leases_file()
        ports = span()
        out: list[int] = []
        try:
            for n in runs:
                out.append(_lease_run(fd, ports, n))
        except BaseException:
            _release(fd, out)
            raise
        return out


def release(firsts: list[int]) -> None:
    """Give back the runs that start at `firsts` (leased by lease())."""
    with _guard:
        if _fd is not None:
            _release(_fd, firsts)


def _lease_run(fd: int, ports: range, n: int) -> int:
    start = random.randrange(len(ports))
    for i in range(len(ports)):
        first = ports[(start + i) % len(ports)]
        if first + n > ports.stop:
            continue
        taken = []
        for port in range(first, first + n):
            if _take(fd, port):
                taken.append(port)
            else:
                break
        if len(taken) == n:
            _leased[first] = n
            return first
        for port in taken:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, port)
    raise OSError(f"no {n} consecutive free loopback ports in {ports.start}-{ports.stop - 1}: every one is "
                  "in use or leased by another weightsync run on this machine")


def _take(fd: int, port: int) -> bool:
    """Lease `port` if no lease here or elsewhere holds it and it can be bound now."""
    if any(first <= port < first + n for first, n in _leased.items()):
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:
        return False  # another process's lease
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
            return True
        except OSError:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, port)
            return False


def _release(fd: int, firsts: list[int]) -> None:
    for first in firsts:
        n = _leased.pop(first, 0)
        if n:
            fcntl.lockf(fd, fcntl.LOCK_UN, n, first)


def _leases_file() -> int:
    global _fd
    if _fd is None:
        try:
            _fd = os.open(LEASES, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            raise OSError(f"cannot open {LEASES}, the file through which weightsync runs on this machine lease "
                          f"their ports: {e}. Make it writable for every user who runs weightsync "
                          "(chmod 666), or set TMPDIR to a directory of your own") from None
        if os.fstat(_fd).st_uid == os.getuid():
            os.fchmod(_fd, 0o666)  # other users' runs lease through the same file (the umask took bits off)
    return _fd
