"""`weightsync bench --control-plane --ranks N`: what the job's control plane costs as the job grows.

The data plane's plan for a large job can be projected (`weightsync plan --simulate`); what runs
around it cannot, short of a thousand GPUs: every rank joins through the controller's one store,
reads the plan, beats a heartbeat, and reports every version it sent or applied, while the
controller admits, plans, watches and checks them all. This bench runs the real controller (the
controller pod's code, in a process of its own, with its store) against N simulated ranks
(sim_ranks.py: threads of this process speaking the real protocol, moving no weights), with the
shapes `plan --simulate` builds: a model (kimi-k2 by default) on N - I trainer GPUs (FSDP2 over all
of them, dim 0) and the inference layout of I GPUs (4xEP32 by default). It prints one JSON object:

- join: seconds from the first rank's start until every rank had published its proof, and until
  every rank had read the plan (the controller's admission and planning in between);
- plan: what the store served each rank for the plan and the endpoints, the seconds each rank took
  to read them once published, and (plan_share.py) what deriving its own share costs one trainer
  and one inference rank in seconds and memory;
- controller: its CPU seconds for the join and the plan, and per version its CPU seconds and wall
  seconds (the rounds move no bytes, so all of it is control), with its round records' own seconds;
- heartbeats: beats per second, and the controller's CPU seconds and the store's requests per
  second while only they run;
- store: its keys and bytes held (their peak, and the keys at the end of each version), its
  requests per second through the versions, and the controller's resident memory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from weightsync.bench.chart import control_plane_chart
from weightsync.bench.sim_ranks import Sim, Wire
from weightsync.job import API_VERSION, CONTROLLER, INFERENCE, KIND, TRAINER, Job, WorkerContext, load_job
from weightsync.job.token import MIN_BYTES
from weightsync.local import ports
from weightsync.model.config import read_config_json
from weightsync.model.flat import FlatLayout
from weightsync.plan.holders import Holdings
from weightsync.plan.job import fsdp_holdings
from weightsync.plan.rank_plan import RankPlan
from weightsync.plan.shares import PlanShares, share_out
from weightsync.plan.simulate import MODELS, Topology, parse_inference, shapes
from weightsync.plan.sliced_plan import SlicedPlan, needs_from_json, needs_to_json, plan_from_json
from weightsync.rendezvous.channel import Channel, connect_store
from weightsync.rendezvous.protocol import HEARTBEAT, Keys
from weightsync.roles.controller.driver import Controller
from weightsync.roles.controller.records import Reporter

HOST = "127.0.0.1"
SAMPLE_EVERY = 0.25  # seconds between two samples of the store's keys, bytes and requests
STACK = 256 << 10  # a simulated rank's thread's stack (and its heartbeat's): a thousand of them fit
START_WAIT = 120.0  # seconds for the controller's process to listen
SHARE_LIMIT = 600.0  # seconds one rank's share of the plan is given (plan_share.py)
SHARE_MEMORY = 8 << 30  # bytes of address space it is given


@dataclass(frozen=True)
class Setup:
    """The simulated job: its spec, and what its ranks join with."""

    job: Job
    layout: FlatLayout
    holds: list  # per trainer rank: its Holdings JSON
    needs: list  # per inference rank: its slices (needs_to_json), or None (the whole version)
    build_seconds: float


def spec_config(model: str) -> dict:
    """spec.model.config of a built-in model of `plan --simulate`, or of a config.json path."""
    if model in MODELS:
        model_type, values = MODELS[model]
        return {"model_type": model_type, **values}
    path = Path(model)
    return dict(read_config_json(path / "config.json" if path.is_dir() else path))


def setup(model: str, ranks: int, inference: str, versions: int, dtype: str = "bfloat16", bucket_mb: int = 64) -> Setup:
    """The job of `ranks` ranks: the inference layout's GPUs, and trainers for the rest (FSDP2 over
    all of them); ValueError where that cannot be."""
    replicas, tp, ep = parse_inference(inference)
    size = max(tp, ep)
    inferences = replicas * size
    trainers = ranks - inferences
    if trainers < 1:
        raise ValueError(f"--ranks {ranks}: the inference layout {inference} alone has {inferences} ranks; give more "
                         "ranks, or a smaller layout")
    topo = Topology(trainers, trainers, replicas, tp, 400e9, dtype, bucket_mb << 20, "0", ep)
    shaped = shapes(model, topo)
    layout = FlatLayout.from_shapes([(t.name, t.shape) for t in shaped.tensors], dtype)
    holds = [h.to_json() for h in fsdp_holdings(layout, trainers, trainers)]
    needs = [needs_to_json(shaped.needs.of_rank(r)) if size > 1 else None for r in range(inferences)]
    job = load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "control-plane-bench"},
        "spec": {"model": {"config": spec_config(model), "dtype": dtype},
                 "trainer": {"replicas": trainers, "procsPerPod": 1, "gpusPerProc": 0},
                 "inference": {"replicas": inferences, "procsPerPod": 1, "gpusPerProc": 0, "tensorParallel": size},
                 "training": {"steps": versions},
                 "transfer": {"bucketMB": bucket_mb, "transport": "tcp", "timeoutSeconds": 600},
                 "network": {"mode": "tcp"}}})
    return Setup(job, layout, holds, needs, shaped.build_seconds + shaped.needs_seconds)


# ---------------------------------------------------------------- the controller's process


def controller_process(job_object: dict, token: bytes, port: int, directory: str) -> None:
    """The job's controller as its pod runs it (roles/controller), its lines in controller.log, its
    round records in records.jsonl, and its store's keys, bytes and requests sampled into samples.jsonl."""
    folder = Path(directory)
    with open(folder / "controller.log", "w") as log:  # the process's stdout and stderr from now on
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    job = load_job(job_object)
    ctx = WorkerContext(job=job, ordinal=0, role=CONTROLLER, pod_ip=HOST, controller_host=HOST, store_port=port,
                        data_port=0, network_mode="tcp", token=token, report_to_kubernetes=False, health_port=0)
    with open(folder / "records.jsonl", "w", buffering=1) as records:
        reporter = Reporter(job, False, out=records, status_file=str(folder / "status.json"))
        reporter.started(1)
        controller = Controller(ctx, reporter)
        threading.Thread(target=_sample, args=(controller.host, folder / "samples.jsonl"), daemon=True).start()
        code = controller.run(1, {})
    (folder / "exit.json").write_text(json.dumps({"exit": code}))


