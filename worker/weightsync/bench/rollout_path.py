"""Where the seconds from a version's publication to its first token go, in the rollout-load bench
(rollout.py): the trainer's publish call, the controller's go, every receiver staged (received,
verified and, with loadAhead, loaded into the second copy: the version is ready to commit), the
resume answered, and the first token generated on it; and the server's silence at the version as
its clients saw it.

The marks come from two clocks on one machine: the bench's own (publication, each token's
arrival) and the controller's round record (its go as the epoch's seconds, then the phases it
timed: transfer, reference digest, staging, the pause call, and the stall from the pause's answer
to the resume's). The disk way has its own marks: the save's start (its publication) and end
(the checkpoint is there to load: its staged) and the reload's calls.

Two stalls are set against the path. The controller's (pause answered to resume answered) is
what the server spends on the version once it stopped; it leaves out the pause call, in which
vLLM's engine stops at its next step and its API process then sleeps 20 ms before it answers (so
that the last outputs go out first), and the step after the resume that makes the first token.
The clients' silence is the time no client got a token around the version: from the last token
the server sent before the first token on the version to that first token. It holds all of the
pause, the controller's calls and one step, and is what a generating client waits.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Protocol

# a version's marks, in the order they happen; each as seconds after its publication
MARKS = ("go", "staged", "paused", "resumed", "first_token")


class Streamed(Protocol):
    chunks: list[tuple[float, int]]

    def first_token_of(self, version: str) -> float | None: ...


def first_token(runs: Iterable[Streamed], version: int) -> float | None:
    """When the first token generated on `version` arrived, over every generation (None where none)."""
    seen = [t for g in runs if (t := g.first_token_of(str(version))) is not None]
    return min(seen) if seen else None


def silence(runs: Iterable[Streamed], at: float) -> float | None:
    """Seconds before `at` in which no generation got a token: from the last chunk that arrived
    before `at` (of any request) to `at` (None where none did)."""
    before = [t for g in runs for t, _ in g.chunks if t < at]
    return at - max(before) if before else None


def round_marks(record: dict) -> dict[str, float]:
    """A version's marks as the epoch's seconds, from the controller's round record: its go, every
    receiver staged, the pause answered, the resume answered."""
    p = record["phases"]
    staged = record["began"] + p["transfer"] + p["verify"] + p.get("staging", 0.0)
    paused = staged + p.get("pause", 0.0)
    return {"go": record["began"], "staged": staged, "paused": paused, "resumed": paused + p.get("stall", 0.0)}


def paths(runs: list[Streamed], published: dict[int, float], marks: dict[int, dict[str, float]]) -> dict[int, dict]:
    """Per version: each mark as seconds after its publication, the seconds from staged to the
    first token (the commit's path) and from the resume to it, and the clients' silence before it."""
    out = {}
    for version, at in published.items():
        got = dict(marks.get(version, {}))
        first = first_token(runs, version)
        if first is not None:
            got["first_token"] = first
        row = {m: round(got[m] - at, 4) for m in MARKS if m in got}
        if first is not None and "staged" in got:
            row["staged_to_first_token"] = round(first - got["staged"], 4)
        if first is not None and "resumed" in got:
            row["resume_to_first_token"] = round(first - got["resumed"], 4)
        if first is not None:
            quiet = silence(runs, first)
            row["silence"] = None if quiet is None else round(quiet, 4)
        out[version] = row
    return out


def medians(rows: Iterable[dict]) -> dict[str, float]:
    """Each figure's median over the versions that have it."""
    rows = list(rows)
    names = sorted({k for r in rows for k, v in r.items() if v is not None})
    return {k: round(statistics.median(r[k] for r in rows if r.get(k) is not None), 4) for k in names}


def timeline(runs: Iterable[Streamed], begin: float, end: float, width: float = 1.0) -> list[float]:
    """Tokens per second in each `width`-second bin from `begin` to `end`."""
    bins = [0] * max(1, int((end - begin) / width))
    for g in runs:
        for t, n in g.chunks:
            k = int((t - begin) / width)
            if 0 <= k < len(bins):
                bins[k] += n
    return [round(b / width, 1) for b in bins]
