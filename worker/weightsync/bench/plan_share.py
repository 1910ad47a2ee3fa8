"""What the published plan costs one rank: the seconds and the memory from the plan's JSON to
what the rank uses of it (a trainer: the buckets it sends; an inference rank: what it receives from
whom, its local layout, its buffer's size), as the trainer API and the verifying receiver derive
them: from the whole plan, or from the header and the rank's own share where the plan is published
in shares (plan/shares.py). A trainer keeps its buckets as arrays there; what a send's walk over
them as objects costs is measured apart (bucket_walk_seconds). Run in a process of its own
(`python -m weightsync.bench.plan_share ROLE RANK FILE [SHARE]`), so that what it allocates is the
rank's and nothing else's: the simulated ranks of `weightsync bench --control-plane` share one
process and one plan. No torch here, as a rank's planner has none.
"""

from __future__ import annotations

import json
import sys
import time
import tracemalloc

from weightsync.job import TRAINER
from weightsync.plan.rank_plan import RankPlan
from weightsync.plan.sliced_plan import plan_from_json


def own_share(text: str, role: str, rank: int, share: str | None = None) -> int:
    """Derive what `role` rank `rank` uses of the plan `text` (with its `share`, where published in
    shares); returns its bytes (sent or received)."""
    plan = plan_from_json(text) if share is None else RankPlan.from_json(text, share)
    if role == TRAINER:
        buckets = plan.buckets_of(rank)
        return int(buckets.lengths.sum()) if share is not None else sum(b.length for b in buckets)
    if share is not None:
        plan.local_of(rank)
    plan.expected_for(rank)
    plan.scatter_for(rank)
    return plan.bytes_for(rank)


def measure(text: str, role: str, rank: int, share: str | None = None) -> dict:
    """The seconds of own_share, and the peak of what it allocates (MiB, Python's and numpy's
    allocations as tracemalloc counts them), from a second run: tracing slows it down."""
    start = time.perf_counter()
    nbytes = own_share(text, role, rank, share)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    own_share(text, role, rank, share)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    out = {"role": role, "rank": rank, "seconds": round(seconds, 4), "memory_mib": round(peak / 2**20, 1),
           "plan_json_bytes": len(text) + len(share or ""), "share_bytes": nbytes}
    if role == TRAINER and share is not None:  # its buckets are kept as arrays: a send walks them as objects
        buckets = RankPlan.from_json(text, share).buckets_of(rank)
        start = time.perf_counter()
        out["buckets"] = sum(1 for _ in buckets)
        out["bucket_walk_seconds"] = round(time.perf_counter() - start, 4)
    return out


def main(argv: list[str]) -> int:
    role, rank, path = argv[0], int(argv[1]), argv[2]
    with open(path) as f:
        text = f.read()
    share = None
    if len(argv) > 3:
        with open(argv[3]) as f:
            share = f.read()
    print(json.dumps(measure(text, role, rank, share)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
