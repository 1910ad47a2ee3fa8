"""`weightsync report LOG`: a job's versions as one picture, from the records its controller
already writes (one JSON line per delivered version, the same record as status.transfer).

LOG is what a person has after a job: a local run's log folder (`weightsync run --logs DIR`), or
the controller's log from a cluster (`kubectl logs JOB-controller-0 > controller.log`). The lines
may carry a prefix (a timestamp, the source); the record is the JSON object in them. Three panels
over the version number: seconds per version, with the vLLM servers' stall where there was one;
bytes delivered against bytes on the wire (where delta versions sent less); and the inference
ranks each version reached.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from weightsync.bench.chart import pyplot, save

MARK = '{"event": '


@dataclass(frozen=True)
class Delivered:
    """One delivered version, as the controller recorded it."""

    version: int
    seconds: float
    delivered: int  # bytes the inference ranks received, together
    wire: int  # bytes on the wire (less than delivered for delta versions)
    ranks: int  # inference ranks it reached
    transport: str
    stall: float | None  # seconds the vLLM servers paused to take it, where they did

    @classmethod
    def of(cls, record: dict) -> "Delivered":
        return cls(version=record["version"], seconds=record["seconds"], delivered=record["bytes"],
                   wire=record.get("wireBytes", record["bytes"]), ranks=record.get("inference_ranks", 0),
                   transport=record.get("transport", "?"), stall=record.get("stall_seconds"))


def controller_log(path: Path) -> Path:
    """The controller's log: `path` itself, or the one in a `weightsync run --logs` folder."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise SystemExit(f"weightsync report: {path} is neither a log file nor a folder of logs")
    found = sorted(path.glob("*-controller-0.log")) + sorted(path.glob("logs/*-controller-0.log"))
    if not found:
        raise SystemExit(f"weightsync report: no controller log (*-controller-0.log) in {path} or {path / 'logs'}: "
                         "give the log file itself")
    return found[0]


def read(path: Path) -> list[Delivered]:
    """Every version the log records as delivered, in order (a version sent again to a rank that
    rejoined counts again: it is a round of its own)."""
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            at = line.find(MARK)
            if at < 0:
                continue
            try:
                record = json.loads(line[at:])
            except json.JSONDecodeError:
                continue  # a line that only mentions the mark
            if record.get("event") == "transfer":
                out.append(Delivered.of(record))
    return out


def draw(versions: list[Delivered], title: str, path: str | Path) -> Path:
    plt = pyplot("weightsync report")
    fig, (time_ax, bytes_ax, ranks_ax) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    x = list(range(len(versions)))
    time_ax.bar(x, [v.seconds for v in versions], color="#1f77b4", label="seconds per version")
    stalls = [(i, v.stall) for i, v in zip(x, versions) if v.stall is not None]
    if stalls:
        time_ax.bar([i for i, _ in stalls], [s for _, s in stalls], width=0.4, color="#d62728", label="vLLM stall")
    time_ax.set_ylabel("seconds")
    time_ax.legend(fontsize=8)
    bytes_ax.plot(x, [v.delivered / 1e6 for v in versions], marker="o", label="delivered")
    bytes_ax.plot(x, [v.wire / 1e6 for v in versions], marker="x", label="on the wire")
    bytes_ax.set_ylabel("MB")
    bytes_ax.set_ylim(bottom=0)
    bytes_ax.legend(fontsize=8)
    ranks_ax.step(x, [v.ranks for v in versions], where="mid", color="#2ca02c")
    ranks_ax.set_ylabel("inference ranks reached")
    ranks_ax.set_ylim(0, max(v.ranks for v in versions) + 1)
    ranks_ax.set_xticks(x, [str(v.version) for v in versions])
    ranks_ax.set_xlabel("version (in the order delivered)")
    transports = ", ".join(sorted({v.transport for v in versions}))
    return save(plt, fig, f"{title}: {len(versions)} versions over {transports}", path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="weightsync report", description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="a `weightsync run --logs` folder, or a controller's log file")
    parser.add_argument("--out", default="timeline.png", help="the PNG to write (default timeline.png)")
    args = parser.parse_args(argv)
    if not args.out.endswith(".png"):
        parser.error(f"--out: {args.out!r} does not end in .png")
    log = controller_log(Path(args.log))
    versions = read(log)
    if not versions:
        print(f"weightsync report: {log} records no delivered version (no line with {MARK}\"transfer\", ...}})",
              file=sys.stderr)
        return 1
    title = log.name.removesuffix("-controller-0.log").removesuffix(".log")
    print(f"weightsync report: {len(versions)} versions from {log} in {draw(versions, title, args.out)}")
    return 0
