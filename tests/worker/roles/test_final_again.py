"""The final version sent again to an inference rank that came back after it went out, where its
first sending reached no one (the only inference rank was away): the trainers' second sending has
nothing to be compared with, and the rank that came back gets it, bit for bit, and the job succeeds
(it failed the job as a digest mismatch against the digest of nothing).

An inference rank frozen in the final version's round, after its bytes arrived, and woken once
the round went on without it: no later version will come to tell it that it fell behind, and the
controller waits for it to rejoin; it learns that it was counted away, ends, starts again and gets
the final version again (it waited for a next version until its away grace, fifteen minutes, ran
out)."""

from __future__ import annotations

import dataclasses
import io
import os
import signal

import pytest
import torch
from support.faulty import Faulty
from support.jobs import as_bytes, make_job
from support.waits import until

from weightsync.job import LIVENESS
from weightsync.local.runner import LocalJob
from weightsync.runtime.faults import DUMP_DIR_ENV, PAUSE_DIR_ENV

pytestmark = pytest.mark.slow  # a whole job as processes: not in `make unit`


def test_the_final_version_reaches_a_rank_that_missed_its_first_sending(tmp_path):
    job = make_job("final-again", steps=4, every=2)  # versions 0..2
    dump, pause = tmp_path / "dump", tmp_path / "pause"
    dump.mkdir()
    pause.mkdir()
    (pause / "trainer-0-before-go-v1.arm").touch()
    local = LocalJob(job, tmp_path / "run", {DUMP_DIR_ENV: str(dump), PAUSE_DIR_ENV: str(pause)},
                     progress=io.StringIO())
    try:
        local.start()
        until("the trainer holding before version 1", (pause / "trainer-0-before-go-v1.reached").exists, 120)
        # the only inference rank freezes: counted away, it misses versions 1 and 2; its liveness
        # probe then has its pod killed and started again, and it rejoins after the final version
        inference = next(p for p in local.pods if p.role == "inference")
        os.kill(inference.proc.pid, signal.SIGSTOP)
        controller = local.pods[0].log
        until("the frozen inference rank counted away", lambda: "inference rank 0 is away" in controller.read_text(), 60)
        (pause / "trainer-0-before-go-v1.release").touch()
        summary = local.wait(180)
    finally:
        local.stop()
    assert summary["versions"] == 2 and summary["failed_verifications"] == 0, summary  # 0 and 2; 1 reached no one
    assert [(t["version"], t["inference_ranks"]) for t in local.transfers] == [(0, 1), (1, 0), (2, 0), (2, 1)]
    want = torch.load(dump / "trainer-0-v2.pt")["tensors"]
    got = torch.load(dump / "inference-0-v2.pt")["tensors"]
    for name, tensor in want.items():
        assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), name


def test_a_rank_frozen_in_the_final_round_and_woken_after_it_starts_again_and_gets_it_again(tmp_path):
    job = make_job("final-woken", steps=4, every=2)  # versions 0..2
    faulty = Faulty(tmp_path, job, "inference-0-verifying-v2")  # every byte of the final version in
    # woken before its liveness probe kills it (a longer probe than the operator's: counting it away
    # and ending the round without it may take a loaded machine past 20 s), so that its start lives on
    faulty.local.kubelet.liveness = dataclasses.replace(LIVENESS, failure_threshold=24)
    victim = faulty.pod("inference", 0)
    try:
        faulty.strike(victim, signal.SIGSTOP)
        until("the final version going on without the frozen rank", lambda: (faulty.local.workdir / "status.json").exists()
              and (faulty.status().get("transfer") or {}).get("version", -1) >= 2, 90)
        os.killpg(victim.proc.pid, signal.SIGCONT)
        summary = faulty.end()
    finally:
        faulty.local.stop()
    said = faulty.log(victim)
    assert "the controller counted this rank away while it waited" in said, said[-3000:]
    assert victim.exits == ["exited with code 1"], victim.exits  # it ended itself; nobody killed it
    assert summary["failed_verifications"] == 0, summary
    assert [(t["version"], t["inference_ranks"]) for t in faulty.local.transfers] == [(0, 1), (1, 1), (2, 0), (2, 1)]
    want = torch.load(faulty.dump / "trainer-0-v2.pt")["tensors"]
    got = torch.load(faulty.dump / "inference-0-v2.pt")["tensors"]
    for name, tensor in want.items():
        assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), name
