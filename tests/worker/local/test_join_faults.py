"""A rank killed while the ranks join, in real jobs under `weightsync run` (a pod OOM-killed while
it loads its model, or preempted at start): its pod is started again, and the job does not wait
for the start that died. An inference rank joins with its new start and receives every version;
a trainer (trainers do not rejoin) fails the job naming it, at once. (The controller's side in one
process: tests/worker/rendezvous/test_join_restarts.py.)"""
from __future__ import annotations

import io
import json
import os
import signal
import time

import pytest
from support import waits
from support.jobs import assert_nothing_left, check_every_version, make_job, outcome_of, store_of

from weightsync.job import reasons
from weightsync.local.runner import LocalJob, RunFailed
from weightsync.rendezvous.protocol import Keys
from weightsync.roles.controller.driver import TRAINER_SILENT_LIMIT
from weightsync.runtime.faults import DUMP_DIR_ENV, PAUSE_DIR_ENV

pytestmark = pytest.mark.slow  # whole jobs as processes: not in `make unit`

REACH = 240.0  # seconds for the pods to come up on a loaded machine
RUN = 240.0  # seconds for the whole job (a hang fails the test here, naming what it waited for)


def joining_job(name: str, trainers: int, inferences: int):
    return make_job(name, trainers=(trainers, 1), inferences=(inferences, 1), steps=2, every=1)  # versions 0, 1, 2


def pod_of(local: LocalJob, role: str, rank: int):
    return next(p for p in local.pods if p.role == role and rank in p.ranks)


def test_an_inference_rank_killed_while_the_ranks_join_joins_again_and_receives_every_version(tmp_path):
    job = joining_job("killed-joining", trainers=1, inferences=2)  # the other inference rank joins meanwhile
    dump, pause = tmp_path / "dump", tmp_path / "pause"
    dump.mkdir()
    pause.mkdir()
    (pause / "inference-1-joining-v0.arm").touch()
    local = LocalJob(job, tmp_path / "run", {DUMP_DIR_ENV: str(dump), PAUSE_DIR_ENV: str(pause)}, progress=io.StringIO())
    local.start()
    pod = pod_of(local, "inference", 1)
    try:
        waits.until("inference rank 1 to reach its join", (pause / "inference-1-joining-v0.reached").exists, REACH)
        os.killpg(pod.proc.pid, signal.SIGKILL)  # its start counted, its model built, not joined
        (pause / "inference-1-joining-v0.release").touch()
        summary = local.wait(timeout=RUN)
    finally:
        local.stop()
    assert_nothing_left(local)
    assert summary["versions"] == 3 and summary["failed_verifications"] == 0, summary
    assert summary["restarts"] == {pod.name: 1}, summary
    assert check_every_version(dump, job) == 3 * 2  # every version on both inference ranks, bit for bit
    controller = pod_of(local, "controller", 0).log.read_text(errors="replace")
    assert "inference rank 1 started again (start 2) while the ranks joined: it joins with that start" in controller
    assert "taken back at version 0" in pod.log.read_text(errors="replace")


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
    # Whichever the controller sees first names the trainer: its start again (its pod restarted it),
    # its silence, or its DDP peer's failure that its silence explains.
    assert completion["state"] == "Failed" and completion["versions"] == 0, completion
    assert completion["message"].startswith("trainer rank 1 "), completion
    assert completion["reason"] in (reasons.TRAINER_RESTARTED, reasons.RANK_SILENT, reasons.RANK_FAILED), completion
    # the silence limit, a heartbeat, the end of the job and the pods' stop on a busy machine
    assert took < TRAINER_SILENT_LIMIT + 15, f"the job failed {took:.0f}s after trainer rank 1 was killed"


def _store(local: LocalJob):
    try:
        return store_of(local)
    except (OSError, ConnectionError, KeyError):
        return None