def _sample(host: Channel, path: Path) -> None:
    with open(path, "w", buffering=1) as out:
        while True:
            held = host.held()
            out.write(json.dumps({"t": time.monotonic(), "keys": held.keys, "bytes": held.bytes,
                                  "requests": held.requests}) + "\n")
            time.sleep(SAMPLE_EVERY)


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> dict:
    """Resident and peak resident memory of process `pid`, MiB."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mib": int(status["VmRSS"].split()[0]) // 1024, "peak_rss_mib": int(status["VmHWM"].split()[0]) // 1024}


def _listening(port: int, proc, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        if not proc.is_alive():
            raise RuntimeError("the controller's process ended as it started (its log says why)")
        try:
            socket.create_connection((HOST, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the controller does not listen on {HOST}:{port} after {within:.0f}s") from None
            time.sleep(0.05)


# ---------------------------------------------------------------- a run


def spread(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {}
    return {"median": round(statistics.median(values), 4), "p90": round(values[int(0.9 * (len(values) - 1))], 4),
            "max": round(values[-1], 4)}


def run(setup: Setup, versions: int, idle: float, directory: str, timeout: float = 1800.0) -> dict:
    """One bench run in `directory`; the figures (errors, where a rank or the controller failed)."""
    job, token = setup.job, os.urandom(MIN_BYTES).hex().encode()
    port = ports.lease([1])[0]
    proc = multiprocessing.get_context("spawn").Process(target=controller_process,
                                                       args=(job.to_object(), token, port, directory), daemon=True)
    proc.start()
    try:
        _listening(port, proc, START_WAIT)
        cpu_start = cpu_seconds(proc.pid)
        sim = Sim(job, HOST, port, token, setup.layout.to_json(), setup.holds, setup.needs, versions)
        old = threading.stack_size(STACK)
        began = time.monotonic()
        threads = sim.start()
        threading.stack_size(old)
        planned = sim.wait_planned(timeout)
        read_all = time.monotonic()
        cpu_planned = cpu_seconds(proc.pid)
        figures = {"errors": errors(sim)}
        if planned:
            if sim.shares:  # published in shares: each trainer's buckets from its own
                trainers = [RankPlan.from_json(sim.plan_text, sim.shares[(TRAINER, t)]) for t in range(len(sim.holds))]
                sim.wire = Wire.of(trainers[0], trainers)
            else:
                sim.wire = Wire.of(plan_from_json(sim.plan_text))
            idle_cpu, idle_from = cpu_seconds(proc.pid), time.monotonic()
            time.sleep(idle)
            idle_cpu, idle_to = cpu_seconds(proc.pid) - idle_cpu, time.monotonic()
            figures.update(versions_run(sim, proc.pid, port, token, versions, timeout))
            figures["heartbeats"] = {"per_second": round(len(threads) / HEARTBEAT, 1),
                                     "controller_cpu_per_second": round(idle_cpu / (idle_to - idle_from), 4),
                                     "window": (idle_from, idle_to)}
        else:
            sim.go.set()  # a failed join: the ranks' waits end with the job
        memory = memory_mib(proc.pid) if proc.is_alive() else {}
        for t in threads:
            t.join(max(0.0, began + timeout - time.monotonic()))
        proc.join(60.0)
    finally:
        if proc.is_alive():
            proc.kill()
        ports.release([port])
    folder = Path(directory)
    figures["errors"] = errors(sim)
    exit_file = folder / "exit.json"
    figures["controller_exit"] = json.loads(exit_file.read_text())["exit"] if exit_file.exists() else None
    times = list(sim.times.values())
    figures["join"] = {"ranks_joined": sum(1 for t in times if t.joined), "ranks_read_plan": sum(1 for t in times if t.plan_read),
                       "all_joined_seconds": round(max((t.joined or began) for t in times) - began, 3),
                       "all_read_plan_seconds": round(read_all - began, 3)}
    figures["plan"] = {"bytes_per_rank": max((t.plan_bytes for t in times), default=0),
                       "read_seconds": spread([t.plan_read - t.plan_seen for t in times if t.plan_read]),
                       "own_share": own_shares(sim.plan_text, directory, {role: sim.shares.get((role, 0)) for role in
                                                                          (TRAINER, INFERENCE)}) if sim.plan_text else []}
    records = [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines() if line.startswith("{")]
    rounds = [r for r in records if r.get("event") == "transfer"]
    figures.setdefault("controller", {}).update({
        "join_and_plan_cpu_seconds": round(cpu_planned - cpu_start, 3), **memory,
        "rounds": [{k: r.get(k) for k in ("version", "again", "inference_ranks", "seconds")} for r in rounds],
        "completion": next((r for r in records if r.get("event") == "completion"), None)})
    samples = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    figures["store"] = {"peak_keys": max(s["keys"] for s in samples), "peak_bytes": max(s["bytes"] for s in samples),
                        **figures.pop("store_at_versions", {})}
    if "heartbeats" in figures:
        figures["heartbeats"]["store_requests_per_second"] = request_rate(samples, *figures["heartbeats"].pop("window"))
        figures["store"]["requests_per_second_in_versions"] = request_rate(samples, *figures.pop("versions_window"))
    return figures


def request_rate(samples: list[dict], start: float, end: float) -> float:
    """The store's requests a second between `start` and `end`, from the samples within."""
    inside = [s for s in samples if start <= s["t"] <= end]
    if len(inside) < 2:
        return 0.0
    return round((inside[-1]["requests"] - inside[0]["requests"]) / (inside[-1]["t"] - inside[0]["t"]), 1)


