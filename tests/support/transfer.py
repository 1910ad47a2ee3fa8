"""Ranks of the transfer path as real processes on loopback (transfer_peer.py), and a store
they rendezvous through: the fixtures and helpers of the transfer, delta and transport tests."""

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

PEER = Path(__file__).with_name("transfer_peer.py")


TOKEN = "test-job-token-0123456789"


ODD = "7x3,1,33,5x5x5,2x64,999"  # odd element counts: tensors and buckets cut mid-tensor


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    yield s


class Ranks:
    """The processes of one test; all are gone when it ends, whatever happened."""

    def __init__(self, store, trainers, inferences, shapes, dtype="float32", bucket=4096, versions=2, env=None):
        self.store, self.procs = store, {}
        self.common = ["--trainers", str(trainers), "--inferences", str(inferences), "--shapes", shapes,
                       "--dtype", dtype, "--bucket", str(bucket), "--versions", str(versions),
                       "--store-port", str(store.port)]
        self.env = env  # env(role, rank): what a process gets in its environment beyond this one's

    def start(self, role, rank, *flags, wrap=()):
        """Start a peer process (its command after `wrap`, for example ip netns exec NAME)."""
        cmd = [*wrap, sys.executable, str(PEER), "--role", role, "--rank", str(rank), *self.common, *flags]
        env = {**os.environ, **self.env(role, rank)} if self.env else None
        self.procs[(role, rank)] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        return self.procs[(role, rank)]

    def wait(self, timeout=120):
        deadline = time.monotonic() + timeout
        codes = {}
        for key, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{key} did not finish within {timeout}s\n{self.report()}")
            codes[key] = p.returncode
        return codes

    def stderr(self):
        return {k: p.stderr.read() for k, p in self.procs.items() if p.stderr and p.poll() is not None}

    def report(self) -> str:
        """For a test that gives up on these ranks: every live one's Python stacks (each peer dumps
        them on SIGUSR1), then every rank's exit code and stderr; all of them stopped."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGUSR1)
        time.sleep(2 if live else 0)
        for p in live:
            p.kill()
            p.wait()
        return "\n".join(f"--- {role} rank {rank} (exit {p.returncode}{', stopped by the test' if p in live else ''}):\n"
                         f"{p.stderr.read() if p.stderr else ''}" for (role, rank), p in self.procs.items())

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdin, p.stderr):
                if f:
                    f.close()


@pytest.fixture
def ranks(store):
    made = []

    def make(*args, **kwargs):
        made.append(Ranks(store, *args, **kwargs))
        return made[-1]
    yield make
    for r in made:
        r.close()


def send_and_check(r: Ranks, store, trainers: int, inferences: int, versions: int, *flags: str) -> None:
    """Run every rank to the end; every version on every inference rank is the trainers' cast
    bytes, bit for bit, with their digest."""
    for i in range(inferences):
        r.start("inference", i, *flags)
    for t in range(trainers):
        r.start("trainer", t, *flags)
    codes = r.wait()
    assert all(c == 0 for c in codes.values()), (codes, r.stderr())
    for v in range(1, versions + 1):
        for i in range(inferences):
            res = json.loads(store.get(f"result/{v}/{i}"))
            assert res["bit_exact"], f"version {v} on inference rank {i} differs from the trainers' cast bytes"
            assert res["digest"] == res["trainers_digest"]

