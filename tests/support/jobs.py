"""Whole jobs run by `weightsync run`'s LocalJob for the tests: small models, a job to run to its
end, every version it delivered checked against the trainer's dumps, and nothing left behind."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
import torch

from weightsync.job import API_VERSION, KIND, Env, load_job
from weightsync.local.runner import LocalJob, RunFailed
from weightsync.rendezvous.channel import connect_store
from weightsync.rendezvous.protocol import versions
from weightsync.runtime.faults import DUMP_DIR_ENV

TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 32,
        "bos_token_id": 0, "eos_token_id": 0}


# Tensors of sizes no power of two divides, a version of ~2.8 MB: 1 MiB buckets cut through tensors.
ODD = {"model_type": "gpt2", "n_layer": 2, "n_embd": 150, "n_head": 5, "vocab_size": 1001, "n_positions": 37,
       "bos_token_id": 0, "eos_token_id": 0}


def make_job(name, config=TINY, dtype="bfloat16", trainers=(1, 1), inferences=(1, 1), steps=4, every=2, gpus=(0, 0),
             **transfer):
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
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


def summary_of(local: LocalJob, timeout: float) -> dict:
    """A started local job's summary once it ended; a job that failed fails the test with its
    reason and the end of every pod's log. Then every process stopped and none left behind."""
    try:
        summary = local.wait(timeout=timeout)
    except RunFailed as e:
        pytest.fail(f"{e}\n" + "\n".join(p.log.read_text()[-3000:] for p in local.pods))
    finally:
        local.stop()
    assert_nothing_left(local)
    return summary


def outcome_of(local: LocalJob, timeout: float) -> dict | RunFailed:
    """A started job's end: its summary, or the RunFailed that says why it failed; then every
    process stopped and none left behind."""
    try:
        outcome = local.wait(timeout=timeout)
    except RunFailed as e:
        outcome = e
    finally:
        local.stop()
    assert_nothing_left(local)
    return outcome


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_every_version(dump: Path, job, logits_tolerance: float | None = None) -> int:
    """Every inference rank, after every version: the trainers' tensors bit for bit, and the logits
    of the trainer's model cast to the job's dtype on the same input (identical; within a
    tolerance only where trainer and inference compute on different kinds of device)."""
    layout = job.layout
    dtype = getattr(torch, job.model.dtype)
    count = 0
    for version, _ in versions(job):
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
    markers = [f"{Env.JOB}={job_name}".encode()]
    if local is not None:
        markers.append(f"{Env.TOKEN_FILE}={local.pods[0].env[Env.TOKEN_FILE]}".encode())
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


def store_of(local: LocalJob):
    env = local.pods[0].env
    token = Path(env[Env.TOKEN_FILE]).read_bytes().strip()
    return connect_store("127.0.0.1", int(env[Env.STORE_PORT]), token, local.job.identity, timeout=60)


def wait_key(store, key: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        assert time.monotonic() < deadline, f"{key} was never set"
        time.sleep(0.001)

