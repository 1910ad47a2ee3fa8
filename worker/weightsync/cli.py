"""The `weightsync` command.

  weightsync run JOB      run a WeightTransferJob as local processes, one per pod; prints a JSON summary
  weightsync run JOB --join-env FILE
                          the same, but for an external role's pods: FILE says how your processes join
  weightsync worker       what every pod runs: the role comes from the pod's ordinal (environment)
  weightsync plan JOB     the transfer plan of a job: bytes per trainer rank, buckets, balance
  weightsync plan --simulate MODEL [--trainers 256 --fsdp 256 --inference 8xTP16 --nic 400gbit]
                          the slice plan of a large model on a large cluster, from shapes alone:
                          balance, busiest NIC, projected seconds and the speed of light
  weightsync bench        transfer benchmark: planned M-to-N over TCP vs. broadcast vs. raw sockets
  weightsync bench --gpu  the GPU data plane: nccl M-to-N vs. broadcast, ipc vs. a device copy,
                          the GPU cast and checksum vs. a device copy
  weightsync bench --control-plane --ranks N [--model kimi-k2 --inference 4xEP32]
                          the control plane's cost: the real controller and N simulated ranks
  weightsync bench --chart FILE.png
                          the transfer benchmark, drawn as well
  weightsync report LOG   a job's versions as one PNG timeline, from its controller's log
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from weightsync import __version__
from weightsync.job import QUEUE_LABEL, SpecError, load_job, logline, read_job_file

EXIT_SPEC = 2  # a spec, a file or an environment that must be fixed, or a machine too small for the job
EXIT_FAILED = 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightsync", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    parser.add_argument("--version", action="version", version=f"weightsync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run a job as local processes, one per pod")
    run.add_argument("job", help="a WeightTransferJob YAML file")
    run.add_argument("--logs", help="keep every pod's log (and its spec and token files) in this directory")
    run.add_argument("--timeout", type=float, help="fail if the job has not finished after this many seconds")
    run.add_argument("--vllm-python", help="spec.inference.engine vllm: the Python that runs vLLM (with vLLM and "
                                           "weightsync installed; default: this one)")
    run.add_argument("--share-gpus", action="store_true",
                     help="every pod that asks for GPUs gets the same ones (training and inference on one GPU)")
    run.add_argument("--join-env", metavar="FILE",
                     help="a job with an external role (spec.trainer.external, spec.inference.external): start every "
                          "pod but that role's, and write to FILE the variables your processes join the job with "
                          "(KEY=value lines, for `set -a; . FILE; set +a`) once they can")
    sub.add_parser("worker", help="run this pod's role (configured by the environment the operator sets)")
    plan = sub.add_parser("plan", help="print the transfer plan of a job, or simulate one at scale")
    plan.add_argument("job", nargs="?", help="a WeightTransferJob YAML file")
    plan.add_argument("--simulate", metavar="MODEL",
                      help="plan a model from its shapes instead of a job: kimi-k2, deepseek-v3, llama-3-70b, "
                           "or the path of a config.json")
    plan.add_argument("--trainers", type=int, default=256, help="trainer GPUs (default 256)")
    plan.add_argument("--fsdp", type=int, help="FSDP degree (with --simulate default all trainers; with a job file "
                                               "default 1, the built-in trainer's whole replicas; less than the "
                                               "trainer ranks is HSDP, 1 is DDP)")
    plan.add_argument("--fsdp-dim", choices=("0", "auto"), default="0",
                      help="dim FSDP2 shards: 0 (fully_shard's default) or auto (dim 1 where dim 0 does not "
                           "split evenly, as torchtitan shards MoE experts)")
    plan.add_argument("--inference", default="8xTP16", help="inference replicas x TP degree (default 8xTP16), and "
                      "for a mixture of experts served with expert parallelism x EP degree (2xTP8xEP8, 4xEP32)")
    plan.add_argument("--nic", default="400gbit", help="NIC rate per GPU, each way (default 400gbit)")
    plan.add_argument("--dtype", default="bfloat16", help="transfer dtype (default bfloat16); with --simulate also fp8 or "
                      "int8: the linear layers' weights quantized with their scales, the rest bfloat16")
    plan.add_argument("--bucket-mb", type=int, default=64, help="largest piece in MiB (default 64)")
    sub.add_parser("bench", help="transfer benchmark (weightsync bench --help for its options)", add_help=False)
    sub.add_parser("report", help="a job's versions as one PNG timeline, from its controller's log "
                                  "(weightsync report --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        from weightsync.bench.timeline import main as report

        return report(argv[1:])
    if argv[:1] == ["bench"] and "--control-plane" in argv:
        from weightsync.bench.control_plane import main as bench_control_plane

        return bench_control_plane(argv[1:])
    if argv[:1] == ["bench"] and "--gpu" in argv:
        from weightsync.bench.gpu import main as bench_gpu

        return bench_gpu(argv[1:])
    if argv[:1] == ["bench"]:
        from weightsync.runtime.rank import without_triton

        without_triton()  # every mode but --gpu computes on the CPU: no triton, nor its "leaked" lines at exit
        from weightsync.bench.transfer import main as bench

        return bench(argv[1:])
    args = parser.parse_args(argv)
    try:
        return {"run": _run, "worker": _worker, "plan": _plan}[args.command](args)
    except SpecError as e:
        print(f"weightsync {args.command}: {e}", file=sys.stderr)
        return EXIT_SPEC


def _run(args) -> int:
    job = load_job(args.job)  # before importing torch: a bad file is refused at once
    if job.suspended:
        print(f"weightsync run: {args.job} has spec.suspend: true, so the job runs nothing; set it to false (or "
              "leave it out) to run it", file=sys.stderr)
        return EXIT_SPEC
    queue = ((read_job_file(args.job).get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL)
    if queue:
        print(f"weightsync run: metadata.labels[{QUEUE_LABEL}] ({queue}): not applicable locally (Kueue admits the "
              "job in a cluster); it runs now", file=sys.stderr)
    from weightsync.local.preflight import CannotRunHere
    from weightsync.local.runner import RunFailed, run

    try:
        summary = run(job, logs=args.logs, timeout=args.timeout, vllm_python=args.vllm_python, share_gpus=args.share_gpus,
                      join_env=args.join_env)
    except CannotRunHere as e:
        print(f"weightsync run: {e}", file=sys.stderr)
        return EXIT_SPEC
    except RunFailed as e:
        print(f"weightsync run: failed: {e}", file=sys.stderr)
        if e.summary is not None:
            print(json.dumps(e.summary), flush=True)
        return EXIT_FAILED
    print(json.dumps(summary), flush=True)
    return 0


def _worker(args) -> int:
    from weightsync.roles import main as worker

    logline.configure()  # the libraries' warnings too carry the time and their source
    return worker()


def _plan(args) -> int:
    if args.simulate is not None:
        return _simulate(args)
    if args.job is None:
        print("weightsync plan: give a job file, or --simulate MODEL", file=sys.stderr)
        return EXIT_SPEC
    job = load_job(args.job)
    try:
        plan = job_plan(job, args.fsdp)
    except ValueError as e:
        print(f"weightsync plan: {e}", file=sys.stderr)
        return EXIT_SPEC
    print(plan.table())
    return 0


def job_plan(job, fsdp: int | None = None):
    """The plan the controller computes for `job` (job.spec.Job), from the spec alone: its model
    built on the meta device, its trainer ranks holding every tensor whole (the built-in trainer,
    DDP) or, with `fsdp`, FSDP2 shards of that degree, and its tensor-parallel ranks the slices of
    the model's own TP plan, over the transport its ranks would choose on this machine."""
    from weightsync.job import INFERENCE, TRAINER
    from weightsync.model.build import build, layout_of
    from weightsync.model.lora import check_targets
    from weightsync.model.quant import BlockCut
    from weightsync.plan.job import fsdp_holdings, inference_needs, make_job_plan
    from weightsync.roles.tp_engine import needs_of
    from weightsync.transport import capabilities_of, resolve_transport

    model = build(job.model, dtype="float32", device="meta", load_weights=False)
    if job.model.lora is not None:
        check_targets(model, job.model.lora)
    layout = layout_of(model, job.model.dtype, job.model.quantization)
    holdings = fsdp_holdings(layout, job.layout.world_size(TRAINER), fsdp or 1)
    try:
        ep = job.inference.runs_vllm and job.inference.vllm.expert_parallel
        needs = inference_needs(job.layout, layout, lambda r: needs_of(model, layout, job.layout.tp_group(r), r, ep,
                                                                          job.model.quantization))
    except ValueError as e:
        if not job.inference.runs_vllm or isinstance(e, BlockCut):  # vLLM refuses a cut block itself
            raise
        # a vLLM worker reads its slices from vLLM's model when it starts (vllm_backend/shards.py);
        # this preview has only transformers' TP plan, which vLLM's sharding can go beyond
        raise ValueError(f"{e} (as transformers' TP plan shards the model: the job's vLLM workers take their slices "
                         "from vLLM itself when they start, which replicates KV heads where the tensor-parallel size "
                         "exceeds them, so the job may run where this preview cannot plan it)") from None
    transport, _ = resolve_transport(job.transfer.transport, job.network.mode)
    can = capabilities_of(transport)
    return make_job_plan(layout, holdings, job.layout.world_size(INFERENCE), job.transfer.bucket_bytes,
                         needs, transport=transport, scatters=can.scatters, range_limit=can.range_limit)


