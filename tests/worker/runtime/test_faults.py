"""Faults against a running local job, the way a cluster produces them: kill -9 (an OOM kill, a
lost node) and SIGSTOP (a frozen process) of each role at known points of a version. The job
holds a rank at a pause point (runtime/faults.py PAUSE_DIR_ENV) while the test kills or stops a
process, so "mid-bucket" really is in the middle of a version's buckets. `weightsync run` restarts
dead pods and probes them as a kubelet does, so the outcomes are the cluster's:

- an inference rank that dies or freezes comes back, rejoins, receives the next version (or the
  final one again) in full, and the job succeeds with every version verified on every rank that
  applied it, and every rank on the final version;
- a trainer that dies or freezes fails the job, naming that trainer (not the survivor that saw
  it go);
- a controller that dies or freezes is started again and fails the job saying so.

Each prints how long detection and recovery took."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from support.faulty import Faulty, wait_for_line
from support.jobs import ODD, as_bytes, assert_nothing_left, make_job

from weightsync.job import load_job
from weightsync.local.runner import RunFailed
from weightsync.rendezvous.protocol import versions

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`

def fault_job(name: str):
    # ~2.8 MB float32 versions in 1 MiB buckets: each trainer sends two buckets or more
    return make_job(name, config=ODD, dtype="float32", trainers=(2, 1), inferences=(2, 1), steps=4, every=2)


def check_applied_versions(dump: Path, job) -> dict[int, list[int]]:
    """Every version an inference rank applied equals the trainers' bit for bit; returns {rank:
    versions applied}. A restarted rank dumps again the versions it applied again."""
    final = list(versions(job))[-1][0]
    applied = {}
    for rank in range(job.layout.world_size("inference")):
        seen = sorted(int(p.stem.rsplit("-v", 1)[1]) for p in dump.glob(f"inference-{rank}-v*.pt"))
        for version in seen:
            want = torch.load(dump / f"trainer-0-v{version}.pt")["tensors"]
            got = torch.load(dump / f"inference-{rank}-v{version}.pt")["tensors"]
            for name, tensor in want.items():
                assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), f"inference rank {rank}, version {version}, {name}"
        assert final in seen, f"inference rank {rank} does not hold the final version {final}: it applied {seen}"
        applied[rank] = seen
    return applied


INFERENCE_KILLS = [
    # where inference rank 1 is killed (SIGKILL), in one job, a version after another
    "trainer-0-mid-send-v1",  # mid-bucket: its buckets half received
    "inference-1-verifying-v2",  # received, before the digest check
    "trainer-0-before-go-v3",  # between versions, before the go
    "trainer-0-mid-send-v4",  # the final version: it gets it again once back
]


def test_an_inference_rank_killed_at_each_point_of_a_version_rejoins_every_time_and_the_job_succeeds(tmp_path):
    """One job, one kill per version: before each next version the trainers hold (an armed
    before-ready point) until the killed rank rejoined, so that every kill finds it back and
    receiving; the pod is restarted after the kubelet's back-off each time."""
    job = make_job("inference-kills", config=ODD, dtype="float32", trainers=(2, 1), inferences=(2, 1), steps=8,
                   every=2)  # versions 0..4
    faulty = Faulty(tmp_path, job, INFERENCE_KILLS[0])
    controller = faulty.local.pods[0]
    try:
        for n, point in enumerate(INFERENCE_KILLS, start=1):
            version = int(point.rsplit("-v", 1)[1])
            held = f"trainer-0-before-ready-v{version + 1}"
            if n < len(INFERENCE_KILLS):
                faulty.arm(held)  # the next version waits for the rank to be back
            struck = faulty.strike(faulty.pod("inference", 1), signal.SIGKILL, point=point)
            away = wait_for_line(controller.log, "inference rank 1 is away", 120, faulty, count=n)
            back = wait_for_line(controller.log, "inference rank 1 rejoined", 180, faulty, count=n)
            print(f"{point} SIGKILL: away after {away - struck:.1f}s, rejoined after {back - struck:.1f}s")
            if n < len(INFERENCE_KILLS):
                faulty.arm(INFERENCE_KILLS[n])
                faulty.reach(held)
                faulty.release(held)
        summary = faulty.end()
    finally:
        faulty.local.stop()
    assert summary["failed_verifications"] == 0
    assert faulty.status()["rejoins"]["inference"] >= len(INFERENCE_KILLS)
    assert faulty.status()["completion"]["state"] == "Succeeded" and faulty.status()["completion"]["versions"] == 5
    # every inference rank current on the final version; the victim since it came back, later than the survivor
    ranks = faulty.status()["receivers"]["ranks"]
    assert [(r["state"], r["version"]) for r in ranks] == [("current", 4), ("current", 4)]
    assert ranks[1]["since"] > ranks[0]["since"], ranks
    applied = check_applied_versions(faulty.dump, job)
    assert applied[0] == [0, 1, 2, 3, 4]  # the survivor missed nothing
    # versions 1 to 3 each lost it on the way (it was back, receiving, when the next kill came:
    # verifying version 2 means it had all of it); the final version it got again once back
    assert applied[1] == [0, 4], applied
    assert faulty.log(faulty.pod("inference", 1)).count("taken back at") >= len(INFERENCE_KILLS) - 1
    assert_nothing_left(faulty.local)


