"""`weightsync bench`: how fast one weight version moves from trainer ranks to inference ranks.

For a GPT-2 124M-shaped model (transformers' default GPT2Config, random init, nothing
downloaded), at each dtype and each trainers->inference shape, one set of real processes on
loopback runs three methods, several versions each, and the median seconds per version is
reported:
  weightsync  the planned M-to-N transfer over TCP: VersionSender/VersionReceiver, the code the
              trainer and inference roles run (cast pipelined by bucket, checksums verified);
  broadcast   what most RL frameworks do: torch.distributed (gloo) broadcast of every tensor,
              cast to the dtype, from one trainer rank to the inference ranks;
  ceiling     the same bytes, with the same trainer->inference assignment, pushed through plain
              sockets between the same processes with nothing else done.
A version's time runs from the first trainer starting to the last inference rank holding it.
GB/s counts the bytes delivered to all inference ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

METHODS = ("weightsync", "broadcast", "ceiling")
TOKEN = b"weightsync-bench-token-0123456789"


# ---------------------------------------------------------------- measurements inside a worker


def proc_status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Make VmHWM start again from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Barrier:
    """All processes of a case meet at a named point through the store (no sleeps)."""

    def __init__(self, store, parties: int):
        self.store, self.parties = store, parties

    def __call__(self, name: str) -> None:
        if self.store.add(f"barrier/{name}", 1) == self.parties:
            self.store.set(f"open/{name}", "1")
        self.store.wait([f"open/{name}"])


def tuple_endpoint(endpoint: bytes) -> tuple[str, int]:
    host, port = endpoint.decode().rsplit(":", 1)
    return host, int(port)


def build_model(dtype: str):
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    return model.to(getattr(torch, dtype)) if dtype != "float32" else model


def worker(role: str, rank: int, case: dict, store_port: int) -> None:
    try:
        _worker(role, rank, case, store_port)
    except BaseException as e:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=30))
        store.set(f"error/{role}/{rank}", f"{type(e).__name__}: {e}")
        raise


def _worker(role: str, rank: int, case: dict, store_port: int) -> None:
    import torch
    import torch.distributed as dist

    from weightsync.flat import FlatLayout, views
    from weightsync.plan import make_plan
    from weightsync.transfer import VersionReceiver, VersionSender, settle_heap, version_digest
    from weightsync.transport import make_transport
    from weightsync.transport.checksum import CHUNK
    from weightsync.transport.tcp import RECV_CHUNK, recv_into_all

    M, N, dtype, versions = case["trainers"], case["inferences"], case["dtype"], case["versions"]
    timeout = datetime.timedelta(seconds=case["timeout"])
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    barrier = Barrier(store, M + N)
    trainer = role == "trainer"
    global_rank = rank if trainer else M + rank
    result: dict = {}

    # Trainers hold float32 master weights; inference ranks the model in the transfer dtype.
    model = build_model("float32" if trainer else dtype)
    params = [p.detach() for _, p in model.named_parameters()]
    layout = FlatLayout.from_named_tensors(model.named_parameters(), dtype)
    plan = make_plan(layout, M, N, case["bucket_mb"] << 20)
    if not trainer:
        reset_peak_rss()
        result["rss_after_model"] = proc_status("VmRSS")
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=global_rank, world_size=M + N, timeout=timeout)
    bcast_group = dist.new_group([0] + list(range(M, M + N)))

    # ---- set-up of the three methods (connections, buffers), outside the timed versions
    transport = make_transport("tcp", token=TOKEN, timeout=case["timeout"])
    ranges = plan.expected()
    if trainer:
        sender = transport.sender(rank)
        sender.connect({i: store.get(f"ep/{i}").decode() for i in range(N)})
        mover = VersionSender(sender, plan, rank, depth=case["depth"])
        share = sum(n for _, n in ranges.get(rank, []))
        payload = memoryview(torch.ones(share, dtype=torch.uint8).numpy())
        raw = [socket.create_connection(tuple_endpoint(store.get(f"raw/{i}"))) for i in range(N) if rank in ranges]
        for s in raw:
            s.sendall(rank.to_bytes(4, "little"))
        pool = ThreadPoolExecutor(max_workers=N)
    else:
        receiver = transport.receiver(rank)
        store.set(f"ep/{rank}", receiver.listen("127.0.0.1", 0))
        listener = socket.create_server(("127.0.0.1", 0))
        store.set(f"raw/{rank}", f"127.0.0.1:{listener.getsockname()[1]}")
        raw = {}
        for _ in range(len(ranges)):
            s, _ = listener.accept()
            raw[int.from_bytes(s.recv(4, socket.MSG_WAITALL), "little")] = s
        listener.close()
        staging = torch.empty(layout.total_bytes, dtype=torch.uint8)
        target = memoryview(staging.numpy())  # the ceiling lands its bytes in the same staging buffer
        incoming = VersionReceiver(receiver, plan, rank)
        pool = ThreadPoolExecutor(max_workers=max(1, len(ranges)))

        def pull(t: int) -> None:
            for offset, length in ranges[t]:
                for a in range(offset, offset + length, RECV_CHUNK):
                    recv_into_all(raw[t], target[a:min(a + RECV_CHUNK, offset + length)])
    torch_dtype = getattr(torch, dtype)

    received = {}

    def weightsync(v: int) -> None:
        if trainer:
            sent = mover.send(v, params)
            store.set(f"weightsync/{v}/sums/{rank}", json.dumps(sent.checksums))
        else:
            received[v] = incoming.receive(v, staging, case["timeout"])

    def verify(v: int) -> None:
        """Outside the timed part: the digest and every byte against the trainers' weights."""
        if not trainer:
            got = received.pop(v)
            sums = {}
            for t in range(M):
                sums.update({int(k): s for k, s in json.loads(store.get(f"weightsync/{v}/sums/{t}")).items()})
            if got.digest != version_digest(sums):
                raise RuntimeError(f"version {v}: digest {got.digest} differs from the trainers' {version_digest(sums)}")
            for mine, landed in zip(params, views(staging, layout)):
                if not torch.equal(mine.view(torch.uint8), landed.view(torch.uint8)):
                    raise RuntimeError(f"version {v}: the received weights differ from the trainers' cast weights")

    def ceiling(v: int) -> None:
        if trainer:
            def push(s: socket.socket) -> None:
                for a in range(0, len(payload), CHUNK):
                    s.sendall(payload[a:a + CHUNK])

            list(pool.map(push, raw))
        else:
            list(pool.map(pull, list(ranges)))

    def broadcast(v: int) -> None:
        if global_rank == 0:
            for p in params:
                dist.broadcast(p.to(torch_dtype).contiguous(), src=0, group=bcast_group)
        elif not trainer:
            for p in params:
                dist.broadcast(p, src=0, group=bcast_group)

    settle_heap()  # as the roles do, and for every method alike
    # ---- the versions: methods interleaved, so that all see the same machine; version 0 warms up
    run = {"weightsync": weightsync, "ceiling": ceiling, "broadcast": broadcast}
    for v in range(versions + 1):
        for m in METHODS:
            barrier(f"{m}/{v}")
            start = time.monotonic()
            run[m](v)
            end = time.monotonic()
            if trainer:
                store.set(f"{m}/{v}/start/{rank}", repr(start))
            else:
                store.set(f"{m}/{v}/end/{rank}", repr(end))
            if m == "weightsync":
                verify(v)
            if v == 0 and m == "weightsync" and not trainer:
                # every buffer of the weightsync path is touched by now; the other methods add none
                result["peak_rss_beyond_model"] = proc_status("VmHWM") - result["rss_after_model"]
    barrier("finished")
    if trainer:
        result["send_buffer_bytes"] = mover.buffer_bytes
        sender.close()
    else:
        result["verified"] = True
        result["peak_rss_beyond_model_all_methods"] = proc_status("VmHWM") - result["rss_after_model"]
        receiver.close()
    pool.shutdown()
    for s in (raw if trainer else raw.values()):
        s.close()
    dist.destroy_process_group()
    store.set(f"result/{role}/{rank}", json.dumps(result))


