"""One rank of a multi-process transfer test (test_transfer.py starts these as real processes).

Every rank builds the same deterministic tensors for each version; trainers send their share
through VersionSender over TCP, inference ranks receive through VersionReceiver and check every
byte against their own cast of the tensors and the digest against the trainers' checksums. The
test process hosts the TCPStore through which endpoints and results travel.
"""

import argparse
import datetime
import json
import sys

import torch
import torch.distributed as dist

from weightsync.flat import FlatLayout, byte_view, torch_dtype, views
from weightsync.plan import make_plan
from weightsync.transfer import VersionReceiver, VersionSender, version_digest
from weightsync.transport import TransferError, make_transport


def parse_shapes(text):
    return [tuple(int(d) for d in s.split("x")) for s in text.split(",")]


def layout_of(shapes_text, dtype):
    """The layout of a --shapes text ("7x3,1,...") in `dtype`, its tensors named t0, t1, ..."""
    return FlatLayout.from_shapes([(f"t{i}", s) for i, s in enumerate(parse_shapes(shapes_text))], dtype)


def version_tensors(shapes, version):
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(s, generator=g) * (1 + version) + version for s in shapes]


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
    p.add_argument("--transport", default="tcp", choices=["tcp", "nccl", "uccl"])
    p.add_argument("--device", default="cpu", help="where the tensors and the staging buffer live (cuda:N for GPUs)")
    p.add_argument("--pause-after-first-bucket", action="store_true", help="trainer: send one bucket, then hang")
    p.add_argument("--listen-only", action="store_true", help="inference: accept connections, never read")
    args = p.parse_args()

    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=datetime.timedelta(seconds=60))
    shapes = parse_shapes(args.shapes)
    layout = layout_of(args.shapes, args.dtype)
    plan = make_plan(layout, args.trainers, args.inferences, args.bucket)
    device = torch.device(args.device)
    options = {}
    if args.transport == "nccl":
        options = {"store": store, "trainers": args.trainers, "inferences": args.inferences, "device": device.index}
    elif args.transport == "uccl":
        options = {"gpu": device.index or 0}
    transport = make_transport(args.transport, token=args.token.encode(), timeout=args.timeout, **options)

    if args.role == "trainer":
        sender = transport.sender(args.rank)
        peers = {i: store.get(f"endpoint/{i}").decode() for i in range(args.inferences)}
        try:
            sender.connect(peers)
        except TransferError as e:
            store.set(f"error/trainer/{args.rank}", str(e))
            sys.exit(3)
        store.set(f"connected/trainer/{args.rank}", "1")
        if args.pause_after_first_bucket:
            first = plan.buckets_of(args.rank)[0]
            data = torch.empty(first.length, dtype=torch.uint8)
            from weightsync.flat import fill_range

            fill_range(layout, version_tensors(shapes, 1), first.offset, first.end, data)
            for peer in peers:
                sender.send(peer, 1, first.offset, data).result()
            store.set(f"paused/trainer/{args.rank}", "1")
            sys.stdin.read()  # until killed
            return
        mover = VersionSender(sender, plan, args.rank)
        for v in range(1, args.versions + 1):
            sent = mover.send(v, [t.to(device) for t in version_tensors(shapes, v)])
            store.set(f"sums/{v}/{args.rank}", json.dumps(sent.checksums))
        store.set(f"buffers/trainer/{args.rank}", str(mover.buffer_bytes))
        sender.close()
        return

    receiver = transport.receiver(args.rank)
    store.set(f"endpoint/{args.rank}", receiver.listen("127.0.0.1", 0))
    if args.listen_only:
        store.set(f"listening/inference/{args.rank}", "1")
        sys.stdin.read()  # until killed
        return
    staging = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
    incoming = VersionReceiver(receiver, plan, args.rank)
    store.set(f"ready/inference/{args.rank}", "1")  # knows the plan
    for v in range(1, args.versions + 1):
        try:
            got = incoming.receive(v, staging, args.timeout)
        except TransferError as e:
            store.set(f"result/{v}/{args.rank}", json.dumps({"error": str(e), "peer": e.peer,
                                                               "untouched": int(staging.count_nonzero()) == 0}))
            sys.exit(4)
        dtype = torch_dtype(args.dtype)
        want = [byte_view(t.to(dtype).contiguous()) for t in version_tensors(shapes, v)]
        same = all(torch.equal(byte_view(a.contiguous()), b) for a, b in zip(views(staging.cpu(), layout), want))
        sums = {}
        for t in plan.expected():
            sums.update({int(k): s for k, s in json.loads(store.get(f"sums/{v}/{t}")).items()})
        store.set(f"result/{v}/{args.rank}", json.dumps({"bit_exact": same, "digest": got.digest,
                                                           "trainers_digest": version_digest(sums)}))
    # a trainer the plan leaves idle may still be connecting: stay until every trainer has
    store.wait([f"connected/trainer/{t}" for t in range(args.trainers)])
    receiver.close()


if __name__ == "__main__":
    main()