def _simulate(args) -> int:
    from weightsync.model.flat import ITEMSIZE
    from weightsync.model.quant import FORMATS

    try:
        if args.job is not None:
            raise ValueError("give either a job file or --simulate MODEL, not both")
        quantization = args.dtype if args.dtype in FORMATS else None  # its weights quantized, the rest bfloat16
        if args.dtype not in ITEMSIZE and quantization is None:
            raise ValueError(f"--dtype {args.dtype!r}: use one of {', '.join([*ITEMSIZE, *FORMATS])}")
        if args.bucket_mb < 1:
            raise ValueError(f"--bucket-mb {args.bucket_mb}: give at least 1")
        from weightsync.plan.simulate import Topology, parse_inference, report, run

        replicas, tp, ep = parse_inference(args.inference)
        bits = nic_bits(args.nic)
        topo = Topology(args.trainers, args.fsdp or args.trainers, replicas, tp, bits,
                        "bfloat16" if quantization else args.dtype, args.bucket_mb << 20, args.fsdp_dim, ep, quantization)
        result = run(args.simulate, topo)
    except ValueError as e:
        print(f"weightsync plan: {e}", file=sys.stderr)
        return EXIT_SPEC
    print(result["plan"].table())
    print(report(result, topo))
    return 0


# A NIC's rate as data sheets write it: 400G, 400Gb, 400Gbps, 400Gb/s (bits, decimal), or as tc does (400gbit)
NIC_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmg])(?:b|bps|b/s)?$", re.IGNORECASE)


def nic_bits(text: str) -> float:
    """Bits per second of --nic; ValueError saying which forms it takes."""
    from weightsync.bench.netns import rate_bits

    m = NIC_RATE.match(text.strip())
    try:
        return rate_bits(f"{m.group(1)}{m.group(2)}bit" if m else text)
    except ValueError as e:
        raise ValueError(f"--nic: {e} (or as a NIC's data sheet writes it: 400G, 400Gbps, 400Gb/s)") from None


if __name__ == "__main__":
    sys.exit(main())
