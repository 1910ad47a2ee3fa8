"""`weightsync bench --fsdp`: FSDP2 shards against DDP replicas, through the public trainer API.

The same model, dtype and ranks, two jobs (`weightsync run`'s local processes) whose trainer
ranks run this module as their spec.trainer.command:
  ddp   every trainer rank holds the whole model (DistributedDataParallel) and sends its
        contiguous share of the version (segments.make_plan);
  fsdp  every trainer rank holds only its FSDP2 shard (fully_shard on the meta device, then
        to_empty: the whole model is never materialised on any rank) and sends its own rows of
        every tensor (shards.plan_by_holder), nothing gathered.
The trainer ranks only change the weights a little and publish, back to back (no training
competes for the cores). A version's time is the controller's: from its go to the last inference
rank holding the version, verified. The first version, which allocates the send buffers and
connects, is left out. Each wrap runs twice, in the order ddp, fsdp, fsdp, ddp, and its medians
are over the versions of both jobs.

Memory: each trainer rank reads its resident set before the model exists, once the model is
materialised (and wrapped), and its peak (VmHWM, reset there) after the last version. What the
rank holds beyond its start must stay within its share of the model (a shard, or the whole model
for DDP) plus the send buffers the trainer API allocates (depth x bucket): nothing is gathered,
nothing is staged whole.
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

import weightsync
from weightsync.bench.chart import fsdp_chart
from weightsync.bench.rank_process import proc_status, reset_peak_rss
from weightsync.job import API_VERSION, KIND, WorkerContext, load_job
from weightsync.local.runner import LocalJob
from weightsync.model.build import build
from weightsync.runtime.faults import IDLE_ENV

# GPT-2 124M (transformers' GPT2Config defaults), as `weightsync bench`
MODEL = {"model_type": "gpt2"}
WRAPS = ("ddp", "fsdp")
# Two jobs of each, in the order A B B A: the machine's drift over the bench (a shared VM's
# neighbours, its clock) weighs on both alike, instead of on whichever ran second.
ORDER = ("ddp", "fsdp", "fsdp", "ddp")
RUN_TIMEOUT = 1200.0
# What a trainer rank may hold beyond its share and its send buffers: the interpreter's own
# allocations while it publishes (the plan, frames, threads' stacks touched), not a tensor.
SLACK_BYTES = 32 << 20


def bench_job(wrap: str, dtype: str, trainers: int, inferences: int, versions: int, bucket_mb: int, out: Path):
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": f"bench-{wrap}"},
        "spec": {"model": {"config": MODEL, "dtype": dtype},
                 "trainer": {"replicas": trainers, "gpusPerProc": 0,
                             "command": [sys.executable, "-m", "weightsync.bench.fsdp", wrap, str(versions), str(out)],
                             "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},
                 "inference": {"replicas": inferences, "gpusPerProc": 0},
                 "transfer": {"transport": "tcp", "bucketMB": bucket_mb, "timeoutSeconds": 300},
                 "network": {"mode": "tcp"}}})


def run_wrap(wrap: str, dtype: str, trainers: int, inferences: int, versions: int, bucket_mb: int,
             around=contextlib.nullcontext) -> dict:
    """One job: the controller's seconds for every version after the first, and each trainer
    rank's memory figures; `around(local)` is a context the job runs in once started (a scraper)."""
    with tempfile.TemporaryDirectory(prefix=f"weightsync-bench-{wrap}-") as folder:
        out = Path(folder) / "ranks"
        out.mkdir()
        job = bench_job(wrap, dtype, trainers, inferences, versions, bucket_mb, out)
        local = LocalJob(job, Path(folder) / "run", {IDLE_ENV: "1"}, progress=io.StringIO())
        try:
            local.start()
            with around(local):
                summary = local.wait(RUN_TIMEOUT)
        finally:
            local.stop()
        ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(trainers)]
    if summary["failed_verifications"]:
        raise RuntimeError(f"the {wrap} job had {summary['failed_verifications']} failed verifications")
    seconds = [t["seconds"] for t in local.transfers if t["version"] > 0]
    sends = [max(r["sends"][v] for r in ranks) for v in range(1, versions)]
    return {"seconds": seconds, "send_seconds": [round(x, 4) for x in sends],
            "bytes_per_version": local.transfers[-1]["bytes"], "ranks": ranks}


def pooled(runs: list[dict]) -> dict:
    """One wrap's figures over its jobs: medians of every timed version, each rank's memory at its worst."""
    seconds = [x for r in runs for x in r["seconds"]]
    sends = [x for r in runs for x in r["send_seconds"]]
    worst = {}
    for r in runs:
        for m in map(memory, r["ranks"]):
            if m["rank"] not in worst or m["peak_beyond_start"] > worst[m["rank"]]["peak_beyond_start"]:
                worst[m["rank"]] = m
    return {"seconds_per_version": statistics.median(seconds), "seconds": seconds,
            "send_seconds_per_version": statistics.median(sends), "send_seconds": sends,
            "bytes_per_version": runs[-1]["bytes_per_version"], "jobs": len(runs), "memory": [worst[k] for k in sorted(worst)]}


def memory(rank: dict) -> dict:
    """A trainer rank's figures: what it held beyond its start, against its share plus buffers."""
    bound = rank["held_bytes"] + rank["buffer_bytes"]
    beyond = rank["peak_rss"] - rank["start_rss"]
    return {"rank": rank["rank"], "held_bytes": rank["held_bytes"], "buffer_bytes": rank["buffer_bytes"],
            "model_rss": rank["model_rss"] - rank["start_rss"], "peak_beyond_start": beyond,
            "peak_beyond_model": rank["peak_rss"] - rank["model_rss"], "bound": bound,
            "within": beyond <= bound + SLACK_BYTES}


