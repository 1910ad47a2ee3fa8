"""A load that fails part-way, in a whole job of the built-in engine as local processes: inference
rank 1's switch to version 2 fails after half of the model's layers (faults.FAIL_LOAD_ENV).

With spec.inference.onLoadFailure rollBack (the default) the rank puts every parameter back on
version 1, whose buffer the failed switch never wrote, and generates version 1's tokens again;
the job goes on with rank 0, status.receivers counts rank 1 behind on version 1, version 3 comes
to it whole while rank 0 gets it as a delta, and it holds version 3 bit for bit. Its switch to
the final version 4 fails too: the job ends (Succeeded) with rank 1 behind on version 3, which
it generates again. With failJob the first failure fails the job with the reason LoadFailed,
naming the rank."""

from __future__ import annotations

import io
import json
import re
import time

import pytest
import torch
from support.jobs import as_bytes, assert_nothing_left, make_job
from support.waits import until

from weightsync.job import load_job
from weightsync.local.runner import STATUS_FILE, LocalJob, RunFailed
from weightsync.runtime.faults import DUMP_DIR_ENV, FAIL_LOAD_ENV, PAUSE_DIR_ENV

pytestmark = pytest.mark.slow  # whole jobs as processes: not in `make unit`

TIMEOUT = 240.0
TOKENS = re.compile(r"version (\d+) generates (\[[\d, ]*\])")
BACK = re.compile(r"the switch to version (\d+) failed part-way; back on version (\d+), which generates (\[[\d, ]*\])")


def failing_job(name: str, on_load_failure: str):
    obj = make_job(name, trainers=(1, 1), inferences=(2, 1), steps=4, every=1,
                   delta={"enabled": True, "fullEvery": 10}).to_object()  # versions 0..4
    obj["spec"]["inference"]["onLoadFailure"] = on_load_failure
    return load_job(obj)


def start(tmp_path, job, pauses=(), fail: str = "1@2") -> LocalJob:
    for folder in ("dump", "pause"):
        (tmp_path / folder).mkdir()
    for point in pauses:
        (tmp_path / "pause" / f"{point}.arm").touch()
    env = {DUMP_DIR_ENV: str(tmp_path / "dump"), PAUSE_DIR_ENV: str(tmp_path / "pause"), FAIL_LOAD_ENV: fail}
    local = LocalJob(job, tmp_path / "run", env, progress=io.StringIO())
    local.start()
    return local


def generated(log: str) -> dict[int, list[int]]:
    """{version: the greedy tokens the rank logged for it when it switched to it}."""
    return {int(v): json.loads(t) for v, t in TOKENS.findall(log)}


