"""Where a delta version's time goes, rank by rank: what `weightsync bench --links` reports beside
a delta version's seconds (docs/benchmarks.md, "Where a delta's time goes").

Each rank reports its seconds per phase for every timed version (transfer/phases.py): a trainer
its cast, hash (of the new bytes), compare (with what it sent last, keeping the new bytes),
encode (the changed elements, compressed) and wait (for the wire and the peers' verdicts after
its last bucket); an inference rank its apply (decompress and patch) and hash (of the new
bytes); both their total, and cpu: the CPU seconds of all of the rank's threads meanwhile. A phase
is summed over the threads that run it, so phases that overlap may add up to more than the total;
all ranks' cpu over the cores is the least a version can take on the machine. `wire` is the time
the patches need on the busiest link: the larger of what the busiest trainer sends and what each
inference rank receives, over the rate.
"""

from __future__ import annotations

import json
import statistics

ORDER = ("cast", "hash", "compare", "encode", "keep", "apply", "wait", "total", "cpu")


def breakdown(store, trainers: int, inferences: int, versions: int, bits: float | None) -> dict:
    """{rank name: {phase: median seconds over the versions}}, and with links `wire`: {"seconds":
    median, "per_version": [...]}."""
    out: dict = {}
    for role, n in (("trainer", trainers), ("inference", inferences)):
        for r in range(n):
            per = [json.loads(store.get(f"delta/{v}/phases/{role}/{r}")) for v in range(1, versions + 1)]
            names = sorted({k for p in per for k in p}, key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER))
            out[f"{role} {r}"] = {k: round(statistics.median(p.get(k, 0.0) for p in per), 4) for k in names}
    out["cpu"] = {"seconds": round(sum(p["cpu"] for name, p in out.items() if "cpu" in p), 4)}
    if bits:
        wire = []
        for v in range(1, versions + 1):
            sent = [int(store.get(f"delta/{v}/wire/{t}")) for t in range(trainers)]
            wire.append(max(max(sent), sum(sent) / inferences) * 8 / bits)
        out["wire"] = {"seconds": round(statistics.median(wire), 4), "per_version": [round(w, 4) for w in wire]}
    return out


def render(phases: dict) -> list[str]:
    """The breakdown as lines of the bench's table."""
    lines = []
    for name, figures in phases.items():
        if name in ("wire", "cpu"):
            continue
        lines.append(f"{'':<17}delta {name}: " + ", ".join(f"{k} {s:.3f}s" for k, s in figures.items()))
    if "cpu" in phases:
        lines.append(f"{'':<17}delta cpu, all ranks: {phases['cpu']['seconds']:.3f}s")
    if "wire" in phases:
        lines.append(f"{'':<17}delta wire (the patches over the busiest link): {phases['wire']['seconds']:.3f}s")
    return lines
