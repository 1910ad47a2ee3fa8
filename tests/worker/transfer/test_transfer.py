"""The transfer path end to end, with every rank a real process on loopback (transfer_peer.py):
M trainer ranks -> N inference ranks over TCP, several versions over the same connections,
received bytes equal to the trainers' cast bytes bit for bit, digests equal; a wrong token
refused with nothing applied; a peer killed mid-transfer named within seconds."""

import fcntl
import json
import os
import signal
import socket
import struct
import termios
import threading
import time
from dataclasses import replace

import pytest
import torch
from support.tiers import first_in_unit
from support.transfer import ODD, TOKEN, send_and_check
from support.transfer_peer import layout_of, plan_of
from support.waits import until

from weightsync.model.flat import FlatLayout
from weightsync.plan.segments import make_plan
from weightsync.transfer.receive import VersionReceiver
from weightsync.transfer.send import VersionSender
from weightsync.transport import TransferError, make_transport


@pytest.mark.parametrize("trainers,inferences,dtype,shapes,bucket", first_in_unit([
    (2, 3, "bfloat16", ODD, 4096),
    (1, 1, "float32", "64x64,10", 4096),
    (2, 3, "float32", ODD, 512),
    (4, 2, "float16", "3,5", 64),  # more trainers than 64-byte units: two of them idle
]))
def test_versions_arrive_bit_for_bit(ranks, store, trainers, inferences, dtype, shapes, bucket):
    send_and_check(ranks(trainers, inferences, shapes, dtype, bucket, 3), store, trainers, inferences, 3)
    if dtype != "float32":  # a cast: send buffers, at most depth x bucket
        for t in make_plan(layout_of(shapes, dtype), trainers, inferences, bucket).expected():
            assert 0 < int(store.get(f"buffers/trainer/{t}")) <= 2 * bucket
    else:  # no cast: sent straight from the tensors
        assert all(int(store.get(f"buffers/trainer/{t}")) == 0 for t in range(trainers))


@pytest.mark.parametrize("trainers,inferences,dtype,bucket", first_in_unit([
    (4, 1, "float16", 64),  # runs cut at the bucket's end, and ranks that hold no row of some tensors
    (3, 2, "float32", 512),  # no cast: every run sent straight from its shard
    (2, 3, "bfloat16", 4096),  # one bucket a rank: every run of every tensor in one frame
]))
def test_fsdp_shards_arrive_bit_for_bit_in_buckets_that_bundle_runs(ranks, store, trainers, inferences, dtype, bucket):
    """Each trainer rank holds only its FSDP2 rows of every tensor; its buckets bundle its runs of
    several tensors, and every inference rank scatters each frame over those runs."""
    versions = 2
    plan = plan_of(layout_of(ODD, dtype), trainers, inferences, bucket, fsdp=True)
    assert any(b.parts for b in plan.buckets) and all(b.length <= bucket for b in plan.buckets)
    send_and_check(ranks(trainers, inferences, ODD, dtype, bucket, versions), store, trainers, inferences, versions, "--fsdp")


def test_a_transport_that_lands_a_range_in_one_run_refuses_a_bundled_plan():
    layout = layout_of(ODD, "bfloat16")
    plan = plan_of(layout, 2, 1, 4096, fsdp=True)
    receiver = make_transport("tcp", token=TOKEN.encode(), timeout=5).receiver(0)
    # as the uccl receiver, whose writes land where the sender puts them
    receiver.capabilities = replace(receiver.capabilities, scatters=False)
    try:
        with pytest.raises(ValueError, match="lands every range in one run"):
            VersionReceiver(receiver, plan, 0).receive(1, torch.zeros(layout.total_bytes, dtype=torch.uint8), 5)
    finally:
        receiver.close()


def test_wrong_token_is_refused_and_nothing_is_applied(ranks, store):
    r = ranks(1, 1, ODD, "float32", 1024, 1)
    r.start("inference", 0, "--timeout", "3")
    intruder = r.start("trainer", 0, "--token", "some-other-jobs-token-xyz")
    codes = r.wait(60)
    assert codes[("trainer", 0)] == 3
    assert "inference rank 0: handshake" in store.get("error/trainer/0").decode()
    assert codes[("inference", 0)] == 4
    res = json.loads(store.get("result/1/0"))
    assert res["peer"] == "trainer rank 0" and "wrong token" in res["error"]
    assert res["untouched"], "bytes from a refused connection reached the staging buffer"
    assert intruder.returncode == 3


