"""Who gets a version as a delta, and against which version: decided by the controller alone.

Before every round the controller looks at what each receiver holds (roster.Seat.holds: the last
version it applied and verified, or None when it holds none: it is new, or its process started
again and rejoined) and names, in the round it announces with the go, the receivers that get the
version as patches and the version they are patched against. That is the version the trainers
sent last and kept: the one before, for a version's first sending (when the final version is sent
again, to ranks that do not hold it, they kept that one, so it goes whole). Every delta.fullEvery
versions every receiver gets a whole version, and a receiver that holds anything else always does. Trainers patch only against the version they kept
themselves, and a receiver that cannot apply a patch gets the bucket whole in the same round, so a
wrong word here costs bytes, never correctness.
"""

from __future__ import annotations

from typing import Mapping

from weightsync.job import Delta

PATCHING_TRANSPORTS = ("tcp",)


def delta_in_effect(delta: Delta, transport: str, sliced: bool = False) -> tuple[bool, str]:
    """Whether versions go as deltas with this transport and plan, and why (every rank decides alike)."""
    if not delta.enabled:
        return False, "spec.transfer.delta.enabled is false: every version goes whole"
    if sliced:
        return False, ("spec.transfer.delta.enabled is true, but the inference ranks hold tensor-parallel slices, "
                       "which go whole: every version goes whole")
    if transport not in PATCHING_TRANSPORTS:
        return False, (f"spec.transfer.delta.enabled is true, but the {transport} transport carries no patches: "
                       "every version goes whole")
    return True, f"delta versions on: each goes as a delta to the inference ranks that hold the one before; " \
                 f"every {delta.full_every}th version goes whole"


def bases(delta: Delta, version: int, again: int, holds: Mapping[int, int | None]) -> dict[int, int | None]:
    """For each receiver ({rank: the version it holds, or None}), the version its copy of
    `version` (sent again for the again-th time when again > 0) is a delta against, or None for
    a whole version."""
    kept = version if again else version - 1  # what the trainers sent last, and kept
    whole = not delta.enabled or (not again and version % delta.full_every == 0)
    return {r: None if whole or held != kept else held for r, held in holds.items()}
