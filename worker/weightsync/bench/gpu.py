"""`weightsync bench --gpu`: the GPU data plane against its baselines, each ratio from one run.

Three measurements, each against a baseline taken in the same run, between the same processes:
  nccl      the nccl transport's planned M-to-N transfer (VersionSender/VersionReceiver, the
            code the roles run) against torch.distributed broadcast of the same bytes from
            trainer rank 0 to the inference ranks (what vLLM's nccl weight-transfer backend and
            most RL frameworks do);
  ipc       the colocated transport (CUDA IPC) moving a version from a trainer to an inference
            process against a device-to-device copy of the same bytes in one process (its ceiling);
  cast      the GPU cast float32 -> bfloat16 plus the ws64 checksum in one pass (the packer's
            fill_checksummed, as a trainer rank fills a send buffer) against a plain device copy
            of the bytes it writes;
  ws64      ws64 of the bytes alone (the receivers' verify, one read of them) against the same
            device copy.
--shape takes several shapes (2x2,1x1): each nccl line is against its broadcast, and a last line
puts the first shape's time per delivered byte against the second's.
Each line prints the median seconds, the GB/s and the ratio to its baseline. On one GPU every
process shares it (NCCL then runs over its socket transport, each process naming a host of its
own): the ratios say what the code costs, not what a cluster's links give. --backend gloo runs
the nccl measurement on host tensors, where there is no GPU (the others need one).
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

from weightsync.model.flat import FlatLayout
from weightsync.plan.segments import Bucket, make_plan
from weightsync.transfer.pack import RangePacker
from weightsync.transfer.receive import VersionReceiver
from weightsync.transfer.send import VersionSender
from weightsync.transport import make_transport
from weightsync.transport.checksum import device_checksum
from weightsync.transport.nccl import NcclOptions, shared_gpu_env

TOKEN = b"weightsync-bench-gpu-token"


def _barrier(store, name: str, world: int) -> None:
    store.add(name, 1)
    deadline = time.monotonic() + 300
    while int(store.add(name, 0)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: not every rank arrived")
        time.sleep(0.0005)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _p2p_rank(role: str, rank: int, trainers: int, inferences: int, port: int, nbytes: int, reps: int,
              backend: str, results) -> None:
    """One rank of the nccl measurement: `reps` versions over the transport, then `reps`
    broadcasts of the same bytes from trainer rank 0."""
    import torch.distributed as dist

    world = trainers + inferences
    me = rank if role == "trainer" else trainers + rank
    if backend == "nccl":
        os.environ.update(shared_gpu_env(f"bench-{me}"))
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    layout = FlatLayout.from_shapes([("w", (nbytes // 2,))], "bfloat16")
    plan = make_plan(layout, trainers, inferences, 64 << 20)
    options = NcclOptions(trainers, inferences, store=store, device=0 if backend == "nccl" else None, backend=backend)
    transport = make_transport("nccl", token=TOKEN, timeout=120, options=options)
    if role == "trainer":
        end = transport.sender(rank)
        end.connect({i: store.get(f"endpoint/{i}").decode() for i in range(inferences)})
        mover = VersionSender(end, plan, rank)
        params = [torch.randn(nbytes // 2, device=device).to(torch.bfloat16)]
    else:
        end = transport.receiver(rank)
        store.set(f"endpoint/{rank}", end.listen("127.0.0.1", 0))
        incoming = VersionReceiver(end, plan, rank)
        staging = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    times = []
    for v in range(reps + 1):  # the first version sets everything up and is not counted
        _barrier(store, f"p2p/{v}", world)
        start = time.perf_counter()
        if role == "trainer":
            mover.send(v, params)
        else:
            incoming.receive(v, staging, 120)
            _sync(device)
        times.append(time.perf_counter() - start)
    # the baseline: trainer rank 0 broadcasts the whole version to the inference ranks
    members = [0] + [trainers + i for i in range(inferences)]
    if me in members:
        prefixed = dist.PrefixStore("bench-broadcast", store)
        if backend == "nccl":
            group = dist.ProcessGroupNCCL(prefixed, members.index(me), len(members))
        else:
            group = dist.ProcessGroupGloo(prefixed, members.index(me), len(members), datetime.timedelta(seconds=120))
        data = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        options = dist.BroadcastOptions()
        options.rootRank = 0
    baseline = []
    for v in range(reps + 1):
        _barrier(store, f"broadcast/{v}", world)
        start = time.perf_counter()
        if me in members:
            group.broadcast([data], options).wait()
            _sync(device)
        baseline.append(time.perf_counter() - start)
    if role == "inference":
        results.put((rank, times[1:], baseline[1:]))
    _barrier(store, "done", world)
    end.close()


def _gather(procs, results, count: int, what: str, timeout: float = 600) -> list:
    """Start `procs` and take `count` results from them; a process that exits before its result
    is in, or a measurement past `timeout`, ends the bench naming `what`, instead of a wait for a
    result that will never come."""
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + timeout
    try:
        while len(got) < count:
            try:
                got.append(results.get(timeout=1))
                continue
            except queue.Empty:
                pass
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a process of {what} exited with {failed[0]} (its error is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} gave no result within {timeout:.0f}s")
        for p in procs:
            p.join(120)
            if p.exitcode != 0:
                raise RuntimeError(f"a process of {what} exited with {p.exitcode}")
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def bench_nccl(trainers: int, inferences: int, nbytes: int, reps: int, backend: str) -> tuple[float, float]:
    """(weightsync's seconds per version, broadcast's), each the median over the slowest
    inference rank of each repetition."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_p2p_rank, args=(role, r, trainers, inferences, store.port, nbytes, reps, backend, results))
             for role, count in (("inference", inferences), ("trainer", trainers)) for r in range(count)]
    got = _gather(procs, results, inferences, "the nccl measurement")
    ours = [max(g[1][i] for g in got) for i in range(reps)]
    theirs = [max(g[2][i] for g in got) for i in range(reps)]
    return statistics.median(ours), statistics.median(theirs)