def versions_run(sim: Sim, pid: int, port: int, token: bytes, versions: int, timeout: float) -> dict:
    """Let the ranks go through the versions; per version, the controller's CPU and wall seconds
    from the previous version's record to this one's, and the store's keys once it is recorded."""
    watch = Channel(connect_store(HOST, port, token, sim.job.identity, 60.0))
    cpu, wall, keys = [], [], []
    try:
        last_cpu, last = cpu_seconds(pid), time.monotonic()
        started = last
        sim.go.set()
        for version in range(versions):
            watch.wait([Keys.done(version)], f"version {version}", timeout)
            now_cpu, now = cpu_seconds(pid), time.monotonic()
            cpu.append(round(now_cpu - last_cpu, 4))
            wall.append(round(now - last, 4))
            keys.append(watch.held().keys)
            last_cpu, last = now_cpu, now
    finally:
        watch.close()
    return {"controller": {"version_cpu_seconds": cpu, "version_wall_seconds": wall},
            "store_at_versions": {"keys_after_each_version": keys}, "versions_window": (started, time.monotonic())}


def errors(sim: Sim) -> list[str]:
    return [f"{role} rank {rank}: {t.error}" for (role, rank), t in sorted(sim.times.items()) if t.error]


def own_shares(text: str, directory: str, shares: dict | None = None, limit: float = SHARE_LIMIT) -> list[dict]:
    """plan_share.py for trainer rank 0 and inference rank 0, each in a process of its own, given
    `limit` seconds each (past it: the seconds it was given, and no figures): from the published
    plan `text` and, where it was published in shares, each one's share ({role: its share})."""
    path = Path(directory) / "plan.json"
    path.write_text(text)
    out = []
    for role in (TRAINER, INFERENCE):
        share = (shares or {}).get(role)
        own = [] if share is None else [str(Path(directory) / f"share-{role}-0.json")]
        if share is not None:
            Path(own[0]).write_text(share)
        try:
            done = subprocess.run([sys.executable, "-m", "weightsync.bench.plan_share", role, "0", str(path), *own],
                                  capture_output=True, text=True, check=False, timeout=limit, preexec_fn=_bounded)
        except subprocess.TimeoutExpired:
            out.append({"role": role, "rank": 0, "unfinished_after_seconds": limit, "plan_json_bytes": len(text)})
            continue
        if done.returncode and "MemoryError" in done.stderr:
            out.append({"role": role, "rank": 0, "out_of_memory_gib": SHARE_MEMORY >> 30, "plan_json_bytes": len(text)})
            continue
        if done.returncode:
            raise RuntimeError(f"the plan's share of {role} rank 0 failed: {done.stderr.strip()[-2000:]}")
        out.append(json.loads(done.stdout))
    return out