# ---------------------------------------------------------------- the parent: cases and the report


def run_case(case: dict) -> dict:
    import multiprocessing

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(role, r, case, store.port), name=f"{role}-{r}")
             for role, n in (("trainer", case["trainers"]), ("inference", case["inferences"])) for r in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + case["timeout"] * 2
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [p.name for p in procs if p.is_alive()]
        failed = [f"{p.name} exited with {p.exitcode}" for p in procs if not p.is_alive() and p.exitcode]
        if stuck or failed:
            errors = []
            for p in procs:
                key = "error/" + p.name.replace("-", "/")
                if store.check([key]):
                    errors.append(f"{p.name}: {store.get(key).decode()}")
            raise RuntimeError(f"benchmark case {case['dtype']} {case['trainers']}->{case['inferences']} failed: "
                               + "; ".join(errors or failed or [f"{', '.join(stuck)} did not finish in time"]))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return summarize(case, store)


def summarize(case: dict, store) -> dict:
    from weightsync.flat import FlatLayout
    from weightsync.plan import make_plan

    M, N = case["trainers"], case["inferences"]
    results = {(role, r): json.loads(store.get(f"result/{role}/{r}"))
               for role, n in (("trainer", M), ("inference", N)) for r in range(n)}
    version_bytes = case["version_bytes"]
    methods = {}
    for m in METHODS:
        senders = [r for r in range(M) if store.check([f"{m}/1/start/{r}"])]
        seconds = []
        for v in range(1, case["versions"] + 1):
            start = min(float(store.get(f"{m}/{v}/start/{r}")) for r in senders)
            end = max(float(store.get(f"{m}/{v}/end/{i}")) for i in range(N))
            seconds.append(end - start)
        median = statistics.median(seconds)
        methods[m] = {"seconds_per_version": median, "gbps": version_bytes * N / median / 1e9,
                      "seconds": [round(s, 4) for s in seconds]}
    for m in METHODS:
        methods[m]["ratio_to_ceiling"] = methods["ceiling"]["seconds_per_version"] / methods[m]["seconds_per_version"]
        methods[m]["speedup_over_broadcast"] = methods["broadcast"]["seconds_per_version"] / methods[m]["seconds_per_version"]
    peak = max(results[("inference", i)]["peak_rss_beyond_model"] for i in range(N))
    peak_all = max(results[("inference", i)]["peak_rss_beyond_model_all_methods"] for i in range(N))
    buffers = max(results[("trainer", t)]["send_buffer_bytes"] for t in range(M))
    plan = make_plan(FlatLayout.from_json(case["layout"]), M, N, case["bucket_mb"] << 20)
    memory = {
        "version_bytes": version_bytes,
        "inference_peak_rss_beyond_model": peak,
        "inference_peak_over_version": peak / version_bytes,
        "inference_limit_over_version": 2.5,
        "inference_peak_rss_beyond_model_all_methods": peak_all,
        "trainer_send_buffer_bytes": buffers,
        "trainer_send_buffer_limit": case["depth"] * (case["bucket_mb"] << 20),
    }
    return {"dtype": case["dtype"], "trainers": M, "inferences": N, "versions": case["versions"],
            "bucket_mb": case["bucket_mb"], "depth": case["depth"], "plan_balance": plan.balance(),
            "verified": all(results[("inference", i)].get("verified") for i in range(N)),
            "methods": methods, "memory": memory}


