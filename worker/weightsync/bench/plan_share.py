"""What the published plan costs one rank: the seconds and the memory from the plan's JSON to
what the rank uses of it (a trainer: the buckets it sends; an inference rank: what it receives from
whom, its local layout, its buffer's size), as the trainer API and the verifying receiver derive
them. Run in a process of its own (`python -m weightsync.bench.plan_share ROLE RANK FILE`), so
that what it allocates is the rank's and nothing else's: the simulated ranks of `weightsync bench
--control-plane` share one process and one plan. No torch here, as a rank's planner has none.
"""

from __future__ import annotations

import json
import sys
import time
import tracemalloc

from weightsync.job import TRAINER
from weightsync.plan.sliced_plan import plan_from_json


def own_share(text: str, role: str, rank: int) -> int:
    """Derive what `role` rank `rank` uses of the plan `text`; returns its bytes (sent or received)."""
    plan = plan_from_json(text)
    if role == TRAINER:
        return sum(b.length for b in plan.buckets_of(rank))
    plan.expected_for(rank)
    plan.scatter_for(rank)
    return plan.bytes_for(rank)


def measure(text: str, role: str, rank: int) -> dict:
    """The seconds of own_share, and the peak of what it allocates (MiB, Python's and numpy's
    allocations as tracemalloc counts them), from a second run: tracing slows it down."""
    start = time.perf_counter()
    nbytes = own_share(text, role, rank)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    own_share(text, role, rank)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"role": role, "rank": rank, "seconds": round(seconds, 4), "memory_mib": round(peak / 2**20, 1),
            "plan_json_bytes": len(text), "share_bytes": nbytes}


def main(argv: list[str]) -> int:
    role, rank, path = argv[0], int(argv[1]), argv[2]
    with open(path) as f:
        text = f.read()
    print(json.dumps(measure(text, role, rank)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
