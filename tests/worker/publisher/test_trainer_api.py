"""The trainer API from a user's own script, run as spec.trainer.command by `weightsync run` (local
processes on loopback, each pod with its environment): examples/train_with_weightsync.py with FSDP2
under torchrun (two pods of two ranks, shards of uneven sizes); every version is verified by digest
on the inference ranks, and the final version there equals, bit for bit, the final weights the
script saved. With DDP (plain python, one rank per pod, each sending from its replica) the same
script runs in test_trainer_resume.py, whose job checks that beside its resumes. A command that
exits non-zero, one that never attaches, and one that fails after attaching fail the job naming the
rank."""

from __future__ import annotations

import io
import json
import re
import sys
import time
from pathlib import Path

import pytest
import support
from support.jobs import outcome_of
from support.user_script import CONFIG, EXAMPLE, check_final_version, example_args

from weightsync.job import API_VERSION, KIND, SpecError, WorkerContext, load_job
from weightsync.local.runner import LocalJob, RunFailed
from weightsync.runtime.faults import DUMP_DIR_ENV

RUN_TIMEOUT = 300
SUPPORT = Path(support.__file__).parent

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`


def command_job(name, command, args=(), trainers=(1, 1), inferences=(1, 1), dtype="bfloat16", **trainer):
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
        "spec": {"model": {"config": CONFIG, "dtype": dtype},
                 "trainer": {"replicas": trainers[0], "procsPerPod": trainers[1], "gpusPerProc": 0,
                             "command": list(command), "args": list(args), **trainer},
                 "inference": {"replicas": inferences[0], "procsPerPod": inferences[1], "gpusPerProc": 0},
                 "transfer": {"bucketMB": 1, "transport": "tcp", "timeoutSeconds": 60},
                 "network": {"mode": "tcp"}}})


def run(tmp_path: Path, job) -> tuple[LocalJob, dict | RunFailed]:
    (tmp_path / "dump").mkdir()
    local = LocalJob(job, tmp_path / "run", {DUMP_DIR_ENV: str(tmp_path / "dump")}, progress=io.StringIO())
    local.start()
    return local, outcome_of(local, RUN_TIMEOUT)


def status(local: LocalJob) -> dict:
    return json.loads((local.workdir / "status.json").read_text())


def test_a_users_fsdp2_script_under_torchrun_sends_each_ranks_own_shard(tmp_path):
    job = command_job("user-fsdp", [sys.executable, "-m", "torch.distributed.run", EXAMPLE], example_args(tmp_path, "--fsdp"),
                      trainers=(2, 2), inferences=(1, 1), dtype="float16")
    local, summary = run(tmp_path, job)
    assert not isinstance(summary, RunFailed), summary
    assert summary["versions"] == 3 and summary["failed_verifications"] == 0
    check_final_version(tmp_path, job, 3)
    controller = local.pods[0].log.read_text()
    messages = [re.sub(r"^\S+Z \[[^\]]*\] ", "", line) for line in controller.splitlines()]  # without time and source
    shares = [m.split() for m in messages if m.strip()[:1].isdigit() and "KiB" in m]
    assert len(shares) == 4, controller  # every one of the 4 ranks sends its own share
    for pod in local.pods[1:3]:
        assert pod.log.read_text().count("from its shards") == 2


def test_a_command_that_exits_non_zero_fails_the_job_naming_the_rank(tmp_path):
    job = command_job("user-exits", [sys.executable, "-c", "import sys; sys.exit(3)"])
    local, failure = run(tmp_path, job)
    assert isinstance(failure, RunFailed)
    completion = status(local)["completion"]
    assert completion["state"] == "Failed" and completion["reason"] == "RankFailed"
    assert completion["message"].startswith("trainer rank 0 failed: the trainer command exited with code 3 before this "
                                            "rank closed its weightsync.attach()"), completion
    assert "trainer rank 0" in str(failure)


def test_a_command_that_never_attaches_fails_the_job_within_its_deadline(tmp_path):
    job = command_job("user-late", [sys.executable, "-c", "import time; time.sleep(600)"], trainers=(2, 1),
                      attachTimeoutSeconds=5)
    start = time.monotonic()
    local, failure = run(tmp_path, job)
    took = time.monotonic() - start
    assert isinstance(failure, RunFailed)
    message = status(local)["completion"]["message"]
    print(f"the job failed {took:.1f}s after its start: {message}")
    # each pod's supervisor reports its own rank at its own deadline: the first report names the job's failure
    assert re.match(r"trainer rank [01] failed: the trainer command has not called weightsync\.attach\(\) within 5s of "
                    r"its start \(spec\.trainer\.attachTimeoutSeconds\)", message), message
    assert took < RUN_TIMEOUT


FAILS_AFTER_ATTACHING = """
import json, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import weightsync

sys.path.insert(0, sys.argv[3])  # the tests' support: the rank's path through attach(), traced
from support.paths import Path, rank_of

model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(sys.argv[1])))
path = Path()
sync = path.traced(lambda: weightsync.attach(model, rank=0), "weightsync.publisher.sync", "attach", rank_of(0))
with open(sys.argv[2], "w") as f:
    json.dump({"steps": path.steps, "up": path.up, "calls": path.calls, "said": str(path)}, f)
sync.publish(step=0)
raise RuntimeError("the data loader ran dry")
"""


def test_an_exception_in_the_script_after_it_attached_fails_the_job_with_its_message(tmp_path):
    """Besides: the rank given to attach() takes at most 20 steps between modules, none back up a
    layer (support/paths.py), traced in the script's process."""
    script, traced = tmp_path / "fails.py", tmp_path / "attach-path.json"
    script.write_text(FAILS_AFTER_ATTACHING)
    job = command_job("user-raises", [sys.executable, str(script), json.dumps(CONFIG), str(traced), str(SUPPORT.parent)])
    local, failure = run(tmp_path, job)
    assert isinstance(failure, RunFailed)
    completion = status(local)["completion"]
    assert completion["message"] == "trainer rank 0 failed: RuntimeError: the data loader ran dry", completion
    path = json.loads(traced.read_text())
    print(path["said"])
    assert path["steps"] and len(path["steps"]) <= 20 and not path["up"], path["said"]


@pytest.mark.parametrize("env,expected", [
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2, but this pod runs 2 trainer ranks"),
    ({}, "this pod runs 2 trainer ranks (spec.trainer.procsPerPod): start one process per rank with torchrun"),
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, "WORLD_SIZE=2, but this process is trainer rank 3 of 4"),
])
def test_the_rank_comes_from_torchruns_variables_or_a_clear_error(env, expected):
    from weightsync.publisher.sync import rank_of

    job = command_job("ranks", ["torchrun"], trainers=(2, 2))
    ctx = WorkerContext(job, 2, "trainer", "127.0.0.1", "127.0.0.1", 1, 1, "tcp", b"x" * 16, False)
    assert rank_of(ctx, {"LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4"}) == 3
    with pytest.raises(SpecError) as err:
        rank_of(ctx, env)
    assert expected in str(err.value)


def test_weightsync_run_refuses_env_that_only_a_cluster_can_resolve():
    from weightsync.local.preflight import CannotRunHere, check_command_env

    from_secret = {"secretKeyRef": {"name": "hf", "key": "t"}}
    job = command_job("env", ["python", "train.py"], env=[{"name": "A", "value": "1"},
                                                          {"name": "HF_TOKEN", "valueFrom": from_secret}])
    with pytest.raises(CannotRunHere, match=r"spec.trainer.env\[1\] \(HF_TOKEN\) takes its value from the cluster"):
        check_command_env(job)
    values = command_job("env", ["python"], env=[{"name": "A", "value": "1"}, {"name": "B"}])
    check_command_env(values)
    assert values.trainer.env == {"A": "1", "B": ""}  # an EnvVar without a value is empty, as in Kubernetes
