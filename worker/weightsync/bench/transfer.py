"""`weightsync bench`: how fast one weight version moves from trainer ranks to inference ranks.

For a GPT-2 124M-shaped model (transformers' default GPT2Config, random init, nothing
downloaded), at each dtype and each trainers->inference shape, one set of real processes runs
these methods, several versions each, and the median seconds per version is reported:
  weightsync  the planned M-to-N transfer over TCP: VersionSender/VersionReceiver, the code the
              trainer and inference roles run (cast pipelined by bucket, checksums verified);
  delta       (--delta, --links) the same, each version sent as a delta against the one before,
              which every inference rank holds (transfer.delta);
  broadcast   what most RL frameworks do: torch.distributed (gloo) broadcast of every tensor,
              cast to the dtype, from one trainer rank to the inference ranks;
  ceiling     the same bytes, with the same trainer->inference assignment, pushed through plain
              sockets between the same processes with nothing else done.
A version's time runs from the first trainer starting to the last inference rank holding it.
GB/s counts the bytes delivered to all inference ranks.

By default every process talks over loopback: that measures CPU copies, not a network. With
--links RATE every rank runs in its own network namespace with a link of RATE each way (netns.py),
and every method is compared with the speed of light of the shape: the larger of what the busiest
trainer must send and what the busiest inference rank must receive, over RATE. Delta versions need
versions that differ as training makes them differ: the benchmark first trains the model
(trained.py) and sends those versions, printing the fraction of elements each one changed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time

from weightsync.bench import delta_phases
from weightsync.bench.chart import chart
from weightsync.bench.fsdp import main as shards_bench
from weightsync.bench.netns import Links, rate_bits, unavailable
from weightsync.bench.rank_process import build_model, run
from weightsync.bench.rollout import WAYS
from weightsync.bench.rollout import main as rollout_bench
from weightsync.bench.scrape import main as scrape_bench
from weightsync.bench.trained import train
from weightsync.bench.vllm import STEP as VLLM_STEP
from weightsync.bench.vllm import main as vllm_bench
from weightsync.job.files import output_problem
from weightsync.model.flat import FlatLayout, cast_name
from weightsync.plan.segments import make_plan

METHODS = ("weightsync", "broadcast", "ceiling")
WITH_DELTA = ("weightsync", "delta", "broadcast", "ceiling")  # weightsync first: delta is checked after it
LINK_SHAPES = "1x1,1x2,2x2,4x2,2x4"


# ---------------------------------------------------------------- the parent: cases and the report


def run_case(case: dict) -> dict:
    import multiprocessing

    import torch.distributed as dist

    host = case["links"]["store_host"] if case.get("links") else "127.0.0.1"
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=run, args=(role, r, case, store.port), name=f"{role}-{r}")
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


def speed_of_light(plan, bits: float) -> float:
    """Seconds a version needs at least over links of `bits` per second each way: the busiest
    trainer sends its share to every inference rank, every inference rank receives all of it."""
    busiest_sender = max(plan.bytes_by_trainer()) * plan.inferences
    return max(busiest_sender, plan.version_bytes) * 8 / bits


def summarize(case: dict, store) -> dict:
    trainers, inferences, methods = case["trainers"], case["inferences"], case["methods"]
    results = {(role, r): json.loads(store.get(f"result/{role}/{r}"))
               for role, n in (("trainer", trainers), ("inference", inferences)) for r in range(n)}
    version_bytes = case["version_bytes"]
    plan = make_plan(FlatLayout.from_json(case["layout"]), trainers, inferences, case["bucket_mb"] << 20)
    out = {}
    for m in methods:
        senders = [r for r in range(trainers) if store.check([f"{m}/1/start/{r}"])]
        seconds = []
        for v in range(1, case["versions"] + 1):
            start = min(float(store.get(f"{m}/{v}/start/{r}")) for r in senders)
            end = max(float(store.get(f"{m}/{v}/end/{i}")) for i in range(inferences))
            seconds.append(end - start)
        median = statistics.median(seconds)
        out[m] = {"seconds_per_version": median, "gbps": version_bytes * inferences / median / 1e9,
                  "seconds": [round(s, 4) for s in seconds]}
    for m in methods:
        out[m]["ratio_to_ceiling"] = out["ceiling"]["seconds_per_version"] / out[m]["seconds_per_version"]
        out[m]["speedup_over_broadcast"] = out["broadcast"]["seconds_per_version"] / out[m]["seconds_per_version"]
    summary = {"dtype": case["dtype"], "trainers": trainers, "inferences": inferences, "versions": case["versions"],
               "bucket_mb": case["bucket_mb"], "depth": case["depth"], "plan_balance": plan.balance(),
               "verified": all(results[("inference", i)].get("verified") for i in range(inferences)), "methods": out}
    if case.get("links"):
        light = speed_of_light(plan, case["links"]["bits"])
        summary["speed_of_light"] = light
        for m in methods:
            out[m]["ratio_to_light"] = light / out[m]["seconds_per_version"]
        # the broadcast's own bound: one sender sends the whole version to every inference rank
        summary["broadcast_one_sender_bound"] = version_bytes * inferences * 8 / case["links"]["bits"]
    if "delta" in methods:
        d = out["delta"]
        d["wire_fraction"] = [sum(int(store.get(f"delta/{v}/wire/{t}")) for t in range(trainers)) / (version_bytes * inferences)
                              for v in range(1, case["versions"] + 1)]
        d["speedup_over_weightsync"] = out["weightsync"]["seconds_per_version"] / d["seconds_per_version"]
        d["changed"] = case["trained"]["changed"][case["dtype"]][:case["versions"]]
        d["phases"] = delta_phases.breakdown(store, trainers, inferences, case["versions"],
                                             case["links"]["bits"] if case.get("links") else None)
        summary["trainer_kept_bytes"] = max(results[("trainer", t)]["kept_bytes"] for t in range(trainers))
    else:
        peak = max(results[("inference", i)]["peak_rss_beyond_model"] for i in range(inferences))
        summary["memory"] = {
            "version_bytes": version_bytes,
            "inference_peak_rss_beyond_model": peak,
            "inference_peak_over_version": peak / version_bytes,
            "inference_limit_over_version": 2.5,
            "inference_peak_rss_beyond_model_all_methods":
                max(results[("inference", i)]["peak_rss_beyond_model_all_methods"] for i in range(inferences)),
            "trainer_send_buffer_bytes": max(results[("trainer", t)]["send_buffer_bytes"] for t in range(trainers)),
            "trainer_send_buffer_limit": case["depth"] * (case["bucket_mb"] << 20),
        }
    return summary


def render(report: dict) -> str:
    lines = [f"weightsync bench: {report['model']}; {report['machine']}"]
    if report.get("training"):
        t = report["training"]
        lines.append(f"versions from training: {t['steps']} AdamW steps at lr {t['learning_rate']:g}, batch {t['batch']} x "
                     f"{t['seq_len']} tokens, one version per step ({t['seconds']:.0f}s); elements changed per version: "
                     + "; ".join(f"{d} {', '.join(f'{c:.2%}' for c in cs)}" for d, cs in t["changed"].items()))
    links = report.get("links")
    if links:
        lines.append(f"{'dtype':<9} {'ranks':<6} {'method':<11} {'s/version':>10} {'GB/s':>7} {'light (s)':>10} "
                     f"{'vs light':>9} {'vs full':>8}  notes")
    else:
        lines.append(f"{'dtype':<9} {'ranks':<6} {'method':<11} {'s/version':>10} {'GB/s':>7} {'vs ceiling':>11} "
                     f"{'vs broadcast':>13}")
    for c in report["cases"]:
        for m in c["methods"]:
            r = c["methods"][m]
            head = (f"{c['dtype']:<9} {c['trainers']}->{c['inferences']:<3} {m:<11} {r['seconds_per_version']:>10.3f} "
                    f"{r['gbps']:>7.2f}")
            if links:
                vs_full = f"{r['speedup_over_weightsync']:>7.2f}x" if m == "delta" else f"{'':>8}"
                notes = ""
                if m == "delta":
                    notes = (f"wire {statistics.median(r['wire_fraction']):.2%} of the version's bytes; "
                             f"changed {statistics.median(r['changed']):.2%} of the elements (medians)")
                elif m == "broadcast":
                    notes = f"one sender sending each rank all of it: {c['broadcast_one_sender_bound']:.2f}s"
                lines.append(f"{head} {c['speed_of_light']:>10.3f} {r['ratio_to_light']:>9.2f} {vs_full}  {notes}")
            else:
                extra = f"   {r['speedup_over_weightsync']:.2f}x weightsync" if m == "delta" else ""
                lines.append(f"{head} {r['ratio_to_ceiling']:>11.2f} {r['speedup_over_broadcast']:>12.2f}x{extra}")
        if "memory" in c:
            mem = c["memory"]
            lines.append(f"{'':<17}memory: inference peak RSS beyond the model "
                         f"{mem['inference_peak_rss_beyond_model'] / 2**20:.0f} MiB "
                         f"= {mem['inference_peak_over_version']:.2f} x version "
                         f"({mem['version_bytes'] / 2**20:.0f} MiB; limit 2.5); "
                         f"trainer send buffers {mem['trainer_send_buffer_bytes'] / 2**20:.0f} MiB (limit depth x bucket = "
                         f"{mem['trainer_send_buffer_limit'] / 2**20:.0f} MiB); verified: {c['verified']}")
        else:
            lines += delta_phases.render(c["methods"]["delta"]["phases"])
            lines.append(f"{'':<17}delta: each trainer keeps {c['trainer_kept_bytes'] / 2**20:.0f} MiB of the last version "
                         f"sent; verified (digest and every byte, full and delta): {c['verified']}")
    for t in report["targets"]:
        lines.append(f"target {t['name']}: {t['value']:.2f} (want {t['want']}) -> {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def targets(cases: list[dict], links: bool) -> list[dict]:
    out = []
    if links:
        by_dtype: dict[str, dict] = {}
        for c in cases:
            shape, where = (c["trainers"], c["inferences"]), f"{c['dtype']} {c['trainers']}->{c['inferences']}"
            by_dtype.setdefault(c["dtype"], {})[shape] = c
            w = c["methods"]["weightsync"]
            if shape in ((2, 2), (4, 2)):
                out.append({"name": f"{where} weightsync / speed of light", "value": w["ratio_to_light"], "want": ">= 0.9",
                            "met": w["ratio_to_light"] >= 0.9})
            d = c["methods"].get("delta")
            if d is not None and c["dtype"] != "float32":
                out.append({"name": f"{where} delta speedup over weightsync (changed {statistics.median(d['changed']):.2%})",
                            "value": d["speedup_over_weightsync"], "want": ">= 3", "met": d["speedup_over_weightsync"] >= 3})
            elif d is not None:  # float32: every element changes every step, so every bucket goes whole
                out.append({"name": f"{where} delta / weightsync time when everything changed",
                            "value": d["seconds_per_version"] / w["seconds_per_version"], "want": "<= 1.05",
                            "met": d["seconds_per_version"] <= 1.05 * w["seconds_per_version"]})
        for dtype, shapes in by_dtype.items():
            # one sender sends everything: its ratio at M trainers -> 2 falls from M=1's as M grows
            ratios = {m: shapes[(m, 2)]["methods"]["broadcast"]["ratio_to_light"] for m in (1, 2, 4) if (m, 2) in shapes}
            if 1 in ratios and len(ratios) > 1:
                worst = max(r for m, r in ratios.items() if m > 1) / ratios[1]
                text = ", ".join(f"{m}->2 {r:.2f}" for m, r in ratios.items())
                out.append({"name": f"{dtype} broadcast / speed of light, M trainers -> 2 ({text}), M>1 over M=1",
                            "value": worst, "want": "< 0.75", "met": worst < 0.75})
        return out
    for c in cases:
        if (c["trainers"], c["inferences"]) != (2, 2):
            continue
        w = c["methods"]["weightsync"]
        where = f"{c['dtype']} 2->2"
        out += [
            {"name": f"{where} ratio to ceiling", "value": w["ratio_to_ceiling"], "want": ">= 0.7",
             "met": w["ratio_to_ceiling"] >= 0.7},
            {"name": f"{where} speedup over broadcast", "value": w["speedup_over_broadcast"], "want": ">= 1.5",
             "met": w["speedup_over_broadcast"] >= 1.5},
        ]
        mem = c.get("memory")
        if mem:
            out += [
                {"name": f"{where} inference peak RSS / version", "value": mem["inference_peak_over_version"], "want": "<= 2.5",
                 "met": mem["inference_peak_over_version"] <= 2.5},
                {"name": f"{where} trainer send buffers / (depth x bucket)",
                 "value": mem["trainer_send_buffer_bytes"] / mem["trainer_send_buffer_limit"], "want": "<= 1",
                 "met": mem["trainer_send_buffer_bytes"] <= mem["trainer_send_buffer_limit"]},
            ]
    return out


def shape_of(text: str, least_trainers: int = 1) -> tuple[int, int] | None:
    """TRAINERSxINFERENCE as its two rank counts, or None where it is not one."""
    m, _, n = text.partition("x")
    if m.isdigit() and n.isdigit() and int(m) >= least_trainers and int(n) > 0:
        return int(m), int(n)
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of `weightsync bench` (argv without the subcommand). Prints the table, or
    with --json one JSON object; returns the exit status (0 when every case ran)."""
    parser = argparse.ArgumentParser(prog="weightsync bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated transfer dtypes")
    parser.add_argument("--shapes", help=f"comma-separated TRAINERSxINFERENCE rank counts (default 2x2,1x1; with "
                                         f"--links {LINK_SHAPES})")
    parser.add_argument("--versions", type=int, help="timed versions per method, after one warm-up (default 7; with --links 5)")
    parser.add_argument("--bucket-mb", type=int, default=64, help="bucket size in MiB (the CRD's default transfer.bucketMB)")
    parser.add_argument("--depth", type=int, default=2, help="send buffers per trainer rank (pipeline depth)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a silent peer fails the run")
    parser.add_argument("--links", metavar="RATE", help="every rank in its own network namespace with a link of RATE "
                                                        "each way (a tc rate: 1gbit, 2gbit); needs root")
    parser.add_argument("--delta", action="store_true", help="also time delta versions, of versions from training "
                                                             "(always with --links)")
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate of the training that makes the versions "
                                                               "(RL fine-tuning uses 1e-7 to 1e-5)")
    parser.add_argument("--train-batch", type=int, default=2, help="sequences per training step")
    parser.add_argument("--train-seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--chart", metavar="FILE.png", help="also draw the report: GB/s per method and shape against "
                                                           "the speed of light or the ceiling; with --vllm where a "
                                                           "version's seconds go against the disk reload, with --fsdp "
                                                           "seconds and memory per trainer rank (needs matplotlib)")
    parser.add_argument("--vllm", metavar="PYTHON", help="instead: vLLM servers as the receivers, weightsync's backend "
                                                         "against reloading a checkpoint from disk (PYTHON runs vLLM)")
    parser.add_argument("--rollout-load", action="store_true",
                        help="with --vllm: instead, what an update costs a server that is generating (inflight "
                             "finish, keep, keep with loadAhead, a disk reload), against the same load with no update")
    parser.add_argument("--ways", help=f"with --rollout-load: comma-separated ways to run (default {','.join(WAYS)})")
    parser.add_argument("--logs", metavar="DIR", help="with --rollout-load: keep each job's logs under DIR/WAY")
    parser.add_argument("--step", type=float, metavar="SECONDS",
                        help=f"with --vllm: seconds between a version served and the next one made, as a training "
                             f"step between versions (default {VLLM_STEP:g})")
    parser.add_argument("--fsdp", action="store_true", help="instead: trainer ranks holding FSDP2 shards against DDP "
                                                            "replicas, publishing through the trainer API (seconds per "
                                                            "version, trainer memory); --shapes one TRAINERSxINFERENCE")
    parser.add_argument("--scrape", metavar="SECONDS", type=float, help="instead: a DDP job (bfloat16) timed quiet "
                                                                        "and with every pod's /metrics read every "
                                                                        "SECONDS (--shapes one TRAINERSxINFERENCE)")
    args = parser.parse_args(argv)
    if args.versions is not None and args.versions < 1:
        parser.error(f"--versions: {args.versions} times nothing; give 1 or more timed versions")
    if args.chart and args.scrape:
        parser.error("--chart: --scrape prints a table only")
    if args.chart:
        problem = chart_problem(args.chart)
        if problem:  # the path, not the arguments: one line, without the usage
            print(f"weightsync bench: --chart: {problem}", file=sys.stderr)
            return 2
    if args.step is not None and not args.vllm:
        parser.error("--step: only the --vllm bench waits between versions")
    if args.rollout_load and (not args.vllm or args.step is not None):
        parser.error("--rollout-load: give it with --vllm PYTHON (and no --step: a version comes every 10 s)")
    ways = args.ways.split(",") if args.ways else None
    if (ways or args.logs) and not args.rollout_load or any(w not in WAYS for w in ways or []):
        parser.error(f"--ways, --logs: with --rollout-load only, the ways among {', '.join(WAYS)}")
    if args.rollout_load:
        return rollout_bench(args.vllm, args.json, args.chart, ways, args.logs)
    if args.vllm:
        step = VLLM_STEP if args.step is None else args.step
        if step < 0:
            parser.error(f"--step: {step} is not a number of seconds (0 or more)")
        return vllm_bench(args.vllm, args.json, args.chart, step)
    dtypes = args.dtypes.split(",")
    for d in dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            parser.error(f"--dtypes: {d!r} is not one of float32, bfloat16, float16")
    if args.scrape is not None:
        if args.scrape <= 0:
            parser.error(f"--scrape: {args.scrape} is not a positive number of seconds")
        shape = shape_of(args.shapes or "2x2")
        if shape is None:
            parser.error(f"--scrape --shapes: {args.shapes!r} is not one TRAINERSxINFERENCE")
        return scrape_bench(args.scrape, *shape, (args.versions or 7) + 1, args.bucket_mb, args.json)
    if args.fsdp:
        shape = shape_of(args.shapes or "2x2", least_trainers=2)
        if shape is None:
            parser.error(f"--fsdp --shapes: {args.shapes!r} is not one TRAINERSxINFERENCE with at least 2 trainer ranks")
        return shards_bench(dtypes, *shape, (args.versions or 7) + 1, args.bucket_mb, args.json, args.chart)
    signal.signal(signal.SIGTERM, _exit)  # so that what the run made (files, namespaces) is removed

    shapes = []
    for s in (args.shapes or (LINK_SHAPES if args.links else "2x2,1x1")).split(","):
        shape = shape_of(s)
        if shape is None:
            parser.error(f"--shapes: {s!r} is not TRAINERSxINFERENCE, for example 2x2")
        shapes.append(shape)
    versions = args.versions or (5 if args.links else 7)
    if versions < 1:
        parser.error("--versions: at least 1")
    bits = None
    if args.links:
        try:
            bits = rate_bits(args.links)
        except ValueError as e:
            parser.error(f"--links: {e}")
        why = unavailable()
        if why:
            print(f"weightsync bench: --links cannot run here: {why}", file=sys.stderr)
            return 2
    delta = args.delta or bool(args.links)

    import torch
    import transformers

    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    params = sum(p.numel() for p in meta.parameters())
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
               + (f"every rank in its own network namespace, links of {args.links} each way (tbf)" if args.links
                  else "loopback TCP")
               + f", float32 -> bfloat16 cast by {cast_name()}")
    report = {"model": f"GPT-2 (GPT2Config defaults), {params / 1e6:.1f}M parameters, {len(list(meta.parameters()))} tensors",
              "machine": machine, "links": args.links}
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as directory:
        trained = None
        if delta:
            print(f"bench: training {versions} steps for the versions ...", file=sys.stderr, flush=True)
            trained = train(build_model("float32"), versions + 1, directory, learning_rate=args.lr, batch=args.train_batch,
                            seq_len=args.train_seq, dtypes=tuple(dtypes))
            report["training"] = {"steps": versions, "learning_rate": args.lr, "batch": args.train_batch,
                                  "seq_len": args.train_seq, "seconds": trained.seconds, "losses": trained.losses,
                                  "changed": trained.changed}
        cases = run_cases(args, shapes, dtypes, versions, meta, trained, bits)
    report["cases"] = cases
    report["targets"] = targets(cases, bool(args.links))
    print(json.dumps(report, indent=2) if args.json else render(report))
    if args.chart:
        print(f"bench: chart in {chart(report, args.chart)}", file=sys.stderr, flush=True)
    return 0