def _ipc_rank(role: str, port: int, nbytes: int, reps: int, results) -> None:
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    layout = FlatLayout.from_shapes([("w", (nbytes // 2,))], "bfloat16")
    plan = make_plan(layout, 1, 1, 64 << 20)
    transport = make_transport("ipc", token=TOKEN, timeout=120)
    times = []
    if role == "trainer":
        end = transport.sender(0)
        end.connect({0: store.get("endpoint/0").decode()})
        mover = VersionSender(end, plan, 0)
        params = [torch.randn(nbytes // 2, device=device).to(torch.bfloat16)]
    else:
        end = transport.receiver(0)
        store.set("endpoint/0", end.listen("127.0.0.1", 0))
        incoming = VersionReceiver(end, plan, 0)
        staging = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    for v in range(reps + 1):
        _barrier(store, f"ipc/{v}", 2)
        start = time.perf_counter()
        if role == "trainer":
            mover.send(v, params)
        else:
            incoming.receive(v, staging, 120)
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    if role == "inference":
        results.put(times[1:])
    _barrier(store, "done", 2)
    end.close()


def bench_ipc(nbytes: int, reps: int) -> tuple[float, float]:
    """(the ipc transport's seconds per version, a device-to-device copy's)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_ipc_rank, args=(role, store.port, nbytes, reps, results)) for role in ("inference", "trainer")]
    ours, = _gather(procs, results, 1, "the ipc measurement")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return statistics.median(ours), _timed(lambda: dst.copy_(src), reps)


def _timed(work, reps: int) -> float:
    work()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        work()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_cast(nbytes: int, reps: int) -> tuple[float, float]:
    """(the GPU cast float32 -> bfloat16 plus ws64 of `nbytes` output bytes in one pass, a
    device copy of them)."""
    layout = FlatLayout.from_shapes([("w", (nbytes // 2,))], "bfloat16")
    packer = RangePacker(layout, [torch.randn(nbytes // 2, device="cuda")])
    bucket = Bucket(0, 0, 0, layout.total_bytes)
    dst = torch.empty(layout.total_bytes, dtype=torch.uint8, device="cuda")
    plain = torch.empty_like(dst)
    return _timed(lambda: packer.fill_checksummed(bucket, dst), reps), _timed(lambda: plain.copy_(dst), reps)


def bench_ws64(nbytes: int, reps: int) -> tuple[float, float]:
    """(ws64 of `nbytes` bytes on the GPU, a device copy of them)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _timed(lambda: device_checksum(src), reps), _timed(lambda: dst.copy_(src), reps)


def line(name: str, nbytes: int, ours: float, baseline: float, against: str) -> str:
    return (f"{name:6s} {ours * 1e3:9.2f} ms  {nbytes / ours / 1e9:7.2f} GB/s   {against}: {baseline * 1e3:9.2f} ms  "
            f"{nbytes / baseline / 1e9:7.2f} GB/s   ratio {baseline / ours:5.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weightsync bench --gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mb", type=int, default=1024, help="MiB of one version (default 1024)")
    p.add_argument("--shape", default="2x2", help="trainers x inference ranks of the nccl measurement, or several "
                                                  "(2x2,1x1: the last line puts the first against the second; "
                                                  "default 2x2)")
    p.add_argument("--reps", type=int, default=5, help="versions timed per measurement (default 5)")
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl",
                   help="the nccl measurement's backend (gloo: on host tensors, without a GPU)")
    args = p.parse_args(argv)
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shape.split(",")]
    nbytes = args.mb << 20
    gpu = torch.cuda.is_available()
    if args.backend == "nccl" and not gpu:
        print("weightsync bench --gpu: no CUDA GPU is visible; --backend gloo runs the nccl measurement on host tensors",
              file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name(0) if gpu else "CPU"
    print(f"GPU data plane, {args.mb} MiB a version, median of {args.reps}, on {where} (torch {torch.__version__})",
          flush=True)
    per_byte = []
    for trainers, inferences in shapes:
        ours, theirs = bench_nccl(trainers, inferences, nbytes, args.reps, args.backend)
        per_byte.append(ours / inferences)
        print(line(f"{args.backend} {trainers}x{inferences}", nbytes * inferences, ours, theirs,
                   "broadcast from trainer rank 0"), flush=True)
    if len(shapes) > 1:
        (m, n), (m1, n1) = shapes[:2]
        print(f"{args.backend} {m}x{n} against {m1}x{n1}, per byte delivered: ratio {per_byte[1] / per_byte[0]:5.2f}x",
              flush=True)
    if not gpu:
        print("ipc, cast and ws64 need a CUDA GPU: not measured")
        return 0
    print(line("ipc", nbytes, *bench_ipc(nbytes, args.reps), "device-to-device copy"), flush=True)
    print(line("cast", nbytes, *bench_cast(nbytes, args.reps), "device copy"), flush=True)
    print(line("ws64", nbytes, *bench_ws64(nbytes, args.reps), "device copy"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
