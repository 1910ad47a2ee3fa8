"""External trainers on one machine: `weightsync run --join-env FILE` starts every pod but the
trainers', writes FILE once the controller can be joined, and the user's own FSDP2 script, run
by the user's torchrun with FILE sourced, is the job's trainers: every version reaches the
inference rank, verified, the last one bit for bit the weights the script saved. A trainer with
the wrong token, a world size the job does not have or a rank another process holds is refused in
one line (the process that holds it, joined or still joining, is the one admitted), and one killed
once it joined fails the job within the trainers' silence limit, naming it, while another is still
missing; nothing is applied then (rendezvous/test_join_restarts.py: the ranks that never come, named
at their deadline). `weightsync run` refuses a job with an external role without --join-env, and
--join-env for a job without one or naming what it cannot write, before anything starts."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.jobs import outcome_of
from support.user_script import CONFIG, EXAMPLE, check_final_version, example_args
from support.waits import until

from weightsync import cli
from weightsync.job import API_VERSION, KIND, TORCHRUN_VARS, JoinEnv, load_job
from weightsync.local.runner import LocalJob, RunFailed
from weightsync.roles.controller.driver import TRAINER_SILENT_LIMIT
from weightsync.runtime.faults import DUMP_DIR_ENV, PAUSE_DIR_ENV

RUN_TIMEOUT = 300


def external_job(name, attach_timeout=300, inferences=1, dtype="float16", timeout=60):
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
            "spec": {"model": {"config": CONFIG, "dtype": dtype},
                     "trainer": {"external": True, "replicas": 1, "procsPerPod": 2, "gpusPerProc": 0,
                                 "attachTimeoutSeconds": attach_timeout},
                     "inference": {"replicas": inferences, "procsPerPod": 1, "gpusPerProc": 0},
                     "transfer": {"bucketMB": 1, "transport": "tcp", "timeoutSeconds": timeout},
                     "network": {"mode": "tcp"}}}


def start(tmp_path: Path, obj) -> tuple[LocalJob, Path, io.StringIO]:
    (tmp_path / "dump").mkdir()
    progress = io.StringIO()
    join_file = tmp_path / "join.env"
    local = LocalJob(load_job(obj), tmp_path / "run", {DUMP_DIR_ENV: str(tmp_path / "dump")}, progress=progress,
                     join_env=join_file)
    local.start()
    until("join file", local.offer.written.is_set, 120)
    return local, join_file, progress


def user_env() -> dict[str, str]:
    """The user's shell: nothing of weightsync's, nor of torchrun's, in it."""
    return {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")
            and k not in TORCHRUN_VARS}


def finish(local: LocalJob):
    return outcome_of(local, RUN_TIMEOUT)


def status(local: LocalJob) -> dict:
    return json.loads((local.workdir / "status.json").read_text())