def kill_and_join(victim, thread) -> float:
    """SIGKILL the victim process and wait for the thread facing it to end; returns when the
    kill was sent."""
    killed = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive()
    return killed


def test_killed_trainer_mid_transfer_is_named_within_seconds(ranks, store):
    """Inference rank 0 is this process; trainer rank 1 sends one bucket and is killed."""
    shapes = "256x256,77"
    layout = layout_of(shapes, "float32")
    plan = make_plan(layout, 2, 1, 4096)
    receiver = make_transport("tcp", token=TOKEN.encode(), timeout=60).receiver(0)
    store.set("endpoint/0", receiver.listen("127.0.0.1", 0))
    r = ranks(2, 1, shapes, "float32", 4096, 1)
    r.start("trainer", 0)
    victim = r.start("trainer", 1, "--pause-after-first-bucket")
    staging = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    out = {}

    def receive():
        try:
            VersionReceiver(receiver, plan, 0).receive(1, staging, 60)
        except TransferError as e:
            out["error"], out["at"] = e, time.monotonic()
    thread = threading.Thread(target=receive)
    thread.start()
    store.wait(["paused/trainer/1"])
    first = plan.buckets_of(1)[0]  # the bucket lands, then the trainer hangs mid-version
    until("first bucket", lambda: staging[first.offset:first.end].any(), timeout=30, every=0.01)
    killed = kill_and_join(victim, thread)
    assert out["error"].peer == "trainer rank 1", out["error"]
    assert "connection lost during version 1" in str(out["error"])
    assert out["at"] - killed < 5
    receiver.close()
    r.wait(60)


def unsent_bytes(sock) -> int:
    buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return struct.unpack("i", buf)[0]


def test_killed_inference_mid_transfer_is_named_within_seconds(ranks, store):
    """Trainer rank 0 is this process; inference rank 0 accepts, never reads, and is killed."""
    r = ranks(1, 1, "4096x4096", "float32", 64 << 20, 1)
    victim = r.start("inference", 0, "--listen-only")
    store.wait(["listening/inference/0"])
    layout = FlatLayout.from_shapes([("w", (4096, 4096))], "bfloat16")  # a cast: 32 MiB through send buffers
    plan = make_plan(layout, 1, 1, 64 << 20)
    sender = make_transport("tcp", token=TOKEN.encode(), timeout=60).sender(0)
    sender.connect({0: store.get("endpoint/0").decode()})
    out = {}

    def send():
        try:
            VersionSender(sender, plan, 0).send(1, [torch.ones(4096, 4096)])
        except TransferError as e:
            out["error"], out["at"] = e, time.monotonic()
    thread = threading.Thread(target=send)
    thread.start()
    # mid-transfer: the kernel holds bytes the peer does not read
    until("send backed up", lambda: unsent_bytes(sender.conns[0].sock) >= (1 << 20), timeout=30, every=0.01)
    killed = kill_and_join(victim, thread)
    assert out["error"].peer == "inference rank 0", out["error"]
    assert out["at"] - killed < 5
    sender.close()
    r.wait(60)


