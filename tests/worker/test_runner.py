"""Whole jobs as local processes on loopback (controller, trainers, inference ranks, each with its
pod's files and environment): after every version each inference rank holds the trainers'
weights bit for bit and computes the same logits as the trainer's model cast to the same dtype;
the loss goes down; bad tokens are refused; no pod restarts on the way, and no process is left
behind (test_runner_restarts.py: how pods that die or freeze are restarted; test_faults.py: what
the job does then)."""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from weightsync import job as contract
from weightsync.rendezvous.protocol import Keys, connect_store, versions
from weightsync.roles.common import DUMP_DIR_ENV
from weightsync.local.runner import LocalJob, RunFailed

TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 32,
        "bos_token_id": 0, "eos_token_id": 0}
# Tensors of sizes no power of two divides, a version of ~2.8 MB: 1 MiB buckets cut through tensors.
ODD = {"model_type": "gpt2", "n_layer": 2, "n_embd": 150, "n_head": 5, "vocab_size": 1001, "n_positions": 37,
       "bos_token_id": 0, "eos_token_id": 0}


def make_job(name, config=TINY, dtype="bfloat16", trainers=(1, 1), inferences=(1, 1), steps=4, every=2, gpus=(0, 0),
             **transfer):
    return contract.load_job({
        "apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": name},
        "spec": {"model": {"config": config, "dtype": dtype},
                 "trainer": {"replicas": trainers[0], "procsPerPod": trainers[1], "gpusPerProc": gpus[0]},
                 "inference": {"replicas": inferences[0], "procsPerPod": inferences[1], "gpusPerProc": gpus[1]},
                 "training": {"steps": steps, "batchSize": 4, "seqLen": 16, "learningRate": 3e-3},
                 "transfer": {"everySteps": every, "bucketMB": 1, "transport": "tcp", "timeoutSeconds": 60, **transfer},
                 "network": {"mode": "tcp"}}})


def start(tmp_path: Path, job, dump: bool = True, share_gpus: bool = False) -> LocalJob:
    env = {}
    if dump:
        (tmp_path / "dump").mkdir()
        env[DUMP_DIR_ENV] = str(tmp_path / "dump")
    local = LocalJob(job, tmp_path / "run", env, progress=io.StringIO(), share_gpus=share_gpus)
    local.start()
    return local


def run_to_end(tmp_path: Path, job, share_gpus: bool = False) -> tuple[dict, list[dict]]:
    local = start(tmp_path, job, share_gpus=share_gpus)
    try:
        summary = local.wait(timeout=240)
    finally:
        local.stop()
    assert_nothing_left(local)
    assert summary["restarts"] == {}, "a pod restarted, or failed its liveness probe, in a job that went well"
    return summary, local.transfers


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_every_version(dump: Path, job, logits_tolerance: float | None = None) -> int:
    """Every inference rank, after every version: the trainers' tensors bit for bit, and the logits
    of the trainer's model cast to the job's dtype on the same input (identical; within a
    tolerance only where trainer and inference compute on different kinds of device)."""
    layout = job.layout
    dtype = getattr(torch, job.spec["model"]["dtype"])
    count = 0
    for version, _ in versions(job.spec):
        trainer = torch.load(dump / f"trainer-0-v{version}.pt")
        for t in range(1, layout.world_size("trainer")):  # DDP keeps the trainer ranks identical
            other = torch.load(dump / f"trainer-{t}-v{version}.pt")
            assert all(torch.equal(as_bytes(other["tensors"][n]), as_bytes(v)) for n, v in trainer["tensors"].items())
        for i in range(layout.world_size("inference")):
            got = torch.load(dump / f"inference-{i}-v{version}.pt")
            assert list(got["tensors"]) == list(trainer["tensors"])
            for name, want in trainer["tensors"].items():
                assert want.dtype == dtype and got["tensors"][name].dtype == dtype
                assert torch.equal(as_bytes(got["tensors"][name]), as_bytes(want)), \
                    f"version {version}: inference rank {i} differs from the trainer in {name}"
            assert got["logits"].dtype == dtype and trainer["logits"].dtype == dtype
            if logits_tolerance is None:
                assert torch.equal(as_bytes(got["logits"]), as_bytes(trainer["logits"])), \
                    f"version {version}: inference rank {i}'s logits differ from the trainer's"
            else:
                torch.testing.assert_close(got["logits"], trainer["logits"], atol=logits_tolerance, rtol=logits_tolerance)
            count += 1
        if version:  # the weights really change between versions
            before = torch.load(dump / f"inference-0-v{version - 1}.pt")
            assert not torch.equal(before["logits"], torch.load(dump / f"inference-0-v{version}.pt")["logits"])
    return count


