"""Versions over slices end to end, every rank a real process on loopback (slice_peer.py): trainer
ranks holding uneven dim-0 shards (FSDP2's split, and HSDP replicas of it) send each inference
rank only the boxes it needs - column-, row- and packed tensor-parallel slices, or random boxes of
every tensor - packed from their rows and cast on the way (a quantized version's int8 weights and
float32 scales each in their own dtype, the scales following their weights' slices); each inference
rank's buffer equals torch slicing of the full tensors bit for bit, and its digest the one the
trainers' checksums give. One process per rank runs several cases one after the other (a process
start costs more than a small case's transfer)."""

import datetime
import json
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from support import SUPPORT, slice_peer
from support.tiers import first_in_unit

from weightsync.model.flat import FlatLayout
from weightsync.plan.sliced_plan import LocalLayout, SlicedPlan, needs_everything

PEER = SUPPORT / "slice_peer.py"


@pytest.fixture
def store():
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))


class Args:
    def __init__(self, **kw):
        self.dtype, self.shard, self.replicas, self.tp, self.random_needs, self.inferences, self.bucket = \
            "float32", 1, 1, "2,1", None, 0, 256
        self.quantize = None
        self.__dict__.update(kw)

    def flags(self):
        out = ["--dtype", self.dtype, "--shard", str(self.shard), "--replicas", str(self.replicas), "--tp", self.tp,
               "--bucket", str(self.bucket), *(["--quantize", self.quantize] if self.quantize else [])]
        if self.random_needs is not None:
            out += ["--random-needs", str(self.random_needs), "--inferences", str(self.inferences)]
        return out


def run_ranks(store, cases: list[Args], versions=2, timeout=180) -> list[SlicedPlan]:
    """Every case, one after the other, in one process per rank (as many as the largest case has),
    `timeout` seconds a case; each case's plan."""
    timeout *= len(cases)
    plans = [slice_peer.make(args)[1] for args in cases]
    common = ["--store-port", str(store.port), "--versions", str(versions),
              "--cases", json.dumps([args.flags() for args in cases])]
    procs = {}
    try:
        for i in range(max(plan.inferences for plan in plans)):
            procs[("inference", i)] = subprocess.Popen([sys.executable, str(PEER), "--role", "inference", "--rank", str(i),
                                                        *common],
                                                       stderr=subprocess.PIPE, text=True)
        for t in range(max(plan.trainers for plan in plans)):
            procs[("trainer", t)] = subprocess.Popen([sys.executable, str(PEER), "--role", "trainer", "--rank", str(t), *common],
                                                     stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        for key, p in procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{key} did not finish within {timeout}s")
        errors = {k: p.stderr.read() for k, p in procs.items() if p.returncode}
        assert not errors, errors
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stderr.close()
    return plans


# the first case alone (in `make unit` too), the others in one set of rank processes
@pytest.mark.parametrize("cases", first_in_unit([
    [Args(dtype="float32", shard=4)],  # FSDP2 over 4, uneven rows; a TP2 and a TP1 replica
    [Args(dtype="bfloat16", shard=3, replicas=2, bucket=128),  # HSDP: replicas share the sending
     Args(dtype="float16", shard=2, tp="2,2", bucket=4096),
     Args(dtype="bfloat16", shard=3, random_needs=7, inferences=3, bucket=192),  # random boxes: strided in every dim
     Args(dtype="bfloat16", shard=2, quantize="int8", bucket=192)],  # int8 weights and float32 scales beside bfloat16
], ids=["fsdp4-tp2+tp1-f32", "hsdp3x2-tp2+tp1-bf16+fsdp2-2xtp2-f16+fsdp3-random-boxes-bf16+fsdp2-tp2+tp1-int8-with-scales"]))
def test_slices_arrive_bit_for_bit(store, cases):
    versions = 2
    plans = run_ranks(store, cases, versions)
    for n, (args, plan) in enumerate(zip(cases, plans)):
        case = " ".join(args.flags())
        for v in range(1, versions + 1):
            sent = sum(int(store.get(f"case{n}/bytes/{v}/{t}")) for t in range(plan.trainers))
            assert sent == sum(plan.sent_bytes(t) for t in range(plan.trainers)), case
            for r in range(plan.inferences):
                res = json.loads(store.get(f"case{n}/result/{v}/{r}"))
                assert res["bad"] == [], \
                    f"{case}: version {v}, inference rank {r}: slots differ from torch slicing: {res['bad']}"
                assert res["digest"] == res["trainers_digest"], case
                assert res["bytes"] == plan.bytes_for(r), case


def test_tp_ranks_receive_only_their_slices():
    """A TP2 rank's buffer holds about half the version (the replicated norms and biases whole);
    a TP1 rank's local layout is exactly the flat layout."""
    _, plan = slice_peer.make(Args(shard=4, dtype="bfloat16"))
    whole = plan.layout.total_bytes
    assert plan.bytes_for(2) == whole
    assert [(s.name, s.offset, s.nbytes) for s in plan.local_of(2).slots] == \
        [(s.name, s.offset, s.nbytes) for s in plan.layout.slots]
    assert plan.bytes_for(0) < 0.6 * whole and plan.bytes_for(1) < 0.6 * whole


def test_every_needed_byte_comes_once():
    """The buckets for each receiver tile exactly its slots (no byte twice, none missing)."""
    for args in (Args(shard=4, dtype="bfloat16"), Args(shard=3, random_needs=3, inferences=4, bucket=64)):
        _, plan = slice_peer.make(args)
        for r in range(plan.inferences):
            covered = bytearray(plan.bytes_for(r))
            for t, ranges in plan.expected_for(r).items():
                for offset, length in ranges:
                    for b in [b for b in plan.buckets_of(t) if b.receiver == r and b.offset == offset]:
                        for part in b.parts:
                            for k in range(offset + part.at, offset + part.at + part.nbytes):
                                covered[k] += 1
            want = bytearray(plan.bytes_for(r))
            for s in plan.local_of(r).slots:
                want[s.offset:s.offset + s.nbytes] = b"\x01" * s.nbytes
            assert covered == want, f"receiver {r}"


def test_plan_survives_json():
    _, plan = slice_peer.make(Args(shard=3, replicas=2, dtype="bfloat16"))
    again = SlicedPlan.from_json(plan.to_json())
    assert all(again.buckets_of(t) == plan.buckets_of(t) for t in range(plan.trainers))
    assert again.local == plan.local


def test_local_layout_of_a_whole_model_is_flat():
    layout = FlatLayout.from_shapes([("a", (3, 5)), ("b", (7,)), ("c", (2, 3, 4))], "float16")
    local = LocalLayout.of(layout, needs_everything(layout, 0))
    assert local.total_bytes == layout.total_bytes
    assert [s.offset for s in local.slots] == [s.offset for s in layout.slots]