def test_a_receiver_that_dies_mid_version_is_lost_and_the_others_get_all_of_it(ranks, store):
    """Trainer rank 0 is this process, sending to two inference ranks; inference rank 0 accepts,
    never reads, and is killed mid-version. With lose_peers the trainer names it as lost and
    inference rank 1 still receives the whole version, bit for bit, with the trainers' digest."""
    from support.transfer_peer import version_tensors

    shapes = "2048x2048"
    r = ranks(1, 2, shapes, "bfloat16", 4 << 20, 1)
    victim = r.start("inference", 0, "--listen-only")
    r.start("inference", 1)
    store.wait(["listening/inference/0", "endpoint/1"])
    plan = make_plan(layout_of(shapes, "bfloat16"), 1, 2, 4 << 20)
    sender = make_transport("tcp", token=TOKEN.encode(), timeout=60).sender(0)
    sender.connect({i: store.get(f"endpoint/{i}").decode() for i in range(2)})
    store.set("connected/trainer/0", "1")
    out = {}

    def send():
        out["sent"] = VersionSender(sender, plan, 0).send(1, version_tensors([(2048, 2048)], 1), lose_peers=True)
        store.set("sums/1/0", json.dumps(out["sent"].checksums))
    thread = threading.Thread(target=send)
    thread.start()
    until("send backed up", lambda: unsent_bytes(sender.conns[0].sock) >= (1 << 20), timeout=30, every=0.01)
    kill_and_join(victim, thread)
    sent = out["sent"]
    assert list(sent.lost) == [0] and "inference rank 0" in sent.lost[0]
    assert len(sent.checksums) == len(plan.buckets_of(0))  # every bucket's checksum, the lost peer's hasher's too
    store.wait(["result/1/1"])
    result = json.loads(store.get("result/1/1"))
    assert result["bit_exact"] and result["digest"] == result["trainers_digest"], result
    sender.close()
    assert r.procs[("inference", 1)].wait(60) == 0


def proc_status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {"threads": int(fields["Threads"]), "rss": int(fields["VmRSS"].split()[0]) * 1024}


def test_idle_connections_cost_no_thread_and_the_trainer_still_delivers(ranks, store):
    """200 idle connections to an inference rank's data port (a real process): its thread count
    stays where it was, its memory barely moves, every idle connection is closed (the excess at
    once, the rest after the handshake timeout), and the trainer (this process) connects and
    delivers a version while they are held."""
    from support.transfer_peer import parse_shapes, version_tensors

    from weightsync.transport import door

    shapes = ODD
    layout = layout_of(shapes, "float32")
    plan = make_plan(layout, 1, 1, 1024)
    r = ranks(1, 1, shapes, "float32", 1024, 1)
    inference = r.start("inference", 0)
    store.wait(["ready/inference/0"])
    host, port = store.get("endpoint/0").decode().rsplit(":", 1)
    before = proc_status(inference.pid)

    idle = []
    for _ in range(200):
        sock = socket.create_connection((host, int(port)), timeout=30)
        assert sock.recv(40, socket.MSG_WAITALL)[:4] == b"WSHC"  # accepted and challenged
        idle.append(sock)
    during = proc_status(inference.pid)

    def still_open(sock) -> bool:
        sock.setblocking(False)
        try:
            return sock.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            return True
        except ConnectionResetError:
            return False
    held = sum(still_open(s) for s in idle)
    print(f"inference rank process: {before['threads']} threads, {before['rss'] >> 20} MiB RSS before; "
          f"{during['threads']} threads, {during['rss'] >> 20} MiB RSS with 200 idle connections opened, "
          f"{held} of them still pending")
    assert during["threads"] <= before["threads"] + 4, (before, during)
    assert during["rss"] - before["rss"] < 32 << 20, (before, during)
    assert held <= 1 + door.PENDING_HEADROOM  # the plan has one trainer rank

    # the trainer connects and delivers while the idle ones hold the door's every slot
    sender = make_transport("tcp", token=TOKEN.encode(), timeout=60).sender(0)
    sender.connect({0: f"{host}:{port}"})
    store.set("connected/trainer/0", "1")
    sent = VersionSender(sender, plan, 0).send(1, version_tensors(parse_shapes(shapes), 1))
    store.set("sums/1/0", json.dumps(sent.checksums))
    codes = r.wait(120)
    assert codes[("inference", 0)] == 0, r.stderr()
    res = json.loads(store.get("result/1/0"))
    assert res["bit_exact"] and res["digest"] == res["trainers_digest"]

    for sock in idle:  # every idle connection was closed by the receiver
        sock.settimeout(60)
        try:
            assert sock.recv(1 << 10) == b""
        except ConnectionResetError:
            pass
        sock.close()
    sender.close()
    log = r.stderr()[("inference", 0)]
    lines = [line for line in log.splitlines() if "refused connection from 127.0.0.1:" in line]
    print(f"{len(lines)} log lines about the 200 refused connections")
    assert 1 <= len(lines) <= 10, log