def pids_of(job_name: str, local: LocalJob | None = None) -> list[int]:
    """Every live process that belongs to the job's pods: the pod processes and their children
    (of that one run when `local` is given: other runs of a job of the same name may be going on)."""
    markers = [f"{contract.Env.JOB}={job_name}".encode()]
    if local is not None:
        markers.append(f"{contract.Env.TOKEN_FILE}={local.pods[0].env[contract.Env.TOKEN_FILE]}".encode())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if all(m in environ for m in markers) and (entry / "stat").read_text().split()[2] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def assert_nothing_left(local: LocalJob) -> None:
    deadline = time.monotonic() + 5
    while pids_of(local.job.name, local) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids_of(local.job.name, local) == [], "processes of the job outlived the run"


def test_one_to_one_float32_odd_sizes(tmp_path):
    job = make_job("one-to-one", config=ODD, dtype="float32", steps=4, every=2)
    summary, transfers = run_to_end(tmp_path, job)
    assert summary["versions"] == 3 and summary["failed_verifications"] == 0
    assert summary["bytes_per_version"] == transfers[0]["version_bytes"] > 2 << 20
    assert check_every_version(tmp_path / "dump", job) == 3


def test_two_to_one_bfloat16_and_the_loss_goes_down(tmp_path):
    job = make_job("two-to-one", trainers=(2, 1), steps=20, every=5)
    summary, transfers = run_to_end(tmp_path, job)
    assert summary["versions"] == 5 and summary["failed_verifications"] == 0
    assert check_every_version(tmp_path / "dump", job) == 5
    losses = [t["loss"] for t in transfers[1:]]
    assert summary["final_loss"] == losses[-1] < losses[0] - 0.3, losses


def test_two_to_three_bfloat16_with_several_processes_per_pod(tmp_path):
    # one trainer pod with two processes (DDP inside the pod), one inference pod with three
    job = make_job("two-to-three", config=ODD, trainers=(1, 2), inferences=(1, 3), steps=2, every=1)
    summary, _ = run_to_end(tmp_path, job)
    assert summary["versions"] == 3 and summary["failed_verifications"] == 0
    assert check_every_version(tmp_path / "dump", job) == 9


def store_of(local: LocalJob):
    env = local.pods[0].env
    token = Path(env[contract.Env.TOKEN_FILE]).read_bytes().strip()
    return connect_store("127.0.0.1", int(env[contract.Env.STORE_PORT]), token, local.job.identity, timeout=60)


def wait_key(store, key: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        assert time.monotonic() < deadline, f"{key} was never set"
        time.sleep(0.001)


def test_a_connection_with_a_wrong_token_is_refused_and_nothing_it_sent_is_applied(tmp_path):
    from weightsync.transport.wire import ANSWER, CHALLENGE, DATA, HEADER, MAGIC

    job = make_job("wrong-token", steps=4, every=2)
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
    assert summary["versions"] == 3 and summary["failed_verifications"] == 0
    assert check_every_version(tmp_path / "dump", job) == 3
    assert "refused connection" in (local.workdir / "logs" / f"{job.pod_name(2)}.log").read_text()


def test_a_rank_with_a_wrong_token_file_fails_the_job_naming_it(tmp_path):
    job = make_job("wrong-token-file")
    local = LocalJob(job, tmp_path / "run", progress=io.StringIO())
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-job-token-at-all")
    local.pods[2].env[contract.Env.TOKEN_FILE] = str(wrong)  # the inference pod
    local.start()
    try:
        with pytest.raises(RunFailed, match="inference rank 0 failed the job token proof"):
            local.wait(timeout=240)
    finally:
        local.stop()
    assert local.transfers == []
    assert_nothing_left(local)


def test_how_a_process_ended_is_said_in_words():
    from weightsync.roles import exit_status

    assert exit_status(-signal.SIGKILL) == "was probably out of memory (killed by SIGKILL)"
    assert exit_status(-signal.SIGTERM) == "was killed by signal SIGTERM"
    assert exit_status(3) == "exited with code 3"


def test_in_a_cluster_every_process_stays_up_after_the_end_until_sigterm(tmp_path):
    # In a pod an exiting process is restarted, so after the job's end every rank and the
    # controller wait for the operator to scale them down.
    job = make_job("lingering", steps=2, every=2)
    local = LocalJob(job, tmp_path / "run", {"KUBERNETES_SERVICE_HOST": "127.0.0.1"}, progress=io.StringIO())
    local.start()
    try:
        assert local.follow(timeout=240)["state"] == "Succeeded"
        store = store_of(local)
        # the completion comes once every rank has seen the end: after it the operator removes the
        # pods, the controller's store with them
        assert store.check(["bye/trainer/0", "bye/inference/0"])
        still = time.monotonic() + 1.0
        while time.monotonic() < still:
            assert [p.proc.poll() for p in local.pods] == [None] * 3
            time.sleep(0.05)
        for pod in local.pods:
            pod.proc.send_signal(signal.SIGTERM)
        assert [pod.proc.wait(30) for pod in local.pods] == [0, 0, 0]
    finally:
        local.stop()
    assert_nothing_left(local)


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
