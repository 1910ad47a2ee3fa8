"""Shaped network links on one machine: every rank in its own network namespace.

On loopback every process shares the kernel's one fast path, so a transfer benchmark there
measures CPU copies, not a network. Links gives each rank of a benchmark a network namespace of
its own, joined to a bridge by a veth pair whose two ends are each shaped by a token bucket (tbf)
to one rate: what the rank sends and what it receives, as on a full-duplex NIC of that speed. The
bridge's own address serves the benchmark's store. So N senders beat one sender exactly when
each has its own link, as on a cluster.

Everything is made here and removed here: one bridge, the namespaces, their veths and addresses
(a /24 of 10.0.0.0/8 that no route of the machine uses), all named after the run's pid and a
random tag. Links is a context manager: it removes everything when the run ends, also on an
exception, SIGINT or SIGTERM (it turns SIGTERM into SystemExit while it is open); what a killed
run left behind (its pid is gone) is removed by the next one. It needs root (CAP_NET_ADMIN) and
iproute2's ip and tc; unavailable() says why it cannot run here.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field

PREFIX = "wsbench"  # namespaces are PREFIX-<pid>-<tag>-<index>; the bridge wsb<tag>, veths wsv<tag><index>
NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000
RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$", re.IGNORECASE)
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
LATENCY = "50ms"  # the most a packet may wait in a token bucket's queue


class LinksError(RuntimeError):
    """The links could not be made or removed; the message says which command failed and why."""


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as 1gbit, 500mbit (decimal units, as tc reads them)."""
    m = RATE.match(rate.strip())
    if not m:
        raise ValueError(f"link rate {rate!r} is not a number with bit, kbit, mbit or gbit, for example 1gbit")
    bits = float(m.group(1)) * UNITS[m.group(2).lower()]
    if bits < 1e6:
        raise ValueError(f"link rate {rate!r} is below 1mbit: a version would take hours")
    return bits


def unavailable() -> str | None:
    """Why network namespaces with shaped links cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's {tool} is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise LinksError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done.stdout


def enter(namespace: str) -> None:
    """Move the calling thread into the network namespace: call it first thing in a process,
    before it opens sockets or starts threads (which then live in it too)."""
    fd = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _free_subnet() -> str:
    """A 10.x.y. prefix that no address or route of the machine uses."""
    used = _run("ip", "-4", "-o", "addr") + _run("ip", "-4", "route")
    for _ in range(100):
        prefix = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}."
        if prefix not in used and f"{prefix[:-1]}.0/" not in used:
            return prefix
    raise LinksError("found no free 10.x.y.0/24 for the links")


def remove_leftovers() -> list[str]:
    """Remove the namespaces and bridges of earlier runs whose process is gone; returns them."""
    removed = []
    if not os.path.isdir(NETNS_DIR):
        return removed
    for name in sorted(os.listdir(NETNS_DIR)):
        m = re.fullmatch(rf"{PREFIX}-(\d+)-([0-9a-f]+)-\d+", name) or re.fullmatch(rf"{PREFIX}-(\d+)-probe[0-9a-f]+", name)
        if not m or _alive(int(m.group(1))):
            continue
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        removed.append(name)
        if m.lastindex == 2:
            bridge = f"wsb{m.group(2)}"
            if subprocess.run(["ip", "link", "del", bridge], capture_output=True).returncode == 0:
                removed.append(bridge)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Links:
    """`count` namespaces, each with one link of `rate` (a tc rate, for example 1gbit) to a shared
    bridge. namespaces[i] has the address addresses[i]; the bridge, in the calling process's
    namespace, has host_address."""

    rate: str
    count: int
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    host_address: str = ""
    made: list[tuple[str, ...]] = field(default_factory=list)  # commands that undo what was made, in order

    def __post_init__(self):
        self.bits = rate_bits(self.rate)
        if not 1 <= self.count <= 200:
            raise ValueError(f"links for {self.count} ranks: between 1 and 200")

    @property
    def bridge(self) -> str:
        return f"wsb{self.tag}"

    def burst(self) -> int:
        """The token bucket's depth in bytes: 4 ms at the rate, and at least 256 KiB, so that a
        64 KiB segment (GSO) always fits and the kernel's timer granularity does not cap the rate."""
        return max(256 << 10, int(self.bits / 8 * 0.004))

    def shape(self, device: str, namespace: str | None = None) -> None:
        where = ("ip", "netns", "exec", namespace) if namespace else ()
        _run(*where, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", self.rate,
             "burst", str(self.burst()), "latency", LATENCY)

    def create(self) -> "Links":
        remove_leftovers()
        prefix = _free_subnet()
        self.host_address = f"{prefix}1"
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self.made.append(("ip", "link", "del", self.bridge))
        _run("ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(self.count):
            ns, veth, address = f"{PREFIX}-{os.getpid()}-{self.tag}-{i}", f"wsv{self.tag}{i}", f"{prefix}{10 + i}"
            _run("ip", "netns", "add", ns)
            self.made.insert(0, ("ip", "netns", "del", ns))  # its veth pair goes with it
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            self.shape(veth)  # what the rank receives
            self.shape("eth0", ns)  # what the rank sends
            self.namespaces.append(ns)
            self.addresses.append(address)
        return self

    def remove(self) -> None:
        """Remove everything made, in reverse; raise LinksError naming what could not be removed."""
        failed = []
        while self.made:
            cmd = self.made.pop(0)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                failed.append(f"`{' '.join(cmd)}`: {done.stderr.strip()}")
        self.namespaces, self.addresses = [], []
        if failed:
            raise LinksError("could not remove " + "; ".join(failed))

    def __enter__(self) -> "Links":
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            return self.create()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.remove()
        finally:
            signal.signal(signal.SIGTERM, self._previous)


def _exit_on_sigterm(signum, _frame):
    raise SystemExit(128 + signum)