def render(report: dict) -> str:
    lines = [f"weightsync bench: {report['model']}; {report['machine']}",
             f"{'dtype':<9} {'ranks':<6} {'method':<11} {'s/version':>10} {'GB/s':>7} {'vs ceiling':>11} {'vs broadcast':>13}"]
    for c in report["cases"]:
        for m in METHODS:
            r = c["methods"][m]
            lines.append(f"{c['dtype']:<9} {c['trainers']}->{c['inferences']:<3} {m:<11} {r['seconds_per_version']:>10.3f} "
                         f"{r['gbps']:>7.2f} {r['ratio_to_ceiling']:>11.2f} {r['speedup_over_broadcast']:>12.2f}x")
        mem = c["memory"]
        lines.append(f"{'':<17}memory: inference peak RSS beyond the model {mem['inference_peak_rss_beyond_model'] / 2**20:.0f} MiB "
                     f"= {mem['inference_peak_over_version']:.2f} x version ({mem['version_bytes'] / 2**20:.0f} MiB; limit 2.5); "
                     f"trainer send buffers {mem['trainer_send_buffer_bytes'] / 2**20:.0f} MiB (limit depth x bucket = "
                     f"{mem['trainer_send_buffer_limit'] / 2**20:.0f} MiB); verified: {c['verified']}")
    for t in report["targets"]:
        lines.append(f"target {t['name']}: {t['value']:.2f} (want {t['want']}) -> {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def targets(cases: list[dict]) -> list[dict]:
    out = []
    for c in cases:
        if (c["trainers"], c["inferences"]) != (2, 2):
            continue
        w = c["methods"]["weightsync"]
        mem = c["memory"]
        where = f"{c['dtype']} 2->2"
        out += [
            {"name": f"{where} ratio to ceiling", "value": w["ratio_to_ceiling"], "want": ">= 0.7", "met": w["ratio_to_ceiling"] >= 0.7},
            {"name": f"{where} speedup over broadcast", "value": w["speedup_over_broadcast"], "want": ">= 1.5",
             "met": w["speedup_over_broadcast"] >= 1.5},
            {"name": f"{where} inference peak RSS / version", "value": mem["inference_peak_over_version"], "want": "<= 2.5",
             "met": mem["inference_peak_over_version"] <= 2.5},
            {"name": f"{where} trainer send buffers / (depth x bucket)",
             "value": mem["trainer_send_buffer_bytes"] / mem["trainer_send_buffer_limit"], "want": "<= 1",
             "met": mem["trainer_send_buffer_bytes"] <= mem["trainer_send_buffer_limit"]},
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of `weightsync bench` (argv without the subcommand). Prints the table, or
    with --json one JSON object; returns the exit status (0 when every case ran)."""
    parser = argparse.ArgumentParser(prog="weightsync bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated transfer dtypes")
    parser.add_argument("--shapes", default="2x2,1x1", help="comma-separated TRAINERSxINFERENCE rank counts")
    parser.add_argument("--versions", type=int, default=7, help="timed versions per method (after one warm-up)")
    parser.add_argument("--bucket-mb", type=int, default=64, help="bucket size in MiB (the CRD's default transfer.bucketMB)")
    parser.add_argument("--depth", type=int, default=2, help="send buffers per trainer rank (pipeline depth)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a silent peer fails the run")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)

    from weightsync.flat import FlatLayout, cast_name

    shapes = []
    for s in args.shapes.split(","):
        m, _, n = s.partition("x")
        if not (m.isdigit() and n.isdigit() and int(m) > 0 and int(n) > 0):
            parser.error(f"--shapes: {s!r} is not TRAINERSxINFERENCE, for example 2x2")
        shapes.append((int(m), int(n)))
    dtypes = args.dtypes.split(",")
    for d in dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            parser.error(f"--dtypes: {d!r} is not one of float32, bfloat16, float16")

    import torch
    import transformers

    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    params = sum(p.numel() for p in meta.parameters())
    cases = []
    for dtype in dtypes:
        layout = FlatLayout.from_named_tensors(meta.named_parameters(), dtype)
        for m, n in shapes:
            case = {"dtype": dtype, "trainers": m, "inferences": n, "versions": args.versions, "bucket_mb": args.bucket_mb,
                    "depth": args.depth, "timeout": args.timeout, "version_bytes": layout.total_bytes, "layout": layout.to_json()}
            print(f"bench: {dtype} {m}->{n} ...", file=sys.stderr, flush=True)
            cases.append(run_case(case))
    report = {"model": f"GPT-2 (GPT2Config defaults), {params / 1e6:.1f}M parameters, {len(list(meta.parameters()))} tensors",
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, loopback TCP, "
                         f"float32 -> bfloat16 cast by {cast_name()}",
              "cases": cases, "targets": targets(cases)}
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
