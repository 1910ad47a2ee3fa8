"""How every line of a job's logs starts, in the worker's processes and in the operator alike: the
UTC time to the millisecond (ISO 8601, "2026-11-26T15:04:05.123Z") and its source in brackets (a
role and rank, the controller, a module), so that the logs of many pods read as one story when
they are merged and sorted, and a line says who wrote it wherever it is read. A message of
several lines carries the prefix on each."""

from __future__ import annotations

import datetime
import logging
import sys

STAMP_FORMAT = "%Y-%m-%dT%H:%M:%S"


def stamp(at: float | None = None) -> str:
    """`at` (seconds since the epoch; now when None) as the lines' UTC time."""
    moment = (datetime.datetime.now(datetime.timezone.utc) if at is None else
              datetime.datetime.fromtimestamp(at, datetime.timezone.utc))
    return f"{moment.strftime(STAMP_FORMAT)}.{moment.microsecond // 1000:03d}Z"


def line(source: str, message: str, at: float | None = None) -> str:
    """The log line(s) of `message` from `source`."""
    prefix = f"{stamp(at)} [{source}] "
    return "\n".join(prefix + part for part in (message.splitlines() or [""]))


def say(source: str, message: str) -> None:
    """Write a log line to stderr, at once."""
    print(line(source, message), file=sys.stderr, flush=True)


class Formatter(logging.Formatter):
    """Python logging's records as lines of the same shape: the logger's name is the source, the
    level leads the message, and a record about a Kubernetes object (kopf's `k8s_ref`) names it."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, dict) and ref.get("name"):
            where = f"{ref['namespace']}/{ref['name']}" if ref.get("namespace") else ref["name"]
            message = f"[{where}] {message}"
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        if record.stack_info:
            message = f"{message}\n{self.formatStack(record.stack_info)}"
        return line(record.name, f"{record.levelname} {message}", at=record.created)


def configure(level: int = logging.WARNING) -> None:
    """Every handler of the root logger (one to stderr when it has none) writes these lines."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
        root.setLevel(level)
    for handler in root.handlers:
        handler.setFormatter(Formatter())


def restyle(package: str) -> int:
    """The root logger's handlers that `package` installed (kopf's, in the operator) write these
    lines; how many it found (none where that package set up no log: a test that imports it)."""
    ours = [h for h in logging.getLogger().handlers if type(h).__module__.split(".")[0] == package]
    for handler in ours:
        handler.setFormatter(Formatter())
    return len(ours)