def test_a_rank_whose_load_fails_goes_back_to_its_version_and_gets_the_next_one_whole(tmp_path):
    job = failing_job("rollback", "rollBack")
    assert job.inference.on_load_failure == "rollBack"
    local = start(tmp_path, job, pauses=["trainer-0-before-ready-v3"], fail="1@2,1@4")
    pause = tmp_path / "pause"
    try:
        until("the trainer at version 3", lambda: (pause / "trainer-0-before-ready-v3.reached").exists()
              or local.kubelet.failure, TIMEOUT)
        assert local.kubelet.failure is None, local.kubelet.failure

        def receivers():  # status.receivers, once it says version 2 reached rank 0 only
            status = json.loads((local.workdir / STATUS_FILE).read_text()) if (local.workdir / STATUS_FILE).exists() else {}
            got = status.get("receivers", {})
            return got if got.get("version") == 2 else None

        status = until("status.receivers after version 2", receivers, 30)
        assert [(r["rank"], r["state"], r.get("version")) for r in status["ranks"]] == [(0, "current", 2),
                                                                                         (1, "behind", 1)], status
        assert (status["current"], status["behind"], status["ready"]) == (1, 1, "1/2"), status
        (pause / "trainer-0-before-ready-v3.release").touch()
        summary = local.wait(timeout=TIMEOUT)
    finally:
        local.stop()
    assert_nothing_left(local)
    assert summary["versions"] == 5 and summary["failed_verifications"] == 0, summary
    rounds = [(t["version"], t["inference_ranks"], t.get("load_failed"), t["deltaRanks"]) for t in local.transfers]
    # version 3: a delta to rank 0 only (rank 1, back on version 1, gets it whole); the final version 4
    # is not sent again to rank 1, whose load of it failed
    assert rounds == [(0, 2, None, 0), (1, 2, None, 2), (2, 1, [1], 2), (3, 2, None, 1), (4, 1, [1], 2)], rounds
    end = json.loads((local.workdir / STATUS_FILE).read_text())["receivers"]
    assert [(r["rank"], r["state"], r.get("version")) for r in end["ranks"]] == [(0, "current", 4), (1, "behind", 3)]

    dump = tmp_path / "dump"
    held = {rank: sorted(int(p.stem.rsplit("-v", 1)[1]) for p in dump.glob(f"inference-{rank}-v*.pt")) for rank in (0, 1)}
    assert held == {0: [0, 1, 2, 3, 4], 1: [0, 1, 3]}, held  # rank 1 never ran on versions 2 and 4
    for rank, versions in held.items():
        for version in versions:
            want, got = (torch.load(dump / f"{who}-v{version}.pt") for who in ("trainer-0", f"inference-{rank}"))
            for name, tensor in want["tensors"].items():
                assert torch.equal(as_bytes(got["tensors"][name]), as_bytes(tensor)), (rank, version, name)
            assert torch.equal(as_bytes(got["logits"]), as_bytes(want["logits"])), (rank, version)
    logits = [torch.load(dump / f"inference-0-v{v}.pt")["logits"] for v in range(5)]
    assert all(not torch.equal(a, b) for a, b in zip(logits, logits[1:])), "a version did not change the model"

    # what rank 1 generated, token by token, against the version it named: version 1 before and
    # after the failed switch (the same tokens), then version 3 as rank 0 generated it, and again
    # after its switch to version 4 failed
    logs = [p.log.read_text() for p in local.pods if p.role == "inference"]
    ranks = [generated(log) for log in logs]
    assert sorted(ranks[0]) == [0, 1, 2, 3, 4] and sorted(ranks[1]) == [0, 1, 3], ranks
    back = BACK.findall(logs[1])
    assert [(int(v), int(b)) for v, b, _ in back] == [(2, 1), (4, 3)], logs[1][-3000:]
    assert json.loads(back[0][2]) == ranks[1][1] == ranks[0][1]
    assert json.loads(back[1][2]) == ranks[1][3] == ranks[0][3]
    assert all(ranks[1][v] == ranks[0][v] for v in (0, 3)), ranks
    assert "failed to load part-way" in logs[1] and "spec.inference.onLoadFailure rollBack" in logs[1]
    controller = local.pods[0].log.read_text()
    assert "inference rank 1 failed to load version 2" in controller, controller[-3000:]
    assert "inference rank 1 failed to load the final version 4" in controller, controller[-3000:]


def test_with_failjob_a_failed_load_fails_the_job_as_load_failed(tmp_path):
    job = failing_job("failjob", "failJob")
    local = start(tmp_path, job)
    began = time.monotonic()
    try:
        with pytest.raises(RunFailed) as failed:
            local.wait(timeout=TIMEOUT)
    finally:
        local.stop()
    assert_nothing_left(local)
    status = json.loads((local.workdir / STATUS_FILE).read_text())
    completion = status["completion"]
    assert completion["state"] == "Failed" and completion["reason"] == "LoadFailed", completion
    assert completion["message"].startswith("inference rank 1 failed: LoadFailed: version 2 failed to load part-way"), \
        completion
    assert "the model runs on version 1 again" in completion["message"], completion
    assert completion["versions"] == 2, completion  # versions 0 and 1
    assert "LoadFailed" in str(failed.value), failed.value
    assert time.monotonic() - began < TIMEOUT
