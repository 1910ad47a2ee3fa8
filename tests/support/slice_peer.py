"""One rank of a multi-process transfer over slices (test_slice_transfer.py starts these as real processes).

Every rank derives the same plan from the same arguments: the trainers hold dim-0 shards of the
tensors (torch.chunk's split over --shard ranks, --replicas copies of that), the inference ranks
are replicas of the TP degrees in --tp (each rank needing what tpslices gives it under a TP plan
with column-, row- and packed styles), or with --random-needs each a random box of every tensor.
With --quantize int8 the version is quantized (model/quant.py): the projections' weights int8, each
followed by its float32 per-row scales, which every rank holds and needs as its weight's rows.
Trainers send from their local rows only (a copy of those rows, nothing else of the tensor) through
VersionSender over TCP; inference ranks receive through VersionReceiver into a buffer of their local
layout and check every slot against torch slicing of the full tensors cast to the dtype, bit for
bit, and their digest against the one computed from the trainers' reported checksums.

One process runs a rank of several such cases, one after the other (--cases): each process start
imports torch, which costs more than a small case's transfer.
"""

import argparse
import datetime
import json
import random
import sys

import torch
import torch.distributed as dist

from weightsync.model.flat import FlatLayout, byte_view, torch_dtype
from weightsync.model.quant import format_of, quantize_layout, quantized_tensors
from weightsync.plan.boxes import Box, RankSlices, Slice, Slicing, chunk_bounds, join
from weightsync.plan.holders import Holdings
from weightsync.plan.sliced_plan import SlicedPlan, global_tensors
from weightsync.plan.tp_needs import tp_needs
from weightsync.transfer.receive import VersionReceiver
from weightsync.transfer.send import VersionSender
from weightsync.transfer.sums import version_digest
from weightsync.transport import TransferError, make_transport

# A small model's tensors under a TP plan of every style that shards: uneven sizes throughout
TENSORS = [
    ("embed.weight", (37, 12)),
    ("layers.0.q_proj.weight", (24, 12)),
    ("layers.0.q_proj.bias", (24,)),
    ("layers.0.o_proj.weight", (12, 24)),
    ("layers.0.o_proj.bias", (12,)),
    ("layers.0.gate_up_proj.weight", (20, 12)),
    ("layers.0.down_proj.weight", (13, 20)),
    ("layers.0.experts", (3, 11, 12)),
    ("layers.0.row.weight", (7, 11)),
    ("norm.weight", (12,)),
    ("lm_head.weight", (37, 12)),
]
TP_PLAN = {
    "embed": "embedding_rowwise",
    "layers.*.q_proj": "colwise",
    "layers.*.o_proj": "rowwise",
    "layers.*.gate_up_proj": "packed_colwise",
    "layers.*.down_proj": "packed_rowwise",
    "layers.*.experts": "colwise",
    "layers.*.row": "rowwise",
    "lm_head": "colwise",
}


QUANTIZED = ["layers.0.q_proj.weight", "layers.0.o_proj.weight", "layers.0.gate_up_proj.weight",
             "layers.0.down_proj.weight", "layers.0.row.weight"]


def full_tensors(version, layout=None, fmt=None):
    """The version's whole tensors (of the quantized `layout`, with `fmt`: quantized, with scales)."""
    g = torch.Generator().manual_seed(4321)
    full = [torch.randn(shape, generator=g) * (1 + version) + version for _, shape in TENSORS]
    return full if fmt is None else quantized_tensors(layout, fmt, full)


def random_needs(layout, receivers, seed):
    """Every receiver needs one random box of every tensor (strided in every way a box can be)."""
    rng = random.Random(seed)
    out = []
    for r in range(receivers):
        slices = []
        for s in layout.slots:
            start, stop = [], []
            for n in s.shape:
                a = rng.randrange(n)
                start.append(a)
                stop.append(rng.randrange(a + 1, n + 1))
            slices.append(Slice(s.name, Box(tuple(start), tuple(stop))))
        out.append(RankSlices(r, tuple(slices)))
    return out


def make(args):
    layout = FlatLayout.from_shapes(TENSORS, args.dtype)
    fmt = format_of(args.quantize)
    if fmt is not None:
        layout = quantize_layout(layout, QUANTIZED, fmt)
    tensors = global_tensors(layout)
    # rank = replica * shard + shard index, as holders.sharded numbers them (a weight's scales: its rows)
    holdings = tuple(Holdings(tuple(chunk_bounds(s.shape[0], args.shard)[t % args.shard] for s in layout.slots))
                     for t in range(args.shard * args.replicas))
    if args.random_needs is not None:
        needs = random_needs(layout, args.inferences, args.random_needs)
    else:
        parts: list[Slicing] = [tp_needs(tensors, TP_PLAN, int(tp), fmt=fmt) for tp in args.tp.split(",")]
        slicing = join(*parts)
        needs = [slicing.of_rank(r) for r in range(slicing.world)]
    return layout, SlicedPlan(layout, holdings, tuple(needs), args.bucket)