def _bounded() -> None:
    """A rank's share of the plan is given SHARE_MEMORY of address space: a plan that needs more
    says so (MemoryError) instead of taking the machine's memory from everything else on it."""
    resource.setrlimit(resource.RLIMIT_AS, (SHARE_MEMORY, SHARE_MEMORY))


def published_plan(built: Setup) -> tuple[PlanShares, dict]:
    """The plan as the controller publishes it for `built`'s ranks (plan.job.make_job_plan's
    SlicedPlan, cut into every rank's share), and what that cost: the controller's seconds for the
    whole assignment and local layouts (its checks), then for the shares, and the bytes published."""
    holdings = tuple(Holdings.from_json(h) for h in built.holds)
    needs = tuple(needs_from_json(r, n) for r, n in enumerate(built.needs))
    start = time.perf_counter()
    plan = SlicedPlan(built.layout, holdings, needs, built.job.transfer.bucket_bytes)
    _ = plan.assignment, plan.local
    checked = time.perf_counter()
    shares = share_out(plan)
    cut = time.perf_counter()
    sizes = [len(t) for t in shares.trainers + shares.inferences]
    return shares, {"assignment_seconds": round(checked - start, 2), "shares_seconds": round(cut - checked, 2),
                    "pieces": len(plan.assignment), "header_bytes": len(shares.header),
                    "share_bytes_max": max(sizes), "shares_bytes_total": sum(sizes)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="weightsync bench --control-plane", description=__doc__.split("\n\n")[0])
    parser.add_argument("--control-plane", action="store_true", required=True)
    parser.add_argument("--ranks", required=True, help="trainer and inference ranks in all; several, comma-separated, "
                                                       "run one after the other")
    parser.add_argument("--model", default="kimi-k2", help=f"a model of `plan --simulate` ({', '.join(MODELS)}) or "
                                                          "a config.json path (default kimi-k2)")
    parser.add_argument("--inference", default="4xEP32", help="the inference layout, as `plan --simulate` takes it "
                                                              "(default 4xEP32), one for every --ranks or one each; "
                                                              "the other ranks are trainers")
    parser.add_argument("--versions", type=int, default=5, help="versions the trainers publish (default 5)")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of heartbeats alone, measured (default 5)")
    parser.add_argument("--chart", metavar="FILE.png", help="also draw each cost against the ranks (needs matplotlib)")
    parser.add_argument("--plan-share", action="store_true", help="instead: only what the published plan costs one "
                        "trainer and one inference rank (tensor-parallel layouts), without the controller and the ranks")
    args = parser.parse_args(argv)
    try:
        sizes = [int(n) for n in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks {args.ranks!r}: give numbers of ranks, comma-separated")
    layouts = args.inference.split(",")
    layouts = layouts * len(sizes) if len(layouts) == 1 else layouts
    if args.versions < 1 or min(sizes) < 2 or len(layouts) != len(sizes):
        parser.error("--versions at least 1, --ranks at least 2 each, and one --inference layout or one per --ranks")
    runs = []
    for ranks, inference in zip(sizes, layouts):
        print(f"bench: {ranks} ranks, inference {inference} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            built = setup(args.model, ranks, inference, args.versions)
        except ValueError as e:
            print(f"weightsync bench: {e}", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="weightsync-control-plane-") as directory:
            if args.plan_share:
                if not built.job.layout.sliced:
                    parser.error("--plan-share: give a tensor- or expert-parallel --inference layout")
                shares, controller = published_plan(built)
                own = own_shares(shares.header, directory, {TRAINER: shares.trainers[0], INFERENCE: shares.inferences[0]})
                runs.append({"ranks": ranks, "inference": inference, "plan": {"controller": controller, "own_share": own}})
                continue
            figures = run(built, args.versions, args.idle, directory)
            if figures["errors"] or figures["controller_exit"] != 0:
                figures["controller_log"] = (Path(directory) / "controller.log").read_text()[-4000:]
        layout = built.job.layout
        runs.append({"ranks": ranks, "inference": inference, "trainers": layout.world_size(TRAINER),
                     "inference_ranks": layout.world_size(INFERENCE), "setup_seconds": round(built.build_seconds, 2),
                     "bench_seconds": round(time.perf_counter() - started, 1), **figures})
        if figures["errors"] or figures["controller_exit"] != 0:
            break
    report = {"model": args.model, "versions": args.versions, "machine": machine(), "runs": runs}
    print(json.dumps(report, indent=2))
    if args.chart and not args.plan_share:
        print(f"bench: chart in {control_plane_chart(report, args.chart)}", file=sys.stderr, flush=True)
    return 0 if all(not r.get("errors") and r.get("controller_exit", 0) == 0 for r in runs) else 1


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    has = [f for f in ("amx_tile", "avx512f", "avx512_bf16") if f" {f}" in flags]
    return f"{model}, {os.cpu_count()} CPUs ({', '.join(has) or 'no AVX-512, no AMX'}), Python {platform.python_version()}"
