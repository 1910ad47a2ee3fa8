"""Whole jobs as local processes on loopback (controller, trainers, inference ranks, each with its
pod's files and environment): after every version each inference rank holds the trainers'
weights bit for bit and computes the same logits as the trainer's model cast to the same dtype;
the loss goes down; bad tokens are refused; no pod restarts on the way, and no process is left
behind (test_runner_restarts.py: how pods that die or freeze are restarted, and how every process
stays up after the end in a cluster; test_faults.py: what the job does then)."""
from __future__ import annotations

import io
import json
import os
import signal
import socket

import pytest
from support.jobs import (
    ODD,
    assert_nothing_left,
    check_every_version,
    make_job,
    pids_of,
    run_to_end,
    start,
    store_of,
    wait_key,
)

from weightsync.job import Env
from weightsync.local import kubelet
from weightsync.local.runner import LocalJob, RunFailed
from weightsync.rendezvous.protocol import Keys

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`


def test_two_to_one_bfloat16_and_the_loss_goes_down(tmp_path):
    job = make_job("two-to-one", trainers=(2, 1), steps=20, every=5)
    summary, transfers = run_to_end(tmp_path, job)
    assert summary["versions"] == 5 and summary["failed_verifications"] == 0
    assert check_every_version(tmp_path / "dump", job) == 5
    losses = [t["loss"] for t in transfers[1:]]
    assert summary["final_loss"] == losses[-1] < losses[0] - 0.3, losses


def test_two_to_three_float32_odd_sizes_with_several_processes_per_pod_and_a_connection_with_a_wrong_token_is_refused(
        tmp_path):
    """One trainer pod with two processes (DDP inside the pod), one inference pod with three, tensors
    of odd sizes that 1 MiB buckets cut through; meanwhile an impostor that connects to an inference
    rank without the job's token is refused, and nothing it sent is applied."""
    from weightsync.transport.wire import ANSWER, CHALLENGE, DATA, HEADER, MAGIC

    job = make_job("two-to-three", config=ODD, dtype="float32", trainers=(1, 2), inferences=(1, 3), steps=4, every=2)
    local = start(tmp_path, job)
    try:
        store = store_of(local)
        wait_key(store, "plan/mac")
        host, port = store.get(Keys.published("endpoint", "inference", 0, 1)).decode().rsplit(":", 1)
        # an impostor claiming trainer rank 0, ready to overwrite version 1 with garbage
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            challenge = sock.recv(CHALLENGE.size, socket.MSG_WAITALL)
            assert CHALLENGE.unpack(challenge)[0] == b"WSHC"
            sock.sendall(ANSWER.pack(b"WSHA", 0, 0, os.urandom(32)))
            garbage = os.urandom(4096)
            try:
                sock.sendall(HEADER.pack(MAGIC, DATA, 1, 0, len(garbage), 0) + garbage)
                verdict = sock.recv(64)
            except (ConnectionResetError, BrokenPipeError):
                verdict = b""
            assert verdict == b"", "the receiver answered an impostor"
        summary = local.wait(timeout=240)
    finally:
        local.stop()
    assert summary["versions"] == 3 and summary["failed_verifications"] == 0 and summary["restarts"] == {}
    # the bytes each version moved: the version's, once to each of the three inference ranks
    assert summary["bytes_per_version"] == 3 * local.transfers[0]["version_bytes"]
    assert local.transfers[0]["version_bytes"] > 2 << 20
    assert check_every_version(tmp_path / "dump", job) == 9
    assert_nothing_left(local)
    assert "refused connection" in (local.workdir / "logs" / f"{job.pod_name(2)}.log").read_text()
    # CPU ranks do not load triton (torch's CUDA wheels bring it): no "leaked" lines from it at exit
    for log in (tmp_path / "run" / "logs").glob("*.log"):
        assert "leaked" not in log.read_text(), log


def test_a_rank_with_a_wrong_token_file_fails_the_job_naming_it(tmp_path, monkeypatch):
    # A wrong token fails every start alike: one restart shows it (the whole crash loop, a minute of
    # back-off, is test_runner_restarts.py's)
    monkeypatch.setattr(kubelet, "CRASH_LOOP_LIMIT", 1)
    job = make_job("wrong-token-file")
    local = LocalJob(job, tmp_path / "run", progress=io.StringIO())
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-job-token-at-all")
    local.pods[2].env[Env.TOKEN_FILE] = str(wrong)  # the inference pod
    local.start()
    try:
        with pytest.raises(RunFailed, match="inference rank 0 failed the job token proof"):
            local.wait(timeout=240)
    finally:
        local.stop()
    assert local.transfers == []
    assert_nothing_left(local)


def test_how_a_process_ended_is_said_in_words():
    from weightsync.runtime.procs import exit_status

    assert exit_status(-signal.SIGKILL) == "was probably out of memory (killed by SIGKILL)"
    assert exit_status(-signal.SIGTERM) == "was killed by signal SIGTERM"
    assert exit_status(3) == "exited with code 3"


def test_sigint_stops_every_process(tmp_path):
    import subprocess
    import sys

    job_file = tmp_path / "job.yaml"
    import yaml

    job = make_job("interrupted", steps=0, every=2)
    job_file.write_text(yaml.safe_dump(job.to_object()))
    proc = subprocess.Popen([sys.executable, "-m", "weightsync.cli", "run", str(job_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # progress: wait for a delivered version
            if "version 1 " in line:
                break
        else:
            pytest.fail(f"the run ended before delivering a version: {proc.wait()}")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        rest, out = proc.stderr.read(), proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0 and "interrupted by SIGINT" in rest
    assert json.loads(out)["versions"] >= 2  # what it delivered before it was stopped
    assert pids_of("interrupted") == [], "processes outlived the interrupted run"