def test_an_inference_rank_frozen_mid_version_is_restarted_by_its_liveness_probe_rejoins_and_the_job_succeeds(
        tmp_path):
    job = fault_job("inference-frozen")
    faulty = Faulty(tmp_path, job, "trainer-0-mid-send-v1")
    victim = faulty.pod("inference", 1)
    controller = faulty.local.pods[0]
    try:
        struck = faulty.strike(victim, signal.SIGSTOP)
        away = wait_for_line(controller.log, "inference rank 1 is away", 120)
        back = wait_for_line(controller.log, "inference rank 1 rejoined", 180)
        summary = faulty.end()
    finally:
        faulty.local.stop()
    print(f"frozen mid-version: away after {away - struck:.1f}s, rejoined after {back - struck:.1f}s")
    assert summary["failed_verifications"] == 0
    assert faulty.status()["rejoins"]["inference"] >= 1
    assert faulty.status()["completion"]["state"] == "Succeeded" and faulty.status()["completion"]["versions"] == 3
    ranks = faulty.status()["receivers"]["ranks"]
    assert [(r["state"], r["version"]) for r in ranks] == [("current", 2), ("current", 2)]
    assert ranks[1]["since"] > ranks[0]["since"], ranks
    applied = check_applied_versions(faulty.dump, job)
    assert applied[0] == [0, 1, 2]  # the survivor missed nothing
    assert "taken back at" in faulty.log(victim)
    assert_nothing_left(faulty.local)


def test_every_inference_rank_killed_at_once_mid_version_rejoins_and_the_job_succeeds(tmp_path):
    job = fault_job("inference-faults")
    faulty = Faulty(tmp_path, job, "trainer-0-mid-send-v1")
    victims = [faulty.pod("inference", 0), faulty.pod("inference", 1)]
    controller = faulty.local.pods[0]
    try:
        struck = faulty.strike(victims[0], signal.SIGKILL, victims[1])
        away = max(wait_for_line(controller.log, f"inference rank {r} is away", 120, faulty) for r in (0, 1))
        back = max(wait_for_line(controller.log, f"inference rank {r} rejoined", 180, faulty) for r in (0, 1))
        summary = faulty.end()
    finally:
        faulty.local.stop()
    print(f"both inference ranks killed mid-version: both away after {away - struck:.1f}s, both back after "
          f"{back - struck:.1f}s")
    assert summary["failed_verifications"] == 0
    assert faulty.status()["rejoins"]["inference"] >= 2
    # version 1 reached no one (every receiver died in it): the job delivers versions 0 and 2
    assert faulty.status()["completion"]["state"] == "Succeeded" and faulty.status()["completion"]["versions"] == 2
    assert [(r["state"], r["version"]) for r in faulty.status()["receivers"]["ranks"]] == [("current", 2), ("current", 2)]
    applied = check_applied_versions(faulty.dump, job)
    assert all(1 not in seen for seen in applied.values()), applied
    assert_nothing_left(faulty.local)


