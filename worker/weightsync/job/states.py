"""The states of a job, in one vocabulary: the phases of status.phase (as the CRD's enum has
them), the types of the conditions the operator owns, and the two states a job ends in.

The operator computes a phase and conditions, the job's controller ends a job in a state that
becomes status.completion.state, and the ranks, the local runner and the trainer API read that
state back. Each spells these words from here, so none can drift from the CRD (a phase missing
from one list once counted suspended and queued jobs as pending). A job's reasons, which name
why a condition is what it is, are in reasons.py.
"""

from __future__ import annotations

# status.phase, as the CRD's enum has it: Pending until the operator first sets one.
PENDING = "Pending"
QUEUED = "Queued"  # a job that names a Kueue queue and is not admitted (or was evicted)
RUNNING = "Running"
SUSPENDED = "Suspended"  # spec.suspend is true
SUCCEEDED = "Succeeded"
FAILED = "Failed"
PHASES = (PENDING, QUEUED, RUNNING, SUSPENDED, SUCCEEDED, FAILED)

# The states a job ends in (status.completion.state, the controller's end record): also phases.
END_STATES = (SUCCEEDED, FAILED)


def ended(state: str | None) -> bool:
    """Whether `state` (a phase, or a completion's state) is one a job ends in."""
    return state in END_STATES


def exit_code(state: str | None) -> int:
    """A rank process's exit status for the job's end `state`: 0 only for Succeeded."""
    return 0 if state == SUCCEEDED else 1


class Condition:
    """The types of the conditions the operator owns, in the order the status lists them."""

    NETWORK_RESOLVED = "NetworkResolved"
    CHILDREN_CREATED = "ChildrenCreated"
    SUSPENDED = "Suspended"
    ADMITTED = "Admitted"  # only for a job that names a Kueue queue
    READY = "Ready"
    COMPLETED = "Completed"
    FAILED = "Failed"


CONDITIONS = (Condition.NETWORK_RESOLVED, Condition.CHILDREN_CREATED, Condition.SUSPENDED, Condition.ADMITTED,
              Condition.READY, Condition.COMPLETED, Condition.FAILED)
