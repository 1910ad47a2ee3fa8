"""Trainers that resume from their checkpoint: examples/train_with_weightsync.py as the job's
spec.trainer.command (two trainer pods, DDP) with --checkpoint, run by `weightsync run`. A trainer
pod is killed (kill -9: an OOM kill, a lost node) between two versions; the local kubelet starts it
again, the other trainer's process ends as the trainers resume, both load the last checkpoint, and
the job goes on: the version numbers strictly increase and go on from the last one delivered,
every version is verified on every inference rank, and the final one equals the weights the
script saved. A trainer killed while a version is on its way drops that version (no inference rank
takes any of it) and the trainers resume the same way. Both in one job: a kill of each kind, one
after the other."""

from __future__ import annotations

import signal
import sys
import time

import pytest
from support.faulty import Faulty
from support.jobs import assert_nothing_left
from support.user_script import CONFIG, EXAMPLE, check_final_version, example_args

from weightsync.job import API_VERSION, KIND, load_job
from weightsync.publisher.sync import Resumed

pytestmark = pytest.mark.slow  # whole jobs as processes: not in `make unit`


def resuming_job(tmp_path, name: str):
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
        "spec": {"model": {"config": CONFIG, "dtype": "bfloat16"},
                 "trainer": {"replicas": 2, "gpusPerProc": 0, "command": [sys.executable, EXAMPLE],
                             "args": example_args(tmp_path, "--checkpoint", str(tmp_path / "checkpoint")),
                             "attachTimeoutSeconds": 240},
                 "inference": {"replicas": 2, "gpusPerProc": 0},
                 "transfer": {"bucketMB": 1, "transport": "tcp", "timeoutSeconds": 60},
                 "network": {"mode": "tcp"}}})


def test_a_trainer_killed_mid_version_then_between_versions_resumes_each_time_and_the_job_succeeds(tmp_path):
    """One job, trainer pod 1 killed twice: first while its share of version 1 is half sent
    (version 1 is dropped, and the trainers resume from step 0's checkpoint and publish step 3 as
    version 2), then between versions 2 and 3 (versions 0 and 2 delivered, step 3 saved: they
    resume from step 3's checkpoint). Each resume is the other's outcome too: the job goes on."""
    job = resuming_job(tmp_path, "resume")
    faulty = Faulty(tmp_path, job, "trainer-1-mid-send-v1")  # its share of version 1 half sent
    try:
        faulty.strike(faulty.pod("trainer", 1), signal.SIGKILL)
        struck = faulty.strike(faulty.pod("trainer", 1), signal.SIGKILL, point="trainer-1-before-ready-v3")
        summary = faulty.end()
        took = time.monotonic() - struck
    finally:
        faulty.local.stop()
    print(f"killed before version 3: the job succeeded {took:.1f}s later")
    assert summary["versions"] == 3 and summary["failed_verifications"] == 0, summary
    records = [(t["version"], t["step"]) for t in faulty.local.transfers]
    # version 1 dropped; on from the last delivered, the steps as published
    assert records == [(0, 0), (2, 3), (3, 6)], records
    check_final_version(tmp_path, job, [0, 2, 3])
    for rank in (0, 1):
        assert not (tmp_path / "dump" / f"inference-{rank}-v1.pt").exists(), "a dropped version was switched to"
    assert faulty.status()["rejoins"]["trainer"] == 2, faulty.status()
    controller = faulty.log(faulty.local.pods[0])
    assert "while version 1 was on its way: version 1 is dropped" in controller, controller[-3000:]
    assert "every trainer rank resumed; version 2 comes next" in controller
    assert "the trainers resume from their checkpoint (resume 2); the inference ranks serve version 2" in controller
    assert "every trainer rank resumed; version 3 comes next" in controller
    for rank in (0, 1):
        log = faulty.log(faulty.pod("inference", rank))
        assert "version 1 was dropped on its way" in log and "the model stays on the version it serves" in log, log
        log = faulty.log(faulty.pod("trainer", rank))
        assert "resumed (start 3): the last version delivered is version 2 (step 3); the next is version 3" in log, log
        assert "from its replica" in log, log  # DDP: each rank sends its share from its replica
    trainer = faulty.log(faulty.pod("trainer", 0))
    assert "step 6: version 3" in trainer, trainer
    assert f"resumed from the checkpoint of step 0; {Resumed(0, 0, 2)}" in trainer
    assert f"resumed from the checkpoint of step 3; {Resumed(2, 3, 3)}" in trainer
    assert_nothing_left(faulty.local)
