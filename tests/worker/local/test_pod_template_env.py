"""`weightsync run` and spec.<role>.podTemplate: its env's values reach the processes of the
role's pods (the user's trainer command reads them), one that names a default of the job's
(HF_HOME) replaces it, and what a run on this machine cannot apply is said, one line each."""

from __future__ import annotations

import io
import sys

import pytest
from support.jobs import summary_of
from support.user_script import CONFIG, EXAMPLE, example_args

from weightsync.job import API_VERSION, CONTROLLER, INFERENCE, KIND, TRAINER, load_job
from weightsync.local.runner import LocalJob

pytestmark = pytest.mark.slow  # a whole job as processes: not in `make unit`

# The trainer command: records what its environment says, then trains as the example does.
SCRIPT = ("import os, runpy, sys; from pathlib import Path\n"
          "Path(sys.argv[1], 'seen-' + os.environ['WEIGHTSYNC_ORDINAL']).write_text("
          "os.environ['NCCL_DEBUG'] + ' ' + os.environ['HF_HOME'])\n"
          "sys.argv = [sys.argv[2], *sys.argv[3:]]\n"
          "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def test_a_templates_env_reaches_the_processes_and_the_rest_is_named(tmp_path):
    hf = str(tmp_path / "hf")
    env = [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "HF_HOME", "value": hf},
           {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    template = {"metadata": {"labels": {"team": "rl"}},
                "spec": {"priorityClassName": "high", "containers": [{"name": "worker", "env": env}]}}
    job = load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "tpl"},
        "spec": {"model": {"config": CONFIG},
                 "trainer": {"gpusPerProc": 0, "command": [sys.executable, "-c", SCRIPT],
                             "args": [str(tmp_path), EXAMPLE, *example_args(tmp_path, "--steps", "2", "--publish-every", "2")],
                             "podTemplate": template},
                 "inference": {"gpusPerProc": 0, "podTemplate": template},
                 "transfer": {"bucketMB": 1, "transport": "tcp", "timeoutSeconds": 60}, "network": {"mode": "tcp"}}})
    progress = io.StringIO()
    local = LocalJob(job, tmp_path / "run", progress=progress)
    for pod in local.pods:
        has = pod.role != CONTROLLER
        assert (pod.env.get("NCCL_DEBUG"), pod.env.get("HF_HOME") == hf) == (("WARN", True) if has else (None, False)), pod.name
        assert "HF_TOKEN" not in pod.env
    lines = progress.getvalue().splitlines()
    for role in (TRAINER, INFERENCE):
        assert (f"weightsync: spec.{role}.podTemplate env HF_TOKEN: valueFrom (secretKeyRef) needs Kubernetes to "
                f"resolve it; the local {role} processes run without it") in lines
        for path in ("metadata.labels", "spec.priorityClassName"):
            assert (f"weightsync: spec.{role}.podTemplate.{path}: not applicable locally (it applies to the job's "
                    "pods in a cluster)") in lines
    local.start()
    summary = summary_of(local, 300)
    assert summary["failed_verifications"] == 0
    assert (tmp_path / "seen-1").read_text() == f"WARN {hf}"  # the trainer pod's command, ordinal 1
