"""The errors of the job contract: a job the API server would refuse (SpecError), said on one line,
and the one root of every failure that ends a job (JobFailed), which carries its reason.

A failure names its reason itself (job/reasons.py: the Failed condition's reason), so the job's
controller reads it from the failure, never from the failure's type; an error that is no failure
of the job's (a ValueError from a bug) is reported as what it is, not as the user's mistake.
"""

from __future__ import annotations

import re

from weightsync.job import reasons


class SpecError(ValueError):
    """A job that the API server would refuse; the message says what to fix, on one line (it is
    printed by the CLI and becomes a condition's message in a cluster)."""

    def __init__(self, problems: list[str]):
        # a problem that came out empty (an error without a message, quoted) still says there is one
        self.problems = [re.sub(r"\s*\n\s*", " ", p).strip() or "refused without a reason (a bug in weightsync)"
                         for p in problems] or ["refused without a reason (a bug in weightsync)"]
        super().__init__("invalid WeightTransferJob: " + "; ".join(self.problems))


class JobFailed(Exception):
    """The job cannot go on: the message says why (naming the rank at fault), `reason` how (a
    name from job/reasons.py). Each kind of failure declares its reason as a class attribute; a
    raise may name another one."""

    reason: str = reasons.WORKERS_FAILED

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class TimedOut(JobFailed, TimeoutError):
    """Ranks did not join, send or apply within their deadline (the message says which)."""

    reason = reasons.TIMED_OUT


def failure_of(error: BaseException) -> tuple[str, str]:
    """(reason, message) of the job failed of `error`: a failure's own reason; a timeout's for the
    standard library's timeouts; ControllerError for any other error (a ValueError of a bug, not
    the user's mistake), whose message then names the error's type."""
    if isinstance(error, JobFailed):
        return error.reason, str(error)
    if isinstance(error, TimeoutError):
        return reasons.TIMED_OUT, str(error)
    return reasons.CONTROLLER_ERROR, f"{type(error).__name__}: {error} (a bug in weightsync, not in the job)"
