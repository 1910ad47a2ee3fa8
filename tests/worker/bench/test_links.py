"""Shaped links (links.py): a transfer between real processes in two network namespaces, over
links shaped by tbf, arrives bit for bit (whole, then as deltas), and its bytes went through the
shaped links; everything the links made is gone when they close, also when their process gets
SIGTERM, and what a killed run left behind is removed by the next. Skipped, with the reason,
where the machine cannot make network namespaces (not root, no iproute2)."""

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist
from support.transfer import Ranks

from weightsync.bench import netns as links
from weightsync.bench.netns import Links

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`

WHY = links.unavailable()
needs_namespaces = pytest.mark.skipif(WHY is not None, reason=f"network namespaces cannot be made here: {WHY}")

WORKER = Path(__file__).resolve().parents[3] / "worker"


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def tbf_sent_bytes(namespace: str) -> int:
    """Bytes that left the namespace through its token bucket."""
    out = subprocess.run(["ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show", "dev", "eth0"],
                         capture_output=True, text=True, check=True).stdout
    assert "tbf" in out, out
    return int(re.search(r"Sent (\d+) bytes", out).group(1))


class RanksInNamespaces(Ranks):
    """test_transfer's peers, each started inside its own namespace."""

    def __init__(self, net: Links, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.net = net

    def start(self, role, rank, *flags):
        index = rank if role == "trainer" else len([k for k in self.procs if k[0] == "trainer"]) + rank
        proc = super().start(role, rank, "--host", self.net.addresses[index], "--store-host", self.net.host_address, *flags,
                             wrap=["ip", "netns", "exec", self.net.namespaces[index]])
        return proc


@needs_namespaces
def test_delta_versions_over_shaped_links_between_two_namespaces():
    with Links("200mbit", 2) as net:
        assert set(net.namespaces) <= netns_names()
        store = dist.TCPStore(net.host_address, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))
        bases = [{0: None}, {0: 1}, {0: 2}]
        for v, named in enumerate(bases, start=1):
            store.set(f"bases/{v}", json.dumps({str(k): b for k, b in named.items()}))
        ranks = RanksInNamespaces(net, store, 1, 1, "512x256,77,300x129", "bfloat16", 256 << 10, len(bases))
        try:
            ranks.start("trainer", 0, "--delta", "--change", "0.02", "--timeout", "120")
            ranks.start("inference", 0, "--delta", "--change", "0.02", "--timeout", "120")
            codes = ranks.wait(300)
            assert all(c == 0 for c in codes.values()), (codes, ranks.stderr())
        finally:
            ranks.close()
        for v in (1, 2, 3):
            res = json.loads(store.get(f"result/{v}/0"))
            assert res["bit_exact"] and res["digest"] == res["trainers_digest"], res
            assert (res["patched"] > 0) == (v > 1) and not res["refused"]
        whole = json.loads(store.get("sent/1/0"))["wire_bytes"]
        assert json.loads(store.get("sent/2/0"))["wire_bytes"] < whole / 10
        # the version's bytes went out through the trainer's shaped link
        assert tbf_sent_bytes(net.namespaces[0]) > whole
    assert not set(net.namespaces) & netns_names() and not link_exists(net.bridge)


@needs_namespaces
def test_links_are_removed_when_their_process_gets_sigterm(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(WORKER)!r})
        from weightsync.bench.netns import Links
        with Links("100mbit", 2) as net:
            print(net.bridge, *net.namespaces, flush=True)
            time.sleep(600)
        """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        bridge, *namespaces = proc.stdout.readline().split()
        assert set(namespaces) <= netns_names() and link_exists(bridge)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert not set(namespaces) & netns_names() and not link_exists(bridge)


@needs_namespaces
def test_what_a_killed_run_left_is_removed_by_the_next():
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # a pid no process can have
    name = f"{links.PREFIX}-{dead}-abc123-0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "link", "add", "wsbabc123", "type", "bridge"], check=True)
    try:
        mine = f"{links.PREFIX}-{os.getpid()}-def456-0"  # a live run's: kept
        subprocess.run(["ip", "netns", "add", mine], check=True)
        try:
            removed = links.remove_leftovers()
            assert name in removed and "wsbabc123" in removed and mine not in removed
            assert name not in netns_names() and mine in netns_names()
        finally:
            subprocess.run(["ip", "netns", "del", mine], capture_output=True)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", "wsbabc123"], capture_output=True)


def test_rates_are_read_as_tc_reads_them():
    assert links.rate_bits("1gbit") == 1e9 and links.rate_bits("2.5Gbit") == 2.5e9 and links.rate_bits("500mbit") == 5e8
    with pytest.raises(ValueError, match="for example 1gbit"):
        links.rate_bits("1GB/s")
    with pytest.raises(ValueError, match="below 1mbit"):
        links.rate_bits("100kbit")
