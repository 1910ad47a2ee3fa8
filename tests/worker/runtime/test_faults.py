"""Faults against a running local job, the way a cluster produces them: kill -9 (an OOM kill, a
lost node) and SIGSTOP (a frozen process) of each role at known points of a version. The job
holds a rank at a pause point (runtime/faults.py PAUSE_DIR_ENV) while the test kills or stops a
process, so "mid-bucket" really is in the middle of a version's buckets. `weightsync run` restarts
dead pods and probes them as a kubelet does, so the outcomes are the cluster's:

- an inference rank that dies or freezes comes back, rejoins, receives the next version (or the
  final one again) in full, and the job succeeds with every version verified on every rank that
  applied it, and every rank on the final version; one killed while the ranks join is started
  again, and the job, not waiting for the start that died, takes it in with its new start;
- a trainer that dies or freezes fails the job, naming that trainer (not the survivor that saw
  it go);
- a controller that dies or freezes is started again (a frozen one killed by its liveness probe)
  and fails the job saying so.

Each prints how long detection and recovery took."""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from support.faulty import Faulty, wait_for_line
from support.jobs import ODD, as_bytes, assert_nothing_left, make_job

from weightsync.job import LIVENESS, load_job
from weightsync.local import kubelet
from weightsync.local.runner import RunFailed
from weightsync.rendezvous.protocol import versions

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`

SLACK = 30.0  # seconds a loaded machine may add to a restart's due time


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


JOINING = "inference-0-joining-v0"  # its model built, not joined yet: the ranks join meanwhile
INFERENCE_KILLS = [
    # where inference ranks are killed (SIGKILL), in one job, a version after another: (the point,
    # the ranks killed there at once)
    ("trainer-0-mid-send-v1", (0, 1)),  # mid-bucket, every receiver: version 1 reaches no one
    ("inference-1-verifying-v2", (1,)),  # received, before the digest check
    ("trainer-0-before-go-v3", (1,)),  # between versions, before the go
    ("trainer-0-mid-send-v4", (1,)),  # mid-bucket, the final version: it gets it again once back
]


def test_inference_ranks_killed_while_joining_and_at_each_point_of_a_version_rejoin_every_time_and_the_job_succeeds(
        tmp_path):
    """One job: inference rank 0 killed while the ranks join (a pod OOM-killed while it loads its
    model, or preempted at start: its pod is started again, the job does not wait for the start
    that died, and it joins with its new start); then one kill per version: inference rank 1 each
    time, and rank 0 with it the first time, so that version 1 reaches no one. Before each next
    version the trainers hold (an armed before-ready point) until the killed ranks rejoined, so that
    every kill finds them back and receiving; each pod is restarted after the kubelet's back-off
    each time. (A trainer killed while the ranks join: test_join_faults.py.)"""
    job = make_job("inference-kills", config=ODD, dtype="float32", trainers=(2, 1), inferences=(2, 1), steps=8,
                   every=2)  # versions 0..4
    faulty = Faulty(tmp_path, job, JOINING)
    faulty.arm(INFERENCE_KILLS[0][0])
    controller = faulty.local.pods[0]
    kills = {0: 0, 1: 0}
    joining = faulty.pod("inference", 0)
    try:
        faulty.strike(joining, signal.SIGKILL)  # its start counted, its model built, not joined
        for n, (point, victims) in enumerate(INFERENCE_KILLS, start=1):
            version = int(point.rsplit("-v", 1)[1])
            held = f"trainer-0-before-ready-v{version + 1}"
            if n < len(INFERENCE_KILLS):
                faulty.arm(held)  # the next version waits for the ranks to be back
            pods = [faulty.pod("inference", r) for r in victims]
            struck = faulty.strike(pods[0], signal.SIGKILL, *pods[1:], point=point)
            for r in victims:
                kills[r] += 1
                away = wait_for_line(controller.log, f"inference rank {r} is away", 120, faulty, count=kills[r])
                back = wait_for_line(controller.log, f"inference rank {r} rejoined", 180, faulty, count=kills[r])
                print(f"{point} SIGKILL of inference rank {r}: away after {away - struck:.1f}s, rejoined after "
                      f"{back - struck:.1f}s")
            if n < len(INFERENCE_KILLS):
                faulty.arm(INFERENCE_KILLS[n][0])
                faulty.reach(held)
                faulty.release(held)
        summary = faulty.end()
    finally:
        faulty.local.stop()
    assert summary["failed_verifications"] == 0
    assert faulty.status()["rejoins"]["inference"] >= sum(kills.values())
    # version 1 reached no one (every receiver died in it): the job delivers versions 0, 2, 3 and 4
    assert faulty.status()["completion"]["state"] == "Succeeded" and faulty.status()["completion"]["versions"] == 4
    # every inference rank current on the final version; rank 1 since it came back, later than rank 0
    ranks = faulty.status()["receivers"]["ranks"]
    assert [(r["state"], r["version"]) for r in ranks] == [("current", 4), ("current", 4)]
    assert ranks[1]["since"] > ranks[0]["since"], ranks
    applied = check_applied_versions(faulty.dump, job)
    assert applied[0] == [0, 2, 3, 4], applied  # back for version 2, rank 0 missed nothing after
    # versions 1 to 3 each lost rank 1 on the way (it was back, receiving, when the next kill came:
    # verifying version 2 means it had all of it); the final version it got again once back
    assert applied[1] == [0, 4], applied
    # every start rejoined the running job; whether a start was taken back before the next kill
    # struck it (it may be killed in its first handshake with a trainer) is the machine's timing
    said = faulty.log(faulty.pod("inference", 1))
    assert said.count("rejoining the running job") == kills[1] and "taken back at version 4" in said, said[-3000:]
    # the start that died while the ranks joined: the next start joined with the others and took version 0
    assert "inference rank 0 started again (start 2) while the ranks joined: it joins with that start" in \
        faulty.log(controller)
    assert "taken back at version 0" in faulty.log(joining)
    assert summary["restarts"] == {joining.name: 1 + kills[0], faulty.pod("inference", 1).name: kills[1]}, summary
    assert_nothing_left(faulty.local)


FROZEN_BRIEFLY = [
    # (pause point, what the woken rank may say), one after the other in one job: frozen between
    # versions (version 1 not announced: a trainer is not ready), it waits for a round that will
    # never be announced again, and finds the controller's word that it was counted away (or,
    # where it looks at the versions first, that they went on without it); frozen mid-version, the
    # trainers hung up on it meanwhile, and it finds so either while it reads the rest of the
    # version or, where the loopback's buffers held all of it, when it then waits for the
    # version's reference, which the controller forgot: which one depends on how much the kernel
    # buffered before the trainers hung up, not on the test
    ("trainer-0-before-ready-v1", ("the controller counted this rank away", "without this rank")),
    ("trainer-0-mid-send-v5", ("the controller counted this rank away meanwhile", "without this rank")),
]
# a version far larger than the loopback's socket buffers: a rank frozen mid-version has most of it
# still to read when it wakes, from trainers that hung up on it meanwhile
LARGE = {**ODD, "n_embd": 400, "n_head": 4, "vocab_size": 16000}
BEHIND = 3  # versions the trainers publish while the rank is frozen
FROZEN_PROBE_FAILURES = 20  # the frozen-briefly job's liveness: 20 failures 5 s apart (its pods killed from 100 s)


def test_an_inference_rank_frozen_briefly_while_versions_go_on_notices_it_fell_behind_and_rejoins(tmp_path):
    """SIGSTOP for less than the liveness probe's deadline (no restart by the kubelet), long enough
    to be counted away while the trainers publish several more versions, whose keys the controller
    then forgets; on SIGCONT the rank must neither wait for a round that will never be announced
    again nor fail the job over the version it was receiving: it notices it fell behind, starts
    again, rejoins and gets the final version. Twice in one job, at each point of FROZEN_BRIEFLY:
    the trainers hold version 5 back until the rank is back from the first, so that the second
    finds it receiving."""
    job = make_job("frozen-behind", config=LARGE, dtype="float32", trainers=(2, 1), inferences=(2, 1), steps=9,
                   every=1)  # versions 0..9
    held = "trainer-0-before-ready-v5"
    faulty = Faulty(tmp_path, job, FROZEN_BRIEFLY[0][0])
    faulty.arm(held)
    victim = faulty.pod("inference", 1)
    controller = faulty.local.pods[0]
    # "briefly" is less than the liveness probe's deadline; the operator's (25 s, its first kill 20 s
    # after a stop) leaves a loaded machine too little time to count the rank away and publish
    # BEHIND versions without it, so this job's probe waits longer: woken within it, no pod restarts
    faulty.local.kubelet.liveness = dataclasses.replace(LIVENESS, failure_threshold=FROZEN_PROBE_FAILURES)
    frozen_for = LIVENESS.period_seconds * (FROZEN_PROBE_FAILURES - 2)  # well inside that probe's deadline
    said = []  # what the rank said after each time it woke
    try:
        for n, (point, _) in enumerate(FROZEN_BRIEFLY, start=1):
            if n > 1:
                faulty.arm(point)
                faulty.reach(held)
                faulty.release(held)
            logged = len(faulty.log(victim)) if victim.log.exists() else 0  # the job starts at the first strike
            struck = faulty.strike(victim, signal.SIGSTOP, point=point)
            wait_for_line(controller.log, "inference rank 1 is away", 60, faulty, count=n)
            at = int(point.rsplit("-v", 1)[1])
            # woken once the versions went on, and well before the probe's earliest kill (the first
            # failing probe may come at once, the last a period apart each waits out its timeout):
            # its pod is not restarted
            deadline = struck + frozen_for
            while time.monotonic() < deadline and not (faulty.local.workdir / "status.json").exists():
                time.sleep(0.1)
            while time.monotonic() < deadline and (faulty.status().get("transfer") or {}).get("version", 0) < at + BEHIND:
                time.sleep(0.1)
            assert (faulty.status().get("transfer") or {}).get("version", 0) >= at + BEHIND, \
                f"the versions did not go on without it after {point}"
            os.killpg(victim.proc.pid, signal.SIGCONT)
            resumed = time.monotonic()
            back = wait_for_line(controller.log, "inference rank 1 rejoined", 120, faulty, count=n)
            print(f"{point}: frozen for {resumed - struck:.1f}s, rejoined {back - resumed:.1f}s after it woke")
            said.append(faulty.log(victim)[logged:])
        summary = faulty.end()
    finally:
        faulty.local.stop()
    for (point, words), text in zip(FROZEN_BRIEFLY, said):
        assert any(w in text for w in words), f"after {point}: {text[-3000:]}"
    # each time it woke within its liveness probe's deadline and ended itself to start again
    assert victim.exits == ["exited with code 1"] * len(FROZEN_BRIEFLY), victim.exits
    assert summary["failed_verifications"] == 0 and faulty.status()["completion"]["state"] == "Succeeded"
    applied = check_applied_versions(faulty.dump, job)
    assert applied[0] == list(range(10)) and applied[1][-1] == 9
    assert_nothing_left(faulty.local)


def test_an_inference_rank_frozen_mid_version_away_past_its_grace_is_dropped_and_taken_back_when_its_pod_starts_again(
        tmp_path):
    """spec.inference.minAvailable 1 of 2, awayGraceSeconds 3: inference rank 1, frozen (SIGSTOP)
    in the middle of version 1's buckets, is counted away, then dropped, and the versions go on
    without waiting for it (the survivor misses none); the liveness probe kills the frozen pod and
    starts it again, and the rank is taken back. The trainers hold version 6 back until then, so
    that the versions after it reach the rank again."""
    obj = make_job("dropped", config=ODD, dtype="float32", trainers=(2, 1), inferences=(2, 1), steps=8,
                   every=1).to_object()
    obj["spec"]["inference"].update(minAvailable=1, awayGraceSeconds=3)
    job = load_job(obj)
    faulty = Faulty(tmp_path, job, "trainer-0-mid-send-v1")
    (faulty.pause / "trainer-0-before-ready-v6.arm").touch()
    victim = faulty.pod("inference", 1)
    controller = faulty.local.pods[0]
    try:
        struck = faulty.strike(victim, signal.SIGSTOP)
        away = wait_for_line(controller.log, "inference rank 1 is away", 60, faulty)
        dropped = wait_for_line(controller.log, "inference rank 1 dropped: away for more than 3s", 60, faulty)
        back = wait_for_line(controller.log, "inference rank 1 rejoined", 120, faulty)
        (faulty.pause / "trainer-0-before-ready-v6.release").touch()
        summary = faulty.end()
    finally:
        faulty.local.stop()
    print(f"frozen mid-version: away after {away - struck:.1f}s, dropped after {dropped - struck:.1f}s, taken back "
          f"{back - struck:.1f}s after")
    assert summary["failed_verifications"] == 0
    assert faulty.status()["completion"]["state"] == "Succeeded" and faulty.status()["completion"]["versions"] == 9
    assert faulty.status()["rejoins"]["inference"] >= 1
    assert victim.exits[0].startswith("failed its liveness probe"), victim.exits
    versions = [r["version"] for r in faulty.local.transfers]
    assert all(r["inference_ranks"] == 1 for r in faulty.local.transfers if 1 < r["version"] < 6), versions
    applied = check_applied_versions(faulty.dump, job)
    assert applied[0] == list(range(9)) and set(applied[1]) >= {6, 7, 8}  # the survivor missed nothing
    assert [(r["state"], r["version"]) for r in faulty.status()["receivers"]["ranks"]] == [("current", 8), ("current", 8)]
    assert "taken back at" in faulty.log(victim)
    assert_nothing_left(faulty.local)


TRAINER_FAULTS = [
    ("trainer-0-mid-send-v1", signal.SIGKILL),
    ("trainer-1-before-go-v1", signal.SIGKILL),
    ("trainer-0-mid-send-v1", signal.SIGSTOP),
]


@pytest.mark.parametrize("point,sig", TRAINER_FAULTS, ids=[f"{p}-{signal.Signals(s).name}" for p, s in TRAINER_FAULTS])
def test_a_trainer_that_dies_or_freezes_fails_the_job_naming_it(tmp_path, point, sig):
    # two trainers, so that a survivor sees the victim go; one inference rank: the trainers' failure
    # ends the job whoever receives
    job = make_job("trainer-fault", config=ODD, dtype="float32", trainers=(2, 1), inferences=(1, 1), steps=4, every=2)
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
    # one reason, whichever the controller noticed first: its peer's failure, its silence, its start again
    assert completion["reason"] == "TrainerStopped", completion
    assert "trainer rank 1" in str(failure.value)
    assert_nothing_left(faulty.local)


CONTROLLER_EXITS = {
    signal.SIGKILL: "was probably out of memory (killed by SIGKILL)",
    # frozen: killed by its liveness probe (its failure threshold of probes unanswered)
    signal.SIGSTOP: (f"failed its liveness probe {LIVENESS.failure_threshold} times in a row "
                     f"(no answer within {LIVENESS.timeout_seconds}s), and was killed"),
}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_controller_that_dies_or_freezes_is_started_again_and_fails_the_job_saying_so(tmp_path, sig):
    """The kubelet's side too: the controller's pod is started again after its first back-off
    (a frozen one once its liveness probe killed it), said in the progress, its log and the run's
    failure. One trainer and one inference rank: the controller's restart fails any job."""
    job = make_job("controller-fault", config=ODD, dtype="float32", steps=4, every=2)
    faulty = Faulty(tmp_path, job, "controller-0-verifying-v1")
    controller = faulty.local.pods[0]
    try:
        struck = faulty.strike(controller, sig)
        restarted = wait_for_line(controller.log, "weightsync run: restart 1 of", 120, faulty)
        with pytest.raises(RunFailed) as failure:
            faulty.end()
        took = time.monotonic() - struck
    finally:
        faulty.local.stop()
    completion = faulty.status()["completion"]
    print(f"controller {signal.Signals(sig).name}: started again {restarted - struck:.1f}s later, the job failed "
          f"{took:.1f}s later: {completion['message']}")
    assert completion["state"] == "Failed" and completion["reason"] == "ControllerRestarted"
    assert "the controller started again (start 2) after version 0" in completion["message"]
    assert faulty.status()["controller"]["starts"] == 2
    assert "the controller started again" in str(failure.value)
    why = CONTROLLER_EXITS[sig]
    assert controller.exits[0] == why
    if sig == signal.SIGSTOP:  # within the probe's deadline, then the first back-off
        assert restarted - struck < LIVENESS.deadline + kubelet.BACKOFF_BASE + SLACK, restarted - struck
    assert f"weightsync: {controller.describe()} {why}; restarting it in 1s (restart 1)" in faulty.local.progress.getvalue()
    assert f"weightsync run: restart 1 of {controller.name}: it {why}\n" in faulty.log(controller)
    assert f"restarted pods: {controller.name} 1 time (last: it {why})" in str(failure.value)
    assert_nothing_left(faulty.local)
