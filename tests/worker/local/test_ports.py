"""The ports of local runs: below the kernel's ephemeral range, free when picked, and leased, so
that two runs on one machine (two test workers) never pick the same port before either binds it."""

from __future__ import annotations

import socket
import subprocess
import sys

from weightsync.local import ports

# asks, in a process of its own, whether each port given could be leased there
PROBE = ("import sys; from weightsync.local import ports; fd = ports._leases_file(); "
         "print(' '.join(str(int(ports._take(fd, int(p)))) for p in sys.argv[1:]))")


def leasable_elsewhere(*wanted: int) -> list[bool]:
    out = subprocess.run([sys.executable, "-c", PROBE, *map(str, wanted)], capture_output=True, text=True, timeout=60,
                         check=True)
    return [w == "1" for w in out.stdout.split()]


def test_runs_are_consecutive_distinct_below_the_ephemeral_range_and_free():
    firsts = ports.lease([1, 4, 1, 3])
    try:
        taken = [p for first, n in zip(firsts, [1, 4, 1, 3]) for p in range(first, first + n)]
        assert len(set(taken)) == len(taken)
        low = int(ports.EPHEMERAL.read_text().split()[0])
        assert all(ports.LOWEST <= p < low for p in taken)
        for p in taken:  # free: each binds
            with socket.socket() as s:
                s.bind((ports.LOOPBACK, p))
    finally:
        ports.release(firsts)


def test_a_leased_port_is_not_offered_elsewhere_until_released_or_its_process_ends():
    firsts = ports.lease([2])
    mine = [firsts[0], firsts[0] + 1]
    assert leasable_elsewhere(*mine) == [False, False]
    again = ports.lease([1])
    assert again[0] not in mine  # nor again in this process
    ports.release(firsts + again)
    assert leasable_elsewhere(*mine) == [True, True]
    # a process that ends without releasing: the kernel drops its leases
    ended = subprocess.run([sys.executable, "-c", "from weightsync.local import ports; print(ports.lease([3])[0])"],
                           capture_output=True, text=True, timeout=60, check=True)
    first = int(ended.stdout)
    assert leasable_elsewhere(first, first + 1, first + 2) == [True, True, True]


def test_a_port_in_use_is_never_leased():
    with socket.socket() as busy:
        busy.bind((ports.LOOPBACK, 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert leasable_elsewhere(port) == [False]