def chart_problem(path: str) -> str | None:
    """Why --chart cannot be honoured, found before anything runs, or None."""
    if not path.endswith(".png"):
        return f"{path!r} does not end in .png"
    problem = output_problem(path)  # a loop of links, a folder or a pipe there, no folder: said before the run
    if problem:
        return f"cannot write {path}: {problem}"
    try:
        import matplotlib  # noqa: F401 - drawn at the end; missing, the run would be lost
    except ImportError:
        return "needs matplotlib: pip install 'weightsync[examples]'"
    return None


def run_cases(args, shapes, dtypes, versions, meta, trained, bits) -> list[dict]:
    """Every (dtype, shape) case; with links, inside one set of namespaces made for the run."""
    import contextlib

    scope = contextlib.nullcontext(None)
    if args.links:
        scope = Links(args.links, max(m + n for m, n in shapes))
    cases = []
    with scope as links:
        for dtype in dtypes:
            layout = FlatLayout.from_named_tensors(meta.named_parameters(), dtype)
            for m, n in shapes:
                case = {"dtype": dtype, "trainers": m, "inferences": n, "versions": versions, "bucket_mb": args.bucket_mb,
                        "depth": args.depth, "timeout": args.timeout, "version_bytes": layout.total_bytes,
                        "layout": layout.to_json(), "methods": WITH_DELTA if trained else METHODS}
                if trained is not None:
                    case["trained"] = {"directory": trained.directory, "layout": trained.layout.to_json(),
                                       "count": trained.count, "learning_rate": trained.learning_rate,
                                       "changed": trained.changed}
                if links is not None:
                    case["links"] = {"namespaces": links.namespaces, "addresses": links.addresses,
                                     "store_host": links.host_address, "bits": bits}
                print(f"bench: {dtype} {m}->{n} ...", file=sys.stderr, flush=True)
                cases.append(run_case(case))
    return cases


def _exit(signum, _frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
