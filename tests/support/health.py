"""A worker pod's probes from the outside, as the kubelet sends them: the environment of a real
`weightsync worker` pod process (a small job's controller or trainer pod), a probe of its health
endpoint, and waiting for what it answers. The health tests and the PID 1 signal tests share them."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from support import waits
from weightsync.job import API_VERSION, KIND, LIVENESS, Env, load_job
from weightsync.local import ports
from weightsync.runtime import health

DEADLINE = 60  # seconds for anything to happen on a loaded machine


def answer(port: int, spec=LIVENESS) -> tuple[bool, str]:
    return health.probe("127.0.0.1", port, spec)


def until(what: str, check, timeout: float = DEADLINE):
    return waits.until(what, check, timeout, every=0.1)


def worker_env(tmp_path: Path, ordinal: int, procs: int = 1) -> dict:
    job = load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "probed"},
        "spec": {"model": {"config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64,
                                      "n_positions": 16}},
                 "trainer": {"replicas": 1, "procsPerPod": procs, "gpusPerProc": 0},
                 "inference": {"replicas": 1, "gpusPerProc": 0}, "network": {"mode": "tcp"}}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job.to_object()))
    (tmp_path / "token").write_text("t" * 32)
    store, port = ports.lease([1, 1])  # this test process's until it ends
    base = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    return {**base, Env.ORDINAL: str(ordinal), Env.SPEC_FILE: str(tmp_path / "job.yaml"),
            Env.TOKEN_FILE: str(tmp_path / "token"), Env.CONTROLLER_HOST: "127.0.0.1",
            Env.POD_IP: "127.0.0.1", Env.STORE_PORT: str(store), Env.HEALTH_PORT: str(port),
            Env.JOB: "probed", "PYTHONUNBUFFERED": "1"}
