"""A tensor-parallel replica of the built-in engine goes away and comes back as a whole, under
`weightsync run` (local processes that the local kubelet restarts, as in a cluster): a replica of
TP degree 2 over two pods beside a whole replica, the built-in trainer publishing a version every
two steps.

Its ranks compute over a process group formed when they start, which takes back no single rank.
Rank 1 of the replica killed between two versions (its pod restarted): the controller counts its
peer away with it, the peer, alive, learns it and ends, and both start again, join with their new
starts and form the replica's group anew. Then, while the replica waits to be taken back, rank 0
frozen past the controller's silence limit and woken (a starved or stopped process): counted away,
and its peer with it, both end themselves, start again and are taken back together at the next
version, which the trainers hold until then; the job succeeds with every version verified on
every rank that applied it, and all three ranks on the final one. (Before, a rank of a replica
that started again failed the job, and one counted away while alive left the job waiting for it until its away grace ran out.)"""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
from support.faulty import Faulty, wait_for_line

from weightsync.job import API_VERSION, KIND, LIVENESS, load_job

pytestmark = pytest.mark.slow  # a whole job as processes: not in `make unit`

LLAMA = {"model_type": "llama", "vocab_size": 101, "hidden_size": 48, "intermediate_size": 70, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def test_a_tensor_parallel_replica_leaves_and_rejoins_whole_when_one_rank_dies_or_freezes(tmp_path):
    job = load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "tp-rejoin"},
        "spec": {"model": {"config": LLAMA, "dtype": "float32"},
                 "trainer": {"replicas": 1, "procsPerPod": 1, "gpusPerProc": 0},
                 "inference": {"replicas": 3, "procsPerPod": 1, "gpusPerProc": 0, "tensorParallelSizes": [2, 1]},
                 "training": {"steps": 8, "batchSize": 4, "seqLen": 16, "learningRate": 3e-3},
                 "transfer": {"everySteps": 2, "bucketMB": 1, "transport": "tcp", "timeoutSeconds": 60},
                 "network": {"mode": "tcp"}}})  # versions 0..4
    faulty = Faulty(tmp_path, job, "trainer-0-before-ready-v2")
    # the frozen rank is woken once counted away; a loaded machine may take past the operator's
    # liveness deadline to get there, and its pod must not be killed meanwhile
    faulty.local.kubelet.liveness = dataclasses.replace(LIVENESS, failure_threshold=24)
    controller = faulty.local.pods[0].log
    tp = [faulty.pod("inference", 0), faulty.pod("inference", 1)]
    try:
        # rank 1 killed while the trainers hold version 2 (which then goes on without the replica),
        # and they hold version 3 until the replica is back
        faulty.arm("trainer-0-before-ready-v3")
        faulty.strike(tp[1], signal.SIGKILL, point="trainer-0-before-ready-v2")
        wait_for_line(controller, "inference rank 0 is away: inference rank 1 of its tensor-parallel replica is away",
                      60, faulty)
        for rank in (0, 1):
            wait_for_line(controller, f"inference rank {rank} rejoined (start 2", 240, faulty)
        # rank 0 frozen while the replica waits to be taken back, past the silence limit, then woken
        faulty.reach("trainer-0-before-ready-v3")
        os.killpg(tp[0].proc.pid, signal.SIGSTOP)
        wait_for_line(controller, "inference rank 1 is away: inference rank 0 of its tensor-parallel replica is away",
                      60, faulty)
        os.killpg(tp[0].proc.pid, signal.SIGCONT)
        for rank in (0, 1):
            wait_for_line(controller, f"inference rank {rank} rejoined (start 3", 240, faulty)
        faulty.release("trainer-0-before-ready-v3")
        summary = faulty.end()
    finally:
        faulty.local.stop()
    assert summary["failed_verifications"] == 0 and faulty.status()["completion"]["state"] == "Succeeded", summary
    assert summary["restarts"] == {tp[0].name: 2, tp[1].name: 2}, summary
    assert tp[0].exits[0] == "exited with code 1" and tp[1].exits[1] == "exited with code 1", [p.exits for p in tp]
    said = faulty.log(tp[0])
    assert "the controller counted this rank away" in said, said[-3000:]
    for rank in range(3):  # every rank on the final version, verified
        assert (faulty.dump / f"inference-{rank}-v4.pt").exists(), rank
