"""`weightsync report LOG`: a job's versions as one picture, from the records its controller
already writes (one JSON line per delivered version, the same record as status.transfer).

LOG is what a person has after a job: a local run's log folder (`weightsync run --logs DIR`), or
the controller's log from a cluster (`kubectl logs JOB-controller-0 > controller.log`). The lines
may carry a prefix (a timestamp, the source); the record is the JSON object in them. Three panels
over the version number: seconds per version, with the vLLM servers' stall where there was one;
bytes delivered against bytes on the wire (where delta versions sent less); and the inference
ranks each version reached. Past MAX_BARS versions, consecutive versions are drawn in buckets (the
mean seconds and bytes, the longest stall, the fewest ranks reached), so that an endless job's log
still makes one readable picture. A log that is not a controller's, or a record that is not one
of its own, is refused in one line that names the line. A line longer than any record (a
gigabyte of output on one line) is passed over without being held, and an --out that cannot be
written is refused before the log is read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from weightsync.bench.chart import pyplot, save
from weightsync.job.files import FileProblem, bounded_lines, check_regular, output_problem, reason, size_text

MARK = '{"event": '
MAX_BARS = 400  # versions drawn one by one; more are drawn in buckets of consecutive versions
MAX_TICKS = 20  # version numbers written under the last panel
MAX_LINE = 1 << 20  # bytes of a log line read; a longer one is no record of a controller's


class ReportError(SystemExit):
    """What cannot be drawn, in one line (the command's exit message)."""

    def __init__(self, message: str):
        super().__init__(f"weightsync report: {message}")


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
        """The version `record` says was delivered; ValueError naming the field that is not what a
        controller writes."""
        def number(key: str, default=None, whole: bool = False):
            value = record.get(key, default)
            kinds = (int,) if whole else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < 0:
                raise ValueError(f"its {key!r} is {value!r}, not a {'whole ' if whole else ''}number of 0 or more")
            return value

        stall = record.get("stall_seconds")
        transport = record.get("transport", "?")
        return cls(version=number("version", whole=True), seconds=number("seconds"),
                   delivered=number("bytes", whole=True), wire=number("wireBytes", record.get("bytes"), whole=True),
                   ranks=number("inference_ranks", 0, whole=True), transport=transport if isinstance(transport, str) else "?",
                   stall=None if stall is None else number("stall_seconds"))


def controller_log(path: Path) -> Path:
    """The controller's log: `path` itself, or the one in a `weightsync run --logs` folder."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise ReportError(f"{path} is neither a log file nor a folder of logs")
    found = sorted(path.glob("*-controller-0.log")) + sorted(path.glob("logs/*-controller-0.log"))
    if not found:
        raise ReportError(f"no controller log (*-controller-0.log) in {path} or {path / 'logs'}: give the log file itself")
    return found[0]


def read(path: Path) -> list[Delivered]:
    """Every version the log records as delivered, in order (a version sent again to a rank that
    rejoined counts again: it is a round of its own). A line longer than MAX_LINE is passed over
    unread (a controller's record is a few hundred bytes), said once on stderr."""
    out, long = [], []
    try:
        check_regular(path, None, "a controller's log")
        with open(path, "rb") as f:
            for number, raw in bounded_lines(f, MAX_LINE):
                if raw is None:
                    long.append(number)
                    continue
                line = raw.decode(errors="replace")
                at = line.find(MARK)
                if at < 0:
                    continue
                try:
                    record = json.loads(line[at:])
                except (ValueError, RecursionError):
                    continue  # a line that only mentions the mark
                if record.get("event") != "transfer":
                    continue
                try:
                    out.append(Delivered.of(record))
                except ValueError as e:
                    raise ReportError(f"{path}, line {number}: a transfer record that is not a controller's ({e}); "
                                      "give the log of a weightsync controller, as written") from None
    except FileProblem as e:
        raise ReportError(str(e)) from None
    except OSError as e:
        raise ReportError(f"{path} cannot be read: {reason(e)}") from None
    if long:
        print(f"weightsync report: {path}: passed over {len(long)} line(s) longer than {size_text(MAX_LINE)} (the first: "
              f"line {long[0]}); a controller's records are a few hundred bytes", file=sys.stderr)
    return out


def bucketed(versions: list[Delivered], most: int = MAX_BARS) -> tuple[list[Delivered], int]:
    """`versions` in at most `most` buckets of consecutive versions, and the versions per bucket
    (1: as they are). A bucket is named by its first version: the mean seconds and bytes, the
    longest stall, the fewest ranks reached."""
    size = max(1, math.ceil(len(versions) / most))
    if size == 1:
        return versions, 1
    out = []
    for start in range(0, len(versions), size):
        group = versions[start:start + size]
        stalls = [v.stall for v in group if v.stall is not None]
        out.append(Delivered(version=group[0].version, seconds=sum(v.seconds for v in group) / len(group),
                             delivered=sum(v.delivered for v in group) // len(group),
                             wire=sum(v.wire for v in group) // len(group), ranks=min(v.ranks for v in group),
                             transport=group[0].transport, stall=max(stalls) if stalls else None))
    return out, size


def draw(delivered: list[Delivered], title: str, path: str | Path) -> Path:
    plt = pyplot("weightsync report")
    versions, size = bucketed(delivered)
    fig, (time_ax, bytes_ax, ranks_ax) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    x = list(range(len(versions)))
    marker = {"marker": "o"} if size == 1 and len(versions) <= 100 else {}
    time_ax.bar(x, [v.seconds for v in versions], color="#1f77b4", label="seconds per version")
    stalls = [(i, v.stall) for i, v in zip(x, versions) if v.stall is not None]
    if stalls:
        time_ax.bar([i for i, _ in stalls], [s for _, s in stalls], width=0.4, color="#d62728", label="vLLM stall")
    time_ax.set_ylabel("seconds")
    time_ax.legend(fontsize=8)
    bytes_ax.plot(x, [v.delivered / 1e6 for v in versions], label="delivered", **marker)
    bytes_ax.plot(x, [v.wire / 1e6 for v in versions], label="on the wire", **({"marker": "x"} if marker else {}))
    bytes_ax.set_ylabel("MB")
    bytes_ax.set_ylim(bottom=0)
    bytes_ax.legend(fontsize=8)
    ranks_ax.step(x, [v.ranks for v in versions], where="mid", color="#2ca02c")
    ranks_ax.set_ylabel("inference ranks reached")
    ranks_ax.set_ylim(0, max(v.ranks for v in versions) + 1)
    ticks = x[::max(1, math.ceil(len(x) / MAX_TICKS))]
    ranks_ax.set_xticks(ticks, [str(versions[i].version) for i in ticks])
    ranks_ax.set_xlabel("version (in the order delivered)" if size == 1 else
                        f"version (in the order delivered; each bar {size} versions from the one named: mean seconds "
                        "and bytes, longest stall, fewest ranks)")
    transports = ", ".join(sorted({v.transport for v in delivered}))
    try:
        return save(plt, fig, f"{title}: {len(delivered)} versions over {transports}", path)
    except OSError as e:
        raise ReportError(f"cannot write {path}: {reason(e)}") from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="weightsync report", description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="a `weightsync run --logs` folder, or a controller's log file")
    parser.add_argument("--out", default="timeline.png", help="the PNG to write (default timeline.png)")
    args = parser.parse_args(argv)
    if not args.out.endswith(".png"):
        parser.error(f"--out: {args.out!r} does not end in .png")
    problem = output_problem(args.out)
    if problem:  # said before the log is read, not after
        raise ReportError(f"cannot write {args.out}: {problem}")
    log = controller_log(Path(args.log))
    versions = read(log)
    if not versions:
        print(f"weightsync report: {log} records no delivered version (no line with {MARK}\"transfer\", ...}})",
              file=sys.stderr)
        return 1
    title = log.name.removesuffix("-controller-0.log").removesuffix(".log")
    print(f"weightsync report: {len(versions)} versions from {log} in {draw(versions, title, args.out)}")
    return 0
