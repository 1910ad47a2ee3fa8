"""One rank of a multi-process transfer test (test_transfer.py starts these as real processes).

Every rank builds the same deterministic tensors for each version; trainers send their share
through VersionSender over TCP, inference ranks receive through VersionReceiver and check every
byte against their own cast of the tensors and the digest against the trainers' checksums. The
test process hosts the TCPStore through which endpoints and results travel.

With --fsdp, trainer rank t holds only its FSDP2 shard (torch.chunk's dim-0 rows) of every tensor
and sends from it, in the plan by holder whose buckets bundle a rank's runs of several tensors.

With --delta, versions after the first change only a fraction (--change) of their elements, the
trainers keep what they sent and send patches to the inference ranks that the test names in the
store key bases/<v> ({inference rank: the version it holds}, the controller's word in a job), and
inference ranks keep two buffers: the version they hold, and the staging buffer.
"""

import argparse
import datetime
import faulthandler
import json
import signal
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

from weightsync.model.flat import FlatLayout, byte_view, torch_dtype, views
from weightsync.plan.holders import Holdings, plan_by_holder
from weightsync.plan.segments import make_plan
from weightsync.runtime.faults import tamper_hook
from weightsync.transfer.receive import VersionReceiver
from weightsync.transfer.send import VersionSender
from weightsync.transfer.sums import version_digest
from weightsync.transport import RankContext, TransferError, make_transport, options_for


def parse_shapes(text):
    return [tuple(int(d) for d in s.split("x")) for s in text.split(",")]


def layout_of(shapes_text, dtype):
    """The layout of a --shapes text ("7x3,1,...") in `dtype`, its tensors named t0, t1, ..."""
    return FlatLayout.from_shapes([(f"t{i}", s) for i, s in enumerate(parse_shapes(shapes_text))], dtype)


def plan_of(layout, trainers, inferences, bucket, fsdp=False):
    """The plan of the test's ranks: by contiguous share, or (fsdp) by holder, runs bundled."""
    if not fsdp:
        return make_plan(layout, trainers, inferences, bucket)
    holdings = {t: Holdings.fsdp(layout, trainers, t) for t in range(trainers)}
    return plan_by_holder(layout, holdings, inferences, bucket, bundle=True)