FROZEN_BRIEFLY = [
    # (pause point, what the woken rank may say): frozen between versions (version 1 not announced:
    # a trainer is not ready), it waits for a round that will never be announced again; frozen
    # mid-version, the trainers hung up on it meanwhile, and it finds so either while it reads the
    # rest of the version or, where the loopback's buffers held all of it, when it then waits for
    # the version's reference, which the controller forgot: which one depends on how much the
    # kernel buffered before the trainers hung up, not on the test
    ("trainer-0-before-ready-v1", ("without this rank",)),
    ("trainer-0-mid-send-v1", ("the controller counted this rank away meanwhile", "without this rank")),
]
# a version far larger than the loopback's socket buffers: a rank frozen mid-version has most of it
# still to read when it wakes, from trainers that hung up on it meanwhile
LARGE = {**ODD, "n_embd": 400, "n_head": 4, "vocab_size": 16000}


@pytest.mark.parametrize("point,said", FROZEN_BRIEFLY, ids=[p for p, _ in FROZEN_BRIEFLY])
def test_an_inference_rank_frozen_briefly_while_versions_go_on_notices_it_fell_behind_and_rejoins(tmp_path, point,
                                                                                                     said):
    """SIGSTOP for less than the liveness probe's deadline (no restart by the kubelet), long enough
    to be counted away while the trainers publish several more versions, whose keys the controller
    then forgets; on SIGCONT the rank must neither wait for a round that will never be announced
    again nor fail the job over the version it was receiving: it notices it fell behind, starts
    again, rejoins and gets the final version."""
    config = LARGE if "mid-send" in point else ODD
    job = make_job("frozen-behind", config=config, dtype="float32", trainers=(2, 1), inferences=(2, 1), steps=8, every=1)
    faulty = Faulty(tmp_path, job, point)
    victim = faulty.pod("inference", 1)
    controller = faulty.local.pods[0]
    try:
        struck = faulty.strike(victim, signal.SIGSTOP)
        wait_for_line(controller.log, "inference rank 1 is away", 60)
        deadline = struck + 20.0  # within LIVENESS.deadline (25 s) of the stop: its pod is not restarted
        while time.monotonic() < deadline and not (faulty.local.workdir / "status.json").exists():
            time.sleep(0.1)
        while time.monotonic() < deadline and (faulty.status().get("transfer") or {}).get("version", 0) < 4:
            time.sleep(0.1)
        assert (faulty.status().get("transfer") or {}).get("version", 0) >= 4, "the versions did not go on without it"
        os.killpg(victim.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        back = wait_for_line(controller.log, "inference rank 1 rejoined", 120, faulty)
        summary = faulty.end()
    finally:
        faulty.local.stop()
    print(f"frozen for {resumed - struck:.1f}s: rejoined {back - resumed:.1f}s after it woke")
    assert any(words in faulty.log(victim) for words in said), faulty.log(victim)[-3000:]
    assert summary["failed_verifications"] == 0 and faulty.status()["completion"]["state"] == "Succeeded"
    applied = check_applied_versions(faulty.dump, job)
    assert applied[0] == list(range(9)) and applied[1][-1] == 8
    assert_nothing_left(faulty.local)


def test_an_inference_rank_away_past_its_grace_is_dropped_and_taken_back_when_its_pod_starts_again(tmp_path):
    """spec.inference.minAvailable 1 of 2, awayGraceSeconds 3: inference rank 1, frozen (SIGSTOP),
    is counted away, then dropped, and the versions go on without waiting for it; the liveness
    probe kills the frozen pod and starts it again, and the rank is taken back. The trainers hold
    version 6 back until then, so that the versions after it reach the rank again."""
    obj = make_job("dropped", config=ODD, dtype="float32", trainers=(2, 1), inferences=(2, 1), steps=8,
                   every=1).to_object()
    obj["spec"]["inference"].update(minAvailable=1, awayGraceSeconds=3)
    job = load_job(obj)
    faulty = Faulty(tmp_path, job, "trainer-0-before-ready-v1")
    (faulty.pause / "trainer-0-before-ready-v6.arm").touch()
    victim = faulty.pod("inference", 1)
    controller = faulty.local.pods[0]
    try:
        struck = faulty.strike(victim, signal.SIGSTOP)
        dropped = wait_for_line(controller.log, "inference rank 1 dropped: away for more than 3s", 60, faulty)
        back = wait_for_line(controller.log, "inference rank 1 rejoined", 120, faulty)
        (faulty.pause / "trainer-0-before-ready-v6.release").touch()
        summary = faulty.end()
    finally:
        faulty.local.stop()
    print(f"dropped {dropped - struck:.1f}s after it froze, taken back {back - struck:.1f}s after")
    assert summary["failed_verifications"] == 0 and faulty.status()["completion"]["state"] == "Succeeded"
    versions = [r["version"] for r in faulty.local.transfers]
    assert all(r["inference_ranks"] == 1 for r in faulty.local.transfers if 1 < r["version"] < 6), versions
    applied = check_applied_versions(faulty.dump, job)
    assert applied[0] == list(range(9)) and set(applied[1]) >= {6, 7, 8}
    assert [r["state"] for r in faulty.status()["receivers"]["ranks"]] == ["current", "current"]


TRAINER_FAULTS = [
    ("trainer-0-mid-send-v1", signal.SIGKILL),
    ("trainer-1-before-go-v1", signal.SIGKILL),
    ("trainer-0-mid-send-v1", signal.SIGSTOP),
]


@pytest.mark.parametrize("point,sig", TRAINER_FAULTS, ids=[f"{p}-{signal.Signals(s).name}" for p, s in TRAINER_FAULTS])
def test_a_trainer_that_dies_or_freezes_fails_the_job_naming_it(tmp_path, point, sig):
    job = fault_job("trainer-fault")
    faulty = Faulty(tmp_path, job, point)
    victim = faulty.pod("trainer", 1)
    try:
        struck = faulty.strike(victim, sig)
        with pytest.raises(RunFailed) as failure:
            faulty.end()
        took = time.monotonic() - struck
    finally:
        faulty.local.stop()
    print(f"{point} {signal.Signals(sig).name}: the job failed {took:.1f}s later: {faulty.status()['completion']['message']}")
    completion = faulty.status()["completion"]
    assert completion["state"] == "Failed"
    message = completion["message"]
    assert message.startswith("trainer rank 1"), message  # the one struck, not a survivor
    assert completion["reason"] in ("TrainerRestarted", "RankSilent", "RankFailed"), completion
    assert "trainer rank 1" in str(failure.value)
    assert_nothing_left(faulty.local)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_controller_that_dies_or_freezes_is_started_again_and_fails_the_job_saying_so(tmp_path, sig):
    job = fault_job("controller-fault")
    faulty = Faulty(tmp_path, job, "controller-0-verifying-v1")
    try:
        struck = faulty.strike(faulty.local.pods[0], sig)
        with pytest.raises(RunFailed) as failure:
            faulty.end()
        took = time.monotonic() - struck
    finally:
        faulty.local.stop()
    completion = faulty.status()["completion"]
    print(f"controller {signal.Signals(sig).name}: the job failed {took:.1f}s later: {completion['message']}")
    assert completion["state"] == "Failed" and completion["reason"] == "ControllerRestarted"
    assert "the controller started again (start 2) after version 0" in completion["message"]
    assert faulty.status()["controller"]["starts"] == 2
    assert "the controller started again" in str(failure.value)
    assert_nothing_left(faulty.local)
