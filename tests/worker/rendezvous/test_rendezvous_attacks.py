"""Attacks on the rendezvous of a running local job (`weightsync run`'s processes on loopback):
without the job's token nothing can be read from the controller's store or written to it, junk
does not pile up in the controller's memory, a captured session cannot be replayed, and the job
runs on to Succeeded with every version verified on every inference rank."""
from __future__ import annotations

import datetime
import io
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from support.jobs import ODD, assert_nothing_left, make_job, store_of, wait_key
from support.store import record_session, recv_all

from weightsync.job import Env
from weightsync.local.runner import LocalJob
from weightsync.rendezvous.store.client import StoreClient
from weightsync.rendezvous.store.table import StoreRefused
from weightsync.rendezvous.store.wire import CODES, HELLO, PROOF, VERDICT, pack, seal
from weightsync.runtime.faults import PAUSE_DIR_ENV
from weightsync.transport.sockets import recv_exact

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`

# Writes that, through torch's TCPStore, each ended a job with a false cause or cheated it.
FORGED = [(b"end", b'{"state": "Failed", "message": "forged"}'), (b"failed/trainer/0", b"forged failure"),
          (b"failures", b"1"), (b"restart/inference/0", b"1"), (b"ref/20", b"0" * 64), (b"join/inference/1", b"7"),
          (b"junk", os.urandom(1 << 16))]
READS = [b"plan", b"plan/mac", b"endpoint/inference/0", b"nonce/trainer/0", b"proof/trainer/0"]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def stranger(port: int, then: bytes) -> bytes:
    """Connect as someone without the token: a made-up proof, then `then`; what came back after
    the server's hello."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        assert HELLO.unpack(recv_exact(sock, HELLO.size))[:2] == (b"WSKV", 1)  # the store is up
        try:
            sock.sendall(PROOF.pack(b"WSKV", os.urandom(32), os.urandom(32)) + then)
        except OSError:
            pass  # the store closed the connection while this was sending
        return recv_all(sock, timeout=60)


def test_without_the_token_a_running_job_cannot_be_read_written_or_filled(tmp_path):
    # trainer rank 0 holds before version 3 until the attacks are over: the job is running throughout
    job = make_job("attacked", config=ODD, dtype="float32", inferences=(2, 1), steps=10, every=1)
    pause = tmp_path / "pause"
    pause.mkdir()
    hold = pause / "trainer-0-before-go-v3"
    hold.with_suffix(".arm").touch()
    local = LocalJob(job, tmp_path / "run", {PAUSE_DIR_ENV: str(pause)}, progress=io.StringIO())
    local.start()
    try:
        legit = store_of(local)
        wait_key(legit, "plan/mac")
        port = int(local.pods[0].env[Env.STORE_PORT])
        token = Path(local.pods[0].env[Env.TOKEN_FILE]).read_bytes().strip()
        controller = local.pods[0].proc.pid
        before = rss_kib(controller)

        # torch's own TCPStore client, which read and wrote everything before, cannot even connect
        old_client: list = []

        def tcpstore():
            try:
                dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=3))
                old_client.append("connected")
            except RuntimeError as e:  # DistNetworkError
                old_client.append(e)

        attempt = threading.Thread(target=tcpstore)
        attempt.start()

        # a client of this store with a wrong token, or the right token for another job
        with pytest.raises(StoreRefused, match="refused this client's proof"):
            StoreClient("127.0.0.1", port, os.urandom(32).hex().encode(), job.identity, timeout=30)
        with pytest.raises(StoreRefused, match="refused this client's proof"):
            StoreClient("127.0.0.1", port, token, "default/another-job", timeout=30)

        # made-up proofs followed by frames that read the plan and the proofs, and write every
        # forged key, under a guessed session key: only the refusal comes back
        guess = os.urandom(32)
        frames = [seal(guess, b"C", i + 1, bytes([CODES["get"]]) + pack([key, 1.0])) for i, key in enumerate(READS)]
        frames += [seal(guess, b"C", len(frames) + i + 1, bytes([CODES["set"]]) + pack([k, v]))
                   for i, (k, v) in enumerate(FORGED)]
        assert stranger(port, b"".join(frames)) == VERDICT.pack(0, bytes(32))
        # 256 MiB of junk on 8 connections at once
        results: list[bytes] = []
        junk = [threading.Thread(target=lambda: results.append(stranger(port, os.urandom(32 << 20)))) for _ in range(8)]
        for t in junk:
            t.start()
        for t in junk:
            t.join(120)
        assert results == [VERDICT.pack(0, bytes(32))] * 8

        # a captured session of the job's own client, replayed, reads nothing
        captured = capture_session(port, token, job.identity)
        assert stranger_replay(port, captured) == VERDICT.pack(0, bytes(32))

        attempt.join(120)
        assert old_client and isinstance(old_client[0], RuntimeError), old_client

        grew = rss_kib(controller) - before
        assert grew < 32 << 10, f"the controller grew by {grew} KiB while strangers sent it 256 MiB"
        assert not legit.check(["end"]), "the job ended before the attacks were over: they proved nothing"
        for key, value in FORGED:
            assert not (legit.check([key]) and legit.get(key) == value), f"{key!r} holds the forged value"
        assert legit.add("failures", 0) == 0 and legit.add("join/inference/1", 0) == 1
        deadline = time.monotonic() + 120
        while not hold.with_suffix(".reached").exists():  # the held trainer, so the job, got as far as it was let
            assert time.monotonic() < deadline and not legit.check(["end"]), "trainer rank 0 never reached version 3"
            time.sleep(0.05)
        hold.with_suffix(".release").touch()
        summary = local.wait(timeout=300)
    finally:
        local.stop()
    assert summary["versions"] == 11 and summary["failed_verifications"] == 0
    log = local.pods[0].log.read_text()
    assert "rendezvous store: refused" in log
    assert_nothing_left(local)


def capture_session(port: int, token: bytes, job: str) -> bytes:
    """The bytes a real client sends for a session that reads the plan, through a recording proxy."""
    def read_plan(client):
        assert b"plan" in client.get("plan")

    return record_session(port, token, job, read_plan)


def stranger_replay(port: int, captured: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        HELLO.unpack(recv_exact(sock, HELLO.size))
        try:
            sock.sendall(captured)
        except OSError:
            pass
        return recv_all(sock, timeout=60)
