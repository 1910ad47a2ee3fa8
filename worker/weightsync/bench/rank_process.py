"""One rank of a `weightsync bench` case, in its own process: the methods it times, version by
version, and the checks between them (transfer.py starts the processes and reports).

A trainer rank holds float32 master weights: GPT-2's random init for every version, or, with
trained versions (trained.py), version v loaded into the same resident tensors before version v
is timed, as a trainer's optimizer step would leave them. An inference rank receives into
buffers of one version each. Every process of a case meets the others at named barriers through
the case's store, so the methods run one at a time on an otherwise idle set of processes, version
by version, interleaved. With links (netns.py), the process first moves into its own network
namespace, and every connection, the store's included, goes over its shaped link.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from weightsync.bench.netns import enter
from weightsync.bench.trained import TrainedVersions
from weightsync.model.flat import FlatLayout, fill_range, views
from weightsync.plan.segments import make_plan
from weightsync.runtime.rank import without_triton
from weightsync.transfer.receive import VersionReceiver, settle_heap
from weightsync.transfer.send import VersionSender
from weightsync.transfer.sums import version_digest
from weightsync.transport import make_transport
from weightsync.transport.checksum import CHUNK
from weightsync.transport.landing import RECV_CHUNK
from weightsync.transport.sockets import recv_into_all

TOKEN = b"weightsync-bench-token-0123456789"


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


def where(case: dict, role: str, rank: int) -> tuple[int, str, str]:
    """(process index, this process's address, the store's address) in a case."""
    index = rank if role == "trainer" else case["trainers"] + rank
    links = case.get("links")
    if links is None:
        return index, "127.0.0.1", "127.0.0.1"
    return index, links["addresses"][index], links["store_host"]


def run(role: str, rank: int, case: dict, store_port: int) -> None:
    """The process's target: with links, first into its network namespace (before any socket
    or thread); a failure is left in the store for the parent to report."""
    without_triton()  # a CPU rank, as the job's are
    index, _, store_host = where(case, role, rank)
    if case.get("links"):
        enter(case["links"]["namespaces"][index])
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no names for the links' addresses: c10d warns of each
    try:
        _run(role, rank, case, store_port)
    except BaseException as e:
        import torch.distributed as dist

        store = dist.TCPStore(store_host, store_port, is_master=False, timeout=datetime.timedelta(seconds=30))
        store.set(f"error/{role}/{rank}", f"{type(e).__name__}: {e}")
        raise


def _run(role: str, rank: int, case: dict, store_port: int) -> None:
    import torch
    import torch.distributed as dist

    trainers, inferences = case["trainers"], case["inferences"]
    dtype, versions, methods = case["dtype"], case["versions"], case["methods"]
    index, address, store_host = where(case, role, rank)
    timeout = datetime.timedelta(seconds=case["timeout"])
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout)
    barrier = Barrier(store, trainers + inferences)
    trainer = role == "trainer"
    result: dict = {}
    trained = None
    if case.get("trained"):
        t = case["trained"]
        trained = TrainedVersions(t["directory"], FlatLayout.from_json(t["layout"]), t["count"], t["learning_rate"])

    # Trainers hold float32 master weights; inference ranks the model in the transfer dtype (or,
    # with trained versions, only buffers: what they receive is checked against the files).
    if trained is None:
        model = build_model("float32" if trainer else dtype)
        params = [p.detach() for _, p in model.named_parameters()]
        layout = FlatLayout.from_named_tensors(model.named_parameters(), dtype)
    else:
        layout = FlatLayout.from_shapes([(s.name, s.shape) for s in trained.layout.slots], dtype)
        params = [torch.empty(s.shape) for s in trained.layout.slots] if trainer else []
    plan = make_plan(layout, trainers, inferences, case["bucket_mb"] << 20)
    if not trainer:
        reset_peak_rss()
        result["rss_after_model"] = proc_status("VmRSS")
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=index, world_size=trainers + inferences,
                            timeout=timeout)
    bcast_group = dist.new_group([0] + list(range(trainers, trainers + inferences)))

    # ---- set-up of the methods (connections, buffers), outside the timed versions
    transport = make_transport("tcp", token=TOKEN, timeout=case["timeout"])
    ranges = plan.expected()
    if trainer:
        sender = transport.sender(rank)
        sender.connect({i: store.get(f"ep/{i}").decode() for i in range(inferences)})
        mover = VersionSender(sender, plan, rank, depth=case["depth"])
        patcher = VersionSender(sender, plan, rank, depth=case["depth"], delta=True) if "delta" in methods else None
        share = sum(n for _, n in ranges.get(rank, []))
        payload = memoryview(torch.ones(share, dtype=torch.uint8).numpy())
        raw = [socket.create_connection(tuple_endpoint(store.get(f"raw/{i}"))) for i in range(inferences) if rank in ranges]
        for s in raw:
            s.sendall(rank.to_bytes(4, "little"))
        pool = ThreadPoolExecutor(max_workers=inferences)
    else:
        receiver = transport.receiver(rank)
        store.set(f"ep/{rank}", receiver.listen(address, 0))
        listener = socket.create_server((address, 0))
        store.set(f"raw/{rank}", f"{address}:{listener.getsockname()[1]}")
        raw = {}
        for _ in range(len(ranges)):
            s, _ = listener.accept()
            raw[int.from_bytes(s.recv(4, socket.MSG_WAITALL), "little")] = s
        listener.close()
        # weightsync lands version v in buffers[v % 2]; the ceiling and the broadcast land in the
        # buffer not in use. Delta versions have buffers of their own, as an engine's two: version
        # v lands in deltas[v % 2], patched against v - 1 in the other, and that one still holds
        # v - 2 when v + 1 comes (the receiver patches it in place: transfer/held.py)
        buffers = [torch.empty(layout.total_bytes, dtype=torch.uint8) for _ in range(2 if trained else 1)]
        deltas = [torch.empty(layout.total_bytes, dtype=torch.uint8) for _ in range(2 if "delta" in methods else 0)]
        incoming = VersionReceiver(receiver, plan, rank)
        incoming_delta = VersionReceiver(receiver, plan, rank) if deltas else None
        pool = ThreadPoolExecutor(max_workers=max(1, len(ranges)))
    torch_dtype = getattr(torch, dtype)

    def spare(v: int):
        return buffers[(v + 1) % len(buffers)]

    def pull(t: int, target) -> None:
        for offset, length in ranges[t]:
            for a in range(offset, offset + length, RECV_CHUNK):
                recv_into_all(raw[t], target[a:min(a + RECV_CHUNK, offset + length)])

    received = {}
    phases: dict[int, dict] = {}  # delta versions: where this rank's time went (transfer/phases.py)

    def weightsync(v: int) -> None:
        if trainer:
            sent = mover.send(v, params)
            store.set(f"weightsync/{v}/sums/{rank}", json.dumps(sent.checksums))
        else:
            received["weightsync", v] = incoming.receive(v, buffers[v % len(buffers)], case["timeout"])

    def delta(v: int) -> None:
        cpu = time.process_time()  # of every thread of the process
        if trainer:
            sent = patcher.send(v, params, bases={i: v - 1 for i in range(inferences)} if v else None)
            store.set(f"delta/{v}/sums/{rank}", json.dumps(sent.checksums))
            store.set(f"delta/{v}/wire/{rank}", str(sent.wire_bytes))
            phases[v] = dict(sent.phases, total=sent.seconds)
        else:
            base = (v - 1, deltas[(v - 1) % 2]) if v else None
            got = received["delta", v] = incoming_delta.receive(v, deltas[v % 2], case["timeout"], base)
            phases[v] = dict(got.phases, total=got.seconds)
        phases[v]["cpu"] = time.process_time() - cpu

    def verify(m: str, v: int) -> None:
        """Outside the timed part: the digest and every byte against the trainers' weights."""
        if trainer:
            return
        got = received.pop((m, v))
        sums = {}
        for t in range(trainers):
            sums.update({int(k): s for k, s in json.loads(store.get(f"{m}/{v}/sums/{t}")).items()})
        if got.refused:  # every rank holds each base: a refused patch is a fault, not a fallback to time
            raise RuntimeError(f"{m} version {v}: {len(got.refused)} patches refused, the first: {got.refused[0]}")
        if got.digest != version_digest(sums):
            raise RuntimeError(f"{m} version {v}: digest {got.digest} differs from the trainers' {version_digest(sums)}")
        landed = deltas[v % 2] if m == "delta" else buffers[v % len(buffers)]
        if trained is None:
            same = all(torch.equal(mine.view(torch.uint8), there.view(torch.uint8))
                       for mine, there in zip(params, views(landed, layout)))
        else:  # the version's float32 weights, cast here as the trainers cast them, chunk by chunk
            weights = [torch.empty(s.shape) for s in trained.layout.slots]
            trained.load(v, weights)
            want = torch.empty(min(64 << 20, layout.total_bytes), dtype=torch.uint8)
            same = True
            for a in range(0, layout.total_bytes, len(want)):
                b = min(a + len(want), layout.total_bytes)
                fill_range(layout, weights, a, b, want[:b - a])
                same = same and torch.equal(want[:b - a], landed[a:b])
        if not same:
            raise RuntimeError(f"{m} version {v}: the received weights differ from the trainers' cast weights")

    def ceiling(v: int) -> None:
        if trainer:
            def push(s: socket.socket) -> None:
                for a in range(0, len(payload), CHUNK):
                    s.sendall(payload[a:a + CHUNK])

            list(pool.map(push, raw))
        else:
            target = memoryview(spare(v).numpy())  # the same pieces as weightsync, into a staging buffer
            list(pool.map(lambda t: pull(t, target), list(ranges)))

    def broadcast(v: int) -> None:
        if index == 0:
            for p in params:
                dist.broadcast(p.to(torch_dtype).contiguous(), src=0, group=bcast_group)
        elif not trainer:
            for p in (params if trained is None else views(spare(v), layout)):
                dist.broadcast(p, src=0, group=bcast_group)

    settle_heap()  # as the roles do, and for every method alike
    # ---- the versions: methods interleaved, so that all see the same machine; version 0 warms up
    timed = {"weightsync": weightsync, "delta": delta, "ceiling": ceiling, "broadcast": broadcast}
    for v in range(versions + 1):
        if trained is not None and trainer:
            trained.load(v, params)  # what the optimizer step would have left, outside the timed part
        for m in methods:
            barrier(f"{m}/{v}")
            start = time.monotonic()
            timed[m](v)
            end = time.monotonic()
            if trainer:
                store.set(f"{m}/{v}/start/{rank}", repr(start))
            else:
                store.set(f"{m}/{v}/end/{rank}", repr(end))
            if m in ("weightsync", "delta"):
                verify(m, v)
            if m == "delta":
                store.set(f"delta/{v}/phases/{role}/{rank}", json.dumps(phases.pop(v)))
            if v == 0 and m == "weightsync" and not trainer:
                # every buffer of the weightsync path is touched by now; the other methods add none
                result["peak_rss_beyond_model"] = proc_status("VmHWM") - result["rss_after_model"]
    barrier("finished")
    if trainer:
        result["send_buffer_bytes"] = mover.buffer_bytes
        result["kept_bytes"] = patcher.kept_bytes if patcher is not None else 0
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