def run(dtypes: list[str], trainers: int, inferences: int, versions: int, bucket_mb: int) -> dict:
    cases = []
    for dtype in dtypes:
        runs: dict[str, list[dict]] = {wrap: [] for wrap in WRAPS}
        for wrap in ORDER:
            print(f"bench: {wrap} {dtype} {trainers}->{inferences} ...", file=sys.stderr, flush=True)
            runs[wrap].append(run_wrap(wrap, dtype, trainers, inferences, versions, bucket_mb))
        cases.append({"dtype": dtype, "trainers": trainers, "inferences": inferences,
                      "methods": {wrap: pooled(runs[wrap]) for wrap in WRAPS}})
    targets = []
    for c in cases:
        where = f"{c['dtype']} {c['trainers']}->{c['inferences']}"
        ddp, fsdp = c["methods"]["ddp"], c["methods"]["fsdp"]
        for what, key in (("version (go to every rank on it)", "seconds_per_version"),
                          ("send (the slowest trainer rank's)", "send_seconds_per_version")):
            ratio = fsdp[key] / ddp[key]
            targets.append({"name": f"{where} fsdp / ddp seconds per {what}", "value": ratio, "want": "<= 1",
                            "met": ratio <= 1})
        for m in c["methods"]["fsdp"]["memory"]:
            value = m["peak_beyond_start"] / m["bound"]
            targets.append({"name": f"{where} fsdp trainer rank {m['rank']} peak beyond its start / (shard + send buffers)",
                            "value": value, "want": f"<= 1 (+{SLACK_BYTES >> 20} MiB)", "met": m["within"]})
    return {"model": "GPT-2 (GPT2Config defaults), 124.4M parameters", "versions": versions, "bucket_mb": bucket_mb,
            "cases": cases, "targets": targets}


def table(report: dict) -> str:
    mib = 1 << 20
    jobs = len(ORDER) // len(WRAPS)
    lines = [f"weightsync bench --fsdp: {report['model']}; {jobs} jobs of each ({', '.join(ORDER)}), "
             f"{report['versions'] - 1} timed versions each, buckets of {report['bucket_mb']} MiB; trainer ranks "
             f"publish through weightsync.attach()",
             f"{'dtype':<9} {'ranks':<6} {'trainers':<9} {'s/version':>10} {'send s':>7} {'MB/version':>11} {'held MiB':>9} "
             f"{'buffers':>8} {'model RSS':>10} {'peak':>7}  (MiB beyond the rank's start; the busiest rank)"]
    for c in report["cases"]:
        for wrap, m in c["methods"].items():
            worst = max(m["memory"], key=lambda r: r["peak_beyond_start"])
            lines.append(f"{c['dtype']:<9} {c['trainers']}->{c['inferences']:<3} {wrap:<9} {m['seconds_per_version']:>10.3f} "
                         f"{m['send_seconds_per_version']:>7.3f} {m['bytes_per_version'] / 1e6:>11.1f} "
                         f"{worst['held_bytes'] / mib:>9.0f} {worst['buffer_bytes'] / mib:>8.0f} "
                         f"{worst['model_rss'] / mib:>10.0f} {worst['peak_beyond_start'] / mib:>7.0f}")
    for t in report["targets"]:
        lines.append(f"target {t['name']}: {t['value']:.2f} (want {t['want']}) -> {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(dtypes: list[str], trainers: int, inferences: int, versions: int, bucket_mb: int, as_json: bool,
         chart: str | None = None) -> int:
    report = run(dtypes, trainers, inferences, versions, bucket_mb)
    print(json.dumps(report, indent=2) if as_json else table(report), flush=True)
    if chart:
        print(f"bench: chart in {fsdp_chart(report, chart)}", file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------- a trainer rank (the job's command)


def trainer_rank(wrap: str, versions: int, out: Path) -> int:
    """Build the model as `wrap` says, attach, publish `versions` versions, write the figures."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env://, as the pod's environment gives it
    rank = dist.get_rank()
    ctx = WorkerContext.from_environ()
    model = build(ctx.job.model, device="meta")  # the code is loaded, no weight exists yet
    if wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():  # each block its own shard group, then the rest
            if type(module).__name__ in (model._no_split_modules or []):
                fully_shard(module)
        fully_shard(model)
    start = proc_status("VmRSS")

    def held_tensors():  # what this rank holds of every parameter
        return [p.to_local() if wrap == "fsdp" else p for p in model.parameters()]

    model.to_empty(device="cpu")  # only this rank's shards (fsdp), or the whole model (ddp)
    if wrap == "ddp":
        model.tie_weights()  # to_empty gave the tied output embedding storage of its own
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in held_tensors():
            t.normal_(0, 0.02, generator=generator)
    held = sum(t.nbytes for t in held_tensors())
    wrapped = model if wrap == "fsdp" else torch.nn.parallel.DistributedDataParallel(model)
    model_rss = proc_status("VmRSS")
    reset_peak_rss()
    sends = []
    with weightsync.attach(wrapped) as sync:
        for v in range(versions):
            if v:
                with torch.no_grad():  # what a version changes: every weight, in place
                    for t in held_tensors():
                        t.mul_(1.0 + 1e-3)
            sends.append(sync.publish(step=v).seconds)
        figures = {"rank": rank, "start_rss": start, "model_rss": model_rss, "peak_rss": proc_status("VmHWM"),
                   "held_bytes": held, "buffer_bytes": sync.buffer_bytes, "sends": sends}
    (out / f"{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(trainer_rank(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])))
