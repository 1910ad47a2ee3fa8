"""A rank killed while the ranks join, in a real job under `weightsync run` (a pod OOM-killed while
it loads its model, or preempted at start): its pod is started again; a trainer (trainers do not
rejoin) fails the job naming it, at once. (An inference rank killed while the ranks join joins
again with its new start and receives the next versions: in test_faults.py's job of inference
kills, which shares the job's start with it. The controller's side in one process:
tests/worker/rendezvous/test_join_restarts.py.)"""
from __future__ import annotations

import io
import json
import os
import signal
import time

import pytest
from support import waits
from support.jobs import make_job, outcome_of, store_of

from weightsync.job import reasons
from weightsync.local.runner import LocalJob, RunFailed
from weightsync.rendezvous.protocol import Keys
from weightsync.roles.controller.driver import TRAINER_SILENT_LIMIT
from weightsync.runtime.faults import PAUSE_DIR_ENV

pytestmark = pytest.mark.slow  # whole jobs as processes: not in `make unit`

REACH = 240.0  # seconds for the pods to come up on a loaded machine
RUN = 240.0  # seconds for the whole job (a hang fails the test here, naming what it waited for)


def joining_job(name: str, trainers: int, inferences: int):
    return make_job(name, trainers=(trainers, 1), inferences=(inferences, 1), steps=2, every=1)  # versions 0, 1, 2


def pod_of(local: LocalJob, role: str, rank: int):
    return next(p for p in local.pods if p.role == role and rank in p.ranks)


def test_a_trainer_killed_while_the_ranks_join_fails_the_job_naming_it(tmp_path):
    """Trainer rank 1 killed once it joined, while inference rank 0 still loads its model: the job
    fails within the trainers' silence limit, naming trainer rank 1, not the rank still joining."""
    job = joining_job("trainer-killed-joining", trainers=2, inferences=1)
    pause = tmp_path / "pause"
    pause.mkdir()
    (pause / "inference-0-joining-v0.arm").touch()  # holds the join open until the job ends
    local = LocalJob(job, tmp_path / "run", {PAUSE_DIR_ENV: str(pause)}, progress=io.StringIO())
    local.start()
    pod = pod_of(local, "trainer", 1)
    store = waits.until("the controller's store", lambda: _store(local), REACH)
    try:
        proof = Keys.published("proof", "trainer", 1, 1)
        waits.until("trainer rank 1 to join", lambda: store.check([proof]), REACH, every=0.01)
        waits.until("inference rank 0 to hold before it joins", (pause / "inference-0-joining-v0.reached").exists, REACH)
        os.killpg(pod.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        store.close()
    failed = outcome_of(local, RUN)
    took = time.monotonic() - killed
    assert isinstance(failed, RunFailed), failed
    completion = json.loads((local.workdir / "status.json").read_text())["completion"]
    # Whichever the controller sees first names the trainer, with one reason: its start again (its
    # pod restarted it), its silence, or its DDP peer's failure that its stop explains.
    assert completion["state"] == "Failed" and completion["versions"] == 0, completion
    assert completion["message"].startswith("trainer rank 1 "), completion
    assert completion["reason"] == reasons.TRAINER_STOPPED, completion
    # the silence limit, a heartbeat, the end of the job and the pods' stop on a busy machine
    assert took < TRAINER_SILENT_LIMIT + 15, f"the job failed {took:.0f}s after trainer rank 1 was killed"


def _store(local: LocalJob):
    try:
        return store_of(local)
    except (OSError, ConnectionError, KeyError):
        return None