def parser() -> argparse.ArgumentParser:
    """One case's arguments (the transfer's shape, dtype and needs)."""
    p = argparse.ArgumentParser()
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--tp", default="2,1", help="the TP degree of each inference replica")
    p.add_argument("--random-needs", type=int, default=None, help="seed: every receiver needs random boxes")
    p.add_argument("--inferences", type=int, default=0, help="receivers, with --random-needs")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantize", default=None, help="int8: the projections' weights quantized, with their scales")
    p.add_argument("--bucket", type=int, default=256)
    return p


def main():
    """Every case of --cases (a JSON list of each case's flags), one after the other, each under its
    own keys in the store, in which this rank takes part (a case of fewer ranks leaves it out): one
    process per rank for several cases, not one per rank per case."""
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["trainer", "inference"], required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--cases", required=True, help="a JSON list: each case's flags, as parser() reads them")
    p.add_argument("--versions", type=int, default=2)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--token", default="test-job-token-0123456789")
    p.add_argument("--timeout", type=float, default=60)
    args = p.parse_args()
    base = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=datetime.timedelta(seconds=60))
    for n, flags in enumerate(json.loads(args.cases)):
        case = parser().parse_args(flags)
        layout, plan = make(case)
        if args.rank < (plan.trainers if args.role == "trainer" else plan.inferences):
            run_case(args, case, layout, plan, dist.PrefixStore(f"case{n}", base))  # keys case{n}/...


def run_case(args, case, layout, plan, store):
    """This rank's part of one case: its rows sent, or its slices received and checked."""
    transport = make_transport("tcp", token=args.token.encode(), timeout=args.timeout)
    fmt = format_of(case.quantize)
    if args.role == "trainer":
        sender = transport.sender(args.rank)
        sender.connect({i: store.get(f"endpoint/{i}").decode() for i in range(plan.inferences)})
        store.set(f"connected/trainer/{args.rank}", "1")
        mover = VersionSender(sender, plan, args.rank)
        rows = plan.holdings[args.rank].rows
        if fmt is not None:  # the rows of the unquantized tensors, which this rank quantizes (row by row)
            held = dict(zip(layout.names, rows))
            rows = [held[name] for name, _ in TENSORS]
        for v in range(1, args.versions + 1):
            # this rank's rows only, as FSDP2 keeps them: a separate tensor, nothing else of the full one
            local = [t[a:b].clone() for t, (a, b) in zip(full_tensors(v), rows)]
            if fmt is not None:
                local = quantized_tensors(layout, fmt, local)
            sent = mover.send(v, local)
            store.set(f"sums/{v}/{args.rank}", json.dumps({str(r): {str(o): c for o, c in by.items()}
                                                           for r, by in sent.receiver_checksums.items()}))
            store.set(f"bytes/{v}/{args.rank}", str(sent.bytes))
        sender.close()
        return

    receiver = transport.receiver(args.rank)
    store.set(f"endpoint/{args.rank}", receiver.listen("127.0.0.1", 0))
    local_layout = plan.local_of(args.rank)
    staging = torch.zeros(plan.bytes_for(args.rank), dtype=torch.uint8)
    incoming = VersionReceiver(receiver, plan, args.rank)
    for v in range(1, args.versions + 1):
        try:
            got = incoming.receive(v, staging, args.timeout)
        except TransferError as e:
            store.set(f"result/{v}/{args.rank}", json.dumps({"error": str(e)}))
            sys.exit(4)
        full = full_tensors(v, layout, fmt)
        bad = []
        for s in local_layout.slots:
            box = tuple(slice(a, b) for a, b in zip(s.box.start, s.box.stop))
            want = full[s.tensor].to(torch_dtype(s.dtype))[box].contiguous()
            if not torch.equal(byte_view(want), staging[s.offset:s.offset + s.nbytes]):
                bad.append(f"{s.name}{s.box}")
        sums = {}
        for t in range(plan.trainers):
            store.wait([f"sums/{v}/{t}"])
            sums.update({int(o): c for o, c in json.loads(store.get(f"sums/{v}/{t}")).get(str(args.rank), {}).items()})
        store.set(f"result/{v}/{args.rank}", json.dumps({"bad": bad, "digest": got.digest,
                                                          "trainers_digest": version_digest(sums),
                                                          "bytes": got.bytes, "slots": len(local_layout.slots)}))
    store.wait([f"connected/trainer/{t}" for t in range(plan.trainers)])
    receiver.close()


if __name__ == "__main__":
    main()
