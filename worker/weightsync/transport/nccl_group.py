"""Forming the nccl transport's process group (nccl.py) on the job's store, such that NCCL's own
watchdog does not end the process.

One group spans every trainer and inference rank: trainers are ranks 0..M-1, inference ranks
M..M+N-1. It is a group of its own, built on the job's store under PREFIX, beside the trainers'
DDP group. NCCL's watchdog would end the process on a timeout or error: the group's timeout is
set well past the transfer timeout (WATCHDOG_FACTOR), and its error handling to abort the
communicators without killing the process, so that the transport reports the failure itself.
Over gloo every pair of ranks connects while the group is built, so a rank that never gets there
is named.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Callable

from weightsync.transport.base import TransferError
from weightsync.transport.nccl_wait import first_line

PREFIX = "weightsync-nccl"
# The group's own timeout, which NCCL's watchdog acts on, in transfer timeouts: the transport
# gives up, and aborts the group, long before.
WATCHDOG_FACTOR = 4
# TORCH_NCCL_ASYNC_ERROR_HANDLING for the transport's group: on an error, abort the
# communicators and let the waiting call raise, without tearing the process down.
CLEAN_UP_ONLY = "2"


@contextlib.contextmanager
def _env(name: str, value: str):
    """`name` set to `value` while a group is built (the backend reads it then)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def form_group(store, rank: int, world: int, timeout: float, host: bool, name: Callable[[int], str]):
    """The group of the job's `world` ranks, this process being `rank`: gloo's where `host`, else
    NCCL's. Where gloo's does not form within `timeout` seconds, a TransferError names the ranks
    that did not join (`name` names a rank of the group)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(PREFIX, store)
    if host:
        # gloo connects every pair while the group is built: every rank of the job must get here
        store.set(f"{PREFIX}/joined/{rank}", "1")
        try:
            return dist.ProcessGroupGloo(prefixed, rank, world, datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            missing = [r for r in range(world) if not store.check([f"{PREFIX}/joined/{r}"])]
            names = ", ".join(name(r) for r in missing) or "none"
            raise TransferError(name(missing[0]) if missing else "nccl",
                                f"the group did not form within {timeout:g}s (not joined: {names}): "
                                f"{first_line(e)}") from None
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=timeout * WATCHDOG_FACTOR + 60)
    with _env("TORCH_NCCL_ASYNC_ERROR_HANDLING", CLEAN_UP_ONLY):
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