@pytest.mark.slow
def test_the_users_fsdp2_torchrun_joins_as_the_jobs_trainers(tmp_path):
    local, join_file, progress = start(tmp_path, external_job("ext-fsdp"))
    assert stat.S_IMODE(join_file.stat().st_mode) == 0o600  # it holds the job's token
    assert [p.role for p in local.pods] == ["controller", "inference"]  # the trainers are the user's
    told = progress.getvalue()
    assert f"`set -a; . {join_file}; set +a; torchrun --standalone --nproc-per-node 2 YOUR_SCRIPT.py`" in told, told
    # as the README says: the file sourced by the user's shell, then the user's own torchrun
    script = shlex.join([EXAMPLE, *example_args(tmp_path, "--fsdp")])
    command = (f"set -a; . {shlex.quote(str(join_file))}; set +a; exec {shlex.quote(sys.executable)} -m "
               f"torch.distributed.run --standalone --nproc-per-node 2 {script}")
    trainers = subprocess.Popen(["bash", "-c", command], env=user_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    summary = finish(local)
    out, _ = trainers.communicate(timeout=120)
    assert trainers.returncode == 0, out
    assert not isinstance(summary, RunFailed), f"{summary}\n{out}"
    assert summary["versions"] == 3 and summary["failed_verifications"] == 0 and summary["restarts"] == {}
    assert [t["step"] for t in local.transfers] == [0, 3, 6]
    check_final_version(tmp_path, local.job, 3)
    assert out.count("from its shards") == 2, out  # each rank sent its own FSDP2 shard
    told = progress.getvalue()
    assert "trainer rank 0 joined (external, at 127.0.0.1)" in told and "trainer rank 1 joined" in told, told


ATTACH = 75  # seconds: spec.trainer.attachTimeoutSeconds of the job the refused trainers try to join
# seconds: its spec.transfer.timeoutSeconds, under TRAINER_SILENT_LIMIT, which makes the trainers'
# silence limit that (no version is sent in that job, and no trainer trains: only joins and a kill)
SILENT = 10
REFUSED = """
import torch, weightsync
weightsync.attach(torch.nn.Linear(2, 2))
"""


def joining(join_file: Path, **change) -> dict[str, str]:
    """A user's environment with the join file's variables (and `change`)."""
    return {**user_env(), **{k: shlex.split(v)[0] for k, v in
                             (line.split("=", 1) for line in join_file.read_text().splitlines())}, **change}


def refused(join_file: Path, tmp_path: Path, **change) -> str:
    """The last line a trainer process prints when it is refused (it must be refused)."""
    done = subprocess.run([sys.executable, "-c", REFUSED], env=joining(join_file, **change), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stderr
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_wrong_trainers_are_refused_and_one_killed_once_joined_fails_the_job_by_name(tmp_path):
    # the refusals below must all come before the attach deadline: four Python processes that import
    # torch, which take a few seconds each on two busy cores
    assert SILENT < TRAINER_SILENT_LIMIT
    local, join_file, progress = start(tmp_path, external_job("ext-refused", attach_timeout=ATTACH, timeout=SILENT))
    job_id = "default/ext-refused"
    controller = (join_file.read_text().split(f"{JoinEnv.CONTROLLER}=")[1]).split()[0]
    assert refused(join_file, tmp_path, **{JoinEnv.TOKEN: "f" * 64}, RANK="0", WORLD_SIZE="2") == (
        f"weightsync.rendezvous.external_rank.JoinError: the controller at {controller} refused this process: the job token in "
        f"WEIGHTSYNC_TOKEN is not job {job_id}'s (or that controller runs another job than WEIGHTSYNC_JOB_ID names)")
    assert refused(join_file, tmp_path, RANK="0", WORLD_SIZE="3") == (
        f"weightsync.rendezvous.external_rank.JoinError: WORLD_SIZE=3, but job {job_id} has 2 trainer ranks (spec.trainer: "
        "replicas 1 x procsPerPod 2): start exactly 2 trainer processes")
    # trainer rank 0's process holds before it proves the token (as while it builds its model); a second
    # process claiming rank 0 meanwhile is refused, and the first is the one admitted
    pause = tmp_path / "pause"
    pause.mkdir()
    (pause / "trainer-0-joining-v0.arm").touch()
    first = subprocess.Popen([sys.executable, "-c", REFUSED], cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True,
                             env=joining(join_file, RANK="0", WORLD_SIZE="2", **{PAUSE_DIR_ENV: str(pause)}))
    until("trainer rank 0 to hold before it joins", (pause / "trainer-0-joining-v0.reached").exists, 60)
    assert refused(join_file, tmp_path, RANK="0", WORLD_SIZE="2") == (
        f"weightsync.rendezvous.protocol.Restarted: trainer rank 0 of job {job_id} is taken (this is its start 2): "
        "another process joined with RANK=0, or this rank's process started again; each trainer process needs its "
        "own RANK (0..1), and trainers do not rejoin a running job")
    controller = next(p for p in local.pods if p.role == "controller").log
    until("the controller to refuse the second claim of trainer rank 0",
          lambda: "a second process claimed trainer rank 0 (start 2)" in controller.read_text(errors="replace"), 60)
    (pause / "trainer-0-joining-v0.release").touch()
    until("trainer rank 0 to join", lambda: "trainer rank 0 joined (external" in progress.getvalue(), 60)
    # killed once it joined, while trainer rank 1 is still missing: the job fails within the trainers'
    # silence limit naming trainer rank 0, not at the attach deadline naming trainer rank 1
    first.kill()
    killed = time.monotonic()
    failure = finish(local)
    took = time.monotonic() - killed
    assert isinstance(failure, RunFailed)
    completion = status(local)["completion"]
    assert completion["state"] == "Failed" and completion["reason"] == "TrainerStopped", completion
    assert completion["message"].startswith("trainer rank 0 is silent: no heartbeat for ") and \
        "after it joined, while the others join" in completion["message"], completion
    assert completion["versions"] == 0 and took < SILENT + 15, (took, completion)
    assert list((tmp_path / "dump").iterdir()) == []  # nothing was sent, nothing applied
    first.communicate(timeout=60)
    told = progress.getvalue()
    assert re.search(r"waiting for the ranks to join: trainer rank 0 joined, trainer rank 1 missing \(\d+s left, "
                     r"spec.trainer.attachTimeoutSeconds\)", told), told


def test_weightsync_run_asks_for_join_env_exactly_when_a_role_is_external(tmp_path, capsys):
    external, plain = tmp_path / "external.yaml", tmp_path / "plain.yaml"
    external.write_text(json.dumps(external_job("ext")))
    obj = external_job("plain")
    obj["spec"]["trainer"]["external"] = False
    plain.write_text(json.dumps(obj))
    assert cli.main(["run", str(external)]) == cli.EXIT_SPEC
    assert capsys.readouterr().err == ("weightsync run: job ext's trainer ranks are external (spec.trainer.external): "
                                       "pass --join-env FILE, and weightsync run writes there the variables your "
                                       "processes join the job with\n")
    assert cli.main(["run", str(plain), "--join-env", str(tmp_path / "join.env")]) == cli.EXIT_SPEC
    assert capsys.readouterr().err == ("weightsync run: --join-env: job plain has no external role "
                                       "(spec.trainer.external, spec.inference.external), so no process of yours joins "
                                       "it; drop --join-env\n")
    assert not (tmp_path / "join.env").exists()
    # a join file that cannot be written is refused before any pod starts or any folder is made
    folder = tmp_path / "folder"
    folder.mkdir()
    runs = set(Path(tempfile.gettempdir()).glob("weightsync-ext-*"))
    for where, says in ((folder, f"{folder} is a folder; name the file to write the join variables to, such as "
                                 f"{folder / 'join.env'}"),
                        (Path("/dev/null"), "/dev/null is not a regular file (a device, a pipe or a socket); name a "
                                            "file to write"),
                        (external / "join.env", f"{external} is not a folder, so {external / 'join.env'} cannot be "
                                                "written")):
        assert cli.main(["run", str(external), "--join-env", str(where)]) == cli.EXIT_SPEC
        assert capsys.readouterr().err == f"weightsync run: --join-env: {says}\n"
    assert set(Path(tempfile.gettempdir()).glob("weightsync-ext-*")) == runs and list(folder.iterdir()) == []
