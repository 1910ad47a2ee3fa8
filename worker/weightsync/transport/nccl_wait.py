"""Waiting on one point-to-point operation of the nccl transport (nccl.py) within a deadline, such
that a peer that died, a timeout or the backend's error becomes a TransferError naming the peer,
and neither NCCL's wait nor the forming of a communicator can hang the process past it.

Every send and receive is polled until the time left: a deadline per operation on the
sender, per version on the receiver. A timeout, a dead peer, or an error of the backend
becomes a TransferError naming the peer. Polling (work.is_completed(), which also picks up the
communicator's asynchronous error, such as a peer that exited) rather than work.wait(timeout):
NCCL's wait on an operation whose peer died aborts the communicator from inside the wait and
can stay there (seen with NCCL 2.28 and torch 2.11 on an H100: the receiver of a killed
trainer never returned). Only an operation that completed is waited on, which orders the
current stream after it and returns at once; an error it completed with is read from
work.exception() where torch can say it (torch 2.11 cannot: its binding fails to convert the
answer), else the wait raises it, and since the wait may then hang aborting the communicator,
it runs on a helper thread bounded by the deadline.
"""

from __future__ import annotations

import datetime
import re
import time
from typing import Any, Callable

from weightsync.transport.base import TransferError, bounded

# How often a wait looks at its operation: at first often (a header arrives in microseconds),
# then less (a bucket takes milliseconds).
POLL_FIRST, POLL_MOST = 50e-6, 2e-3


def first_line(error: BaseException) -> str:
    """The backend's message, without the source location it starts with."""
    text = str(error).strip() or type(error).__name__
    return re.sub(r"^\[[^\]]*\.(cc|cpp|hpp|h):\d+\]\s*", "", text.splitlines()[0])[:300]


def wait_work(work, deadline: float, peer: str, what: str, poll: bool) -> None:
    """Wait for a point-to-point operation until `deadline`; any failure becomes a
    TransferError naming `peer`. NCCL's operations are polled (see this module's docstring); where
    torch cannot say whether one that completed failed, its wait, which raises the error but may
    first hang aborting the communicator, runs on a helper thread bounded by `deadline`. gloo's
    complete only inside their wait, which keeps its deadline and raises for a dead peer."""
    said = poll_work(work, deadline, peer, what) if poll else True
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError(peer, f"{what} did not complete in time")
    timeout = datetime.timedelta(seconds=left)
    try:
        done = work.wait(timeout) if said else bounded(lambda: work.wait(timeout), left, f"{what} with {peer}")
    except TimeoutError:
        raise TransferError(peer, f"{what} did not complete in time") from None
    except Exception as e:  # noqa: BLE001 - the backend's error (timeout, peer gone, group aborted), named below
        raise TransferError(peer, f"{what} failed: {first_line(e)}") from None
    if done is False:
        raise TransferError(peer, f"{what} did not complete in time")


def poll_work(work, deadline: float, peer: str, what: str) -> bool:
    """Until `work` completed, by `deadline`, without entering the backend's wait; an error it
    completed with is raised here. False where torch cannot say whether it failed: torch 2.11's
    binding of `Work.exception()` cannot convert its answer to Python (TypeError)."""
    pause = POLL_FIRST
    while True:
        try:
            if work.is_completed():
                break
        except Exception as e:  # noqa: BLE001 - the backend's error (peer gone, group aborted), named below
            raise TransferError(peer, f"{what} failed: {first_line(e)}") from None
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError(peer, f"{what} did not complete in time")
        time.sleep(min(pause, left))
        pause = min(2 * pause, POLL_MOST)
    try:
        error = work.exception()
    except TypeError:
        return False
    if error is not None:
        raise TransferError(peer, f"{what} failed: {first_line(error)}")
    return True


def first_frame(operation: Callable[[], Any], deadline: float, peer: str, poll: bool) -> None:
    """The first send or receive between two ranks, which creates their communicator: the call
    itself blocks until the peer gets there too, so it runs on a helper thread, and both the
    call and its completion are bounded by `deadline`."""
    try:
        work = bounded(operation, deadline - time.monotonic(), f"the first frame with {peer}")
    except TimeoutError:
        raise TransferError(peer, "did not meet this rank in time (their communicator never formed)") from None
    wait_work(work, deadline, peer, "the first frame", poll)