def version_tensors(shapes, version, change=0.0):
    """The tensors of `version`: all different in every version, or with `change`, version 0's
    with that fraction of the elements moved once more by every later version."""
    g = torch.Generator().manual_seed(1234)
    if not change:
        return [torch.randn(s, generator=g) * (1 + version) + version for s in shapes]
    tensors = [torch.randn(s, generator=g) for s in shapes]
    for step in range(1, version + 1):
        g = torch.Generator().manual_seed(5678 + step)
        for t in tensors:
            t += (torch.rand(t.shape, generator=g) < change) * torch.randn(t.shape, generator=g)
    return tensors


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["trainer", "inference"], required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--trainers", type=int, required=True)
    p.add_argument("--inferences", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--shapes", required=True)
    p.add_argument("--bucket", type=int, default=4096)
    p.add_argument("--versions", type=int, default=2)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--token", default="test-job-token-0123456789")
    p.add_argument("--timeout", type=float, default=30)
    p.add_argument("--transport", default="tcp", choices=["tcp", "nccl", "uccl", "ipc"])
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"],
                   help="the nccl transport's backend (gloo: the same code on host tensors)")
    p.add_argument("--device", default="cpu", help="where the tensors and the staging buffer live (cuda:N for GPUs)")
    p.add_argument("--pause-after-first-bucket", action="store_true", help="trainer: send one bucket, then hang")
    p.add_argument("--listen-only", action="store_true", help="inference: accept connections, never read")
    p.add_argument("--fsdp", action="store_true", help="trainers hold and send only their FSDP2 shards")
    p.add_argument("--delta", action="store_true", help="delta versions, with the bases the test puts in the store")
    p.add_argument("--change", type=float, default=0.0, help="the fraction of elements each version changes")
    p.add_argument("--spoil-base", action="store_true",
                   help="inference: change a byte of every bucket of the version it holds before each later version")
    p.add_argument("--host", default="127.0.0.1", help="the address of this rank (inference: where it listens)")
    p.add_argument("--store-host", default="127.0.0.1")
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that finds this rank stuck asks where

    store = dist.TCPStore(args.store_host, args.store_port, is_master=False, timeout=datetime.timedelta(seconds=60))
    shapes = parse_shapes(args.shapes)
    layout = layout_of(args.shapes, args.dtype)
    plan = plan_of(layout, args.trainers, args.inferences, args.bucket, args.fsdp)
    device = torch.device(args.device)
    options = options_for(args.transport, RankContext(args.trainers, args.inferences, device, lambda: store))
    if args.transport == "nccl":  # the test's choice of backend: gloo runs it on host tensors
        options = replace(options, backend=args.backend)
    transport = make_transport(args.transport, token=args.token.encode(), timeout=args.timeout, options=options)
    try:
        end = transport.sender(args.rank) if args.role == "trainer" else transport.receiver(args.rank)
    except TransferError as e:  # a group that never formed
        store.set(f"error/{args.role}/{args.rank}", str(e))
        sys.exit(3)

    if args.role == "trainer":
        sender = end
        peers = {i: store.get(f"endpoint/{i}").decode() for i in range(args.inferences)}
        try:
            sender.connect(peers)
        except TransferError as e:
            store.set(f"error/trainer/{args.rank}", str(e))
            sys.exit(3)
        store.set(f"connected/trainer/{args.rank}", "1")
        if args.pause_after_first_bucket:
            first = plan.buckets_of(args.rank)[0]
            data = torch.empty(first.length, dtype=torch.uint8, device=device)
            from weightsync.model.flat import fill_range

            fill_range(layout, version_tensors(shapes, 1, args.change), first.offset, first.end, data)
            for peer in peers:
                sender.send(peer, 1, first.offset, data).result()
            store.set(f"paused/trainer/{args.rank}", "1")
            sys.stdin.read()  # until killed
            return
        held = Holdings.fsdp(layout, args.trainers, args.rank) if args.fsdp else Holdings.whole(layout)
        mover = VersionSender(sender, plan, args.rank, delta=args.delta, starts=held.starts(layout) if args.fsdp else None,
                              tamper=tamper_hook())
        for v in range(1, args.versions + 1):
            bases = None
            if args.delta:
                store.wait([f"bases/{v}"])
                bases = {int(r): b for r, b in json.loads(store.get(f"bases/{v}")).items()}
            tensors = [t[a:b].clone() for t, (a, b) in zip(version_tensors(shapes, v, args.change), held.rows)]
            sent = mover.send(v, [t.to(device) for t in tensors], bases=bases)
            store.set(f"sums/{v}/{args.rank}", json.dumps(sent.checksums))
            store.set(f"sent/{v}/{args.rank}", json.dumps({"wire_bytes": sent.wire_bytes, "bytes": sent.bytes,
                                                           "patched_peers": sent.patched_peers, "changed": sent.changed,
                                                           "compared": sent.compared}))
        store.set(f"buffers/trainer/{args.rank}", str(mover.buffer_bytes))
        if args.transport == "nccl":
            # a send ends once NCCL has handed its bytes to the network, before the peer has them,
            # and closing aborts the group: stay until every inference rank (each a peer process
            # here) has the last version, as the roles do (a round ends before a trainer leaves)
            store.wait([f"result/{args.versions}/{i}" for i in range(args.inferences)])
        sender.close()
        return

    receiver = end
    store.set(f"endpoint/{args.rank}", receiver.listen(args.host, 0))
    if args.listen_only:
        store.set(f"listening/inference/{args.rank}", "1")
        sys.stdin.read()  # until killed
        return
    buffers = [torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    held = None  # the version in buffers[0] (delta versions)
    incoming = VersionReceiver(receiver, plan, args.rank)
    store.set(f"ready/inference/{args.rank}", "1")  # knows the plan
    for v in range(1, args.versions + 1):
        staging, base = buffers[1], None
        if args.delta:
            store.wait([f"bases/{v}"])
            named = json.loads(store.get(f"bases/{v}")).get(str(args.rank))
            if named is not None and named == held:
                if args.spoil_base:
                    for b in plan.buckets:
                        buffers[0][b.offset] ^= 1
                base = (held, buffers[0])
        try:
            got = incoming.receive(v, staging, args.timeout, base)
        except TransferError as e:
            store.set(f"result/{v}/{args.rank}", json.dumps({"error": str(e), "peer": e.peer,
                                                               "untouched": int(staging.count_nonzero()) == 0}))
            sys.exit(4)
        dtype = torch_dtype(args.dtype)
        want = [byte_view(t.to(dtype).contiguous()) for t in version_tensors(shapes, v, args.change)]
        same = all(torch.equal(byte_view(a.contiguous()), b) for a, b in zip(views(staging.cpu(), layout), want))
        sums = {}
        for t in plan.expected():
            sums.update({int(k): s for k, s in json.loads(store.get(f"sums/{v}/{t}")).items()})
        store.set(f"result/{v}/{args.rank}", json.dumps({"bit_exact": same, "digest": got.digest,
                                                           "trainers_digest": version_digest(sums),
                                                           "patched": got.patched, "refused": got.refused}))
        buffers.reverse()  # the staging buffer now holds the version this rank runs on
        held = v
    # a trainer the plan leaves idle may still be connecting: stay until every trainer has
    store.wait([f"connected/trainer/{t}" for t in range(args.trainers)])
    receiver.close()


if __name__ == "__main__":
    main()
