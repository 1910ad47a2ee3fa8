"""The `weightsync` command.

  weightsync run JOB      run a WeightTransferJob as local processes, one per pod; prints a JSON summary
  weightsync worker       what every pod runs: the role comes from the pod's ordinal (environment)
  weightsync plan JOB     the transfer plan of a job: bytes per trainer rank, buckets, balance
  weightsync bench        transfer benchmark: planned M-to-N over TCP vs. broadcast vs. raw sockets
"""

from __future__ import annotations

import argparse
import json
import sys

from .contract import SpecError, load_job

EXIT_SPEC = 2  # a spec, a file or an environment that must be fixed, or a machine too small for the job
EXIT_FAILED = 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightsync", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run a job as local processes, one per pod")
    run.add_argument("job", help="a WeightTransferJob YAML file")
    run.add_argument("--logs", help="keep every pod's log (and its spec and token files) in this directory")
    run.add_argument("--timeout", type=float, help="fail if the job has not finished after this many seconds")
    sub.add_parser("worker", help="run this pod's role (configured by the environment the operator sets)")
    plan = sub.add_parser("plan", help="print the transfer plan of a job")
    plan.add_argument("job", help="a WeightTransferJob YAML file")
    sub.add_parser("bench", help="transfer benchmark (weightsync bench --help for its options)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from .bench import main as bench

        return bench(argv[1:])
    args = parser.parse_args(argv)
    try:
        return {"run": _run, "worker": _worker, "plan": _plan}[args.command](args)
    except SpecError as e:
        print(f"weightsync {args.command}: {e}", file=sys.stderr)
        return EXIT_SPEC


def _run(args) -> int:
    job = load_job(args.job)  # before importing torch: a bad file is refused at once
    from .runner import CannotRunHere, RunFailed, run

    try:
        summary = run(job, logs=args.logs, timeout=args.timeout)
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
    from .roles import main as worker

    return worker()


def _plan(args) -> int:
    job = load_job(args.job)
    from .model import meta_layout
    from .plan import print_plan

    print_plan(job, meta_layout(job.spec["model"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
