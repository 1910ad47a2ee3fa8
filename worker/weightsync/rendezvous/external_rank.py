"""An external rank's way in: a process the user started (job/join.py's three variables in its
environment) reaches the controller's store, proves the job's token there exactly as the job's
own pods do, and reads the job the controller published (Keys.JOB, signed with the token) instead
of a mounted spec file. Every refusal is one line that says what to fix: the controller cannot be
reached (and what this process waited for), the token or the job id is not the controller's, the
role is not external in this job, the rank is not one of the job's.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Callable

from weightsync.job import ANNOTATION_NETWORK_MODE, Job, SpecError, WorkerContext, load_job
from weightsync.job.join import Join, JoinEnv
from weightsync.job.token import same
from weightsync.rendezvous.channel import STORE_TIMEOUT, Channel, connect_store
from weightsync.rendezvous.proofs import job_mac
from weightsync.rendezvous.protocol import Keys
from weightsync.rendezvous.store.table import StoreRefused

CONTROLLER_WAIT = 600.0  # seconds a joining process waits for the controller's store to accept it
SAY_EVERY = 30.0  # seconds between two lines saying it is still waiting


class JoinError(RuntimeError):
    """This process cannot join the job; the message, one line, says why and what to fix."""


def _say(message: str) -> None:
    print(f"[weightsync] {message}", file=sys.stderr, flush=True)


def connect(join: Join, timeout: float = CONTROLLER_WAIT, say: Callable[[str], None] = _say) -> Channel:
    """A client of the controller's store, authenticated with the join's token and job id; waits
    up to `timeout` seconds for the controller to accept connections, saying so every SAY_EVERY."""
    deadline = time.monotonic() + timeout
    told = False
    while True:
        left = deadline - time.monotonic()
        try:
            return Channel(connect_store(join.controller_host, join.store_port, join.token, join.job_id,
                                         max(min(left, SAY_EVERY), 0.001), call_timeout=STORE_TIMEOUT))
        except StoreRefused:
            raise JoinError(f"the controller at {join.controller} refused this process: the job token in "
                            f"{JoinEnv.TOKEN} is not job {join.job_id}'s (or that controller runs another job than "
                            f"{JoinEnv.JOB_ID} names)") from None
        except ConnectionError as e:
            if time.monotonic() >= deadline:
                raise JoinError(f"waited {timeout:.0f}s for the controller of job {join.job_id} to accept connections "
                                f"at {join.controller} ({JoinEnv.CONTROLLER}); is the job running, and is that address "
                                f"reachable from here? ({e})") from None
            if not told:
                say(f"waiting (up to {timeout:.0f}s) for the controller of job {join.job_id} at {join.controller}")
                told = True


def _read(channel: Channel, join: Join, timeout: float) -> tuple[Job, str]:
    """The job the controller published and its network mode, checked to be signed with the token
    and to be the job the join names."""
    try:
        channel.wait([Keys.JOB_MAC], f"the controller of job {join.job_id} to publish the job", timeout)
    except TimeoutError as e:
        raise JoinError(str(e)) from None
    text = channel.get(Keys.JOB)
    if not same(channel.get(Keys.JOB_MAC).decode(), job_mac(join.token, join.job_id, text)):
        raise JoinError(f"the job published at {join.controller} is not signed with the token in {JoinEnv.TOKEN} "
                        f"for job {join.job_id}")
    obj = json.loads(text)
    job = load_job(obj, namespace=join.namespace, strict=False)
    if job.identity != join.job_id:
        raise JoinError(f"the controller at {join.controller} runs job {job.identity}, not {join.job_id} "
                        f"({JoinEnv.JOB_ID})")
    return job, obj["metadata"].get("annotations", {}).get(ANNOTATION_NETWORK_MODE, "tcp")


def fetch_job(join: Join, timeout: float = CONTROLLER_WAIT, say: Callable[[str], None] = _say) -> tuple[Job, Channel]:
    """The job `join` names, as its controller published it, and the authenticated store client
    that read it (JoinError, one line, where that cannot be)."""
    channel = connect(join, timeout, say)
    job, _ = _read(channel, join, timeout)
    return job, channel


def joined_context(join: Join, role: str, rank: int | Callable[[Job, Channel], int], timeout: float = CONTROLLER_WAIT,
                   say: Callable[[str], None] = _say) -> tuple[WorkerContext, Channel]:
    """The WorkerContext of external `role` rank `rank` of the job `join` names, and the store
    client that read the job. `rank` may be a function of the job and that client (which may
    claim a rank through the store, or refuse with a SpecError or a JoinError). JoinError where the
    role is not external in the job or the rank is not one of its; the client is closed then."""
    channel = connect(join, timeout, say)
    try:
        job, mode = _read(channel, join, timeout)
        world = job.layout.world_size(role)
        if not job.pods(role).external:
            raise JoinError(f"job {job.identity}'s {role}s are not external (spec.{role}.external is false): its own "
                            f"pods hold every {role} rank; set spec.{role}.external: true to start them yourself")
        if callable(rank):
            try:
                rank = rank(job, channel)
            except SpecError as e:
                raise JoinError("; ".join(e.problems)) from None
        if not 0 <= rank < world:
            raise JoinError(f"{role} rank {rank} is not one of job {job.identity}'s {world} {role} ranks "
                            f"(spec.{role}: replicas x procsPerPod)")
        try:
            return WorkerContext.from_join(join, job, role, rank, network_mode=mode), channel
        except SpecError as e:
            raise JoinError("; ".join(e.problems)) from None
    except BaseException:
        channel.store.close()
        raise
