"""vLLM servers the user starts as a job's inference ranks (spec.inference.external), for real:
`weightsync run --join-env FILE` runs the controller and the built-in trainer, and the test starts
vLLM's OpenAI-compatible server (its CPU build) itself with the variables of FILE, its own URL and
weightsync as its weight-transfer backend; nobody calls the server afterwards but the controller.

What is checked: the server's worker joins by itself as vLLM builds it, and every version it serves
is the trainer's, bit for bit; after the job it goes on serving the last one. Its API server process
alone killed in the middle of loading a version (its server paused), its engine core and worker
end with it, and the version goes on without it; started again under its URL, it rejoins and
receives the next version in full. With both roles
external (the user's torchrun of examples/integrations/vllm_trainer_api.py as the trainers, two
FSDP2 ranks written against vLLM's own trainer API with weightsync's init info; `weightsync run`
runs the controller alone) each rank sends half of every version, and the last version the server
serves is the script's final weights. While
the job runs, servers that cannot join exit, each with its one line in its log, and none of them
receives or loads anything: a server of another model (its worker refuses itself, having read the
job) and one without WEIGHTSYNC_VLLM_SERVER (refused before vLLM loads the model); and the claim
of one more server than the job has ranks for, posted through the job's store as a worker posts it,
is refused by the running controller, which says so in its log and in `weightsync run`'s progress.
A refused claim (a full job, the same server again) takes the same way out of the server as
another model (vllm_backend/place.py); the other refusals' decisions and lines are tested without
vLLM (rendezvous/test_claims.py, test_external_join.py), each vLLM start here costing a minute of
the machine.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from support.external_vllm import (
    LLAMA,
    SERVER_ARGS,
    UP_TIMEOUT,
    VLLM_API_EXAMPLE,
    ExternalServer,
    assert_served_bit_for_bit,
    free_port,
    fused,
    read_join_file,
    vllm_python,
)
from support.jobs import as_bytes
from support.waits import until

from weightsync.job import API_VERSION, KIND, TORCHRUN_VARS, Model, load_job
from weightsync.job.join import Join, JoinEnv
from weightsync.local.runner import LocalJob
from weightsync.model.build import meta_layout
from weightsync.rendezvous.claims import Claim, ClaimRefused, claim
from weightsync.rendezvous.external_rank import fetch_job
from weightsync.rendezvous.protocol import control_key
from weightsync.runtime.faults import DUMP_DIR_ENV, PAUSE_DIR_ENV, PAUSE_LIMIT_ENV
from weightsync.vllm_backend.guard import sign

pytestmark = pytest.mark.slow  # whole jobs and vLLM servers as processes: not in `make unit`

OTHER = {**LLAMA, "intermediate_size": 384}  # another model: its MLP's shapes differ
RUN_TIMEOUT = 900.0


def external_job(name: str, steps: int = 4, trainers_external: bool = False, trainers: int = 1):
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
        "spec": {"model": {"config": LLAMA, "dtype": "bfloat16"},
                 "trainer": {"replicas": trainers, "gpusPerProc": 0, "external": trainers_external},
                 "inference": {"replicas": 1, "gpusPerProc": 0, "engine": "vllm", "external": True,
                               "vllm": {"args": list(SERVER_ARGS)}},
                 "training": {"steps": steps, "batchSize": 4, "seqLen": 32, "learningRate": 1e-2},
                 "transfer": {"everySteps": 2, "bucketMB": 1, "transport": "tcp", "timeoutSeconds": 120},
                 "network": {"mode": "tcp"}}})


def reach(pause: Path, point: str, local: LocalJob) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (pause / f"{point}.reached").exists():
        assert local.completion is None, f"the job ended before {point}: {local.completion}"
        assert time.monotonic() < deadline, f"{point} was not reached within {RUN_TIMEOUT:.0f}s"
        time.sleep(0.1)


def claim_refused(join: dict[str, str], job, url: str) -> str:
    """Why the running job's controller refuses the claim a worker of a vLLM server at `url`, of
    the job's model, posts (vllm_backend/place.py), made here through the job's store with the join
    variables; the refusal takes the server's way out that another model's takes (place_of)."""
    _, channel = fetch_job(Join.from_environ(join))
    try:
        with pytest.raises(ClaimRefused) as refused:
            claim(channel, Claim(url, 0, 1, meta_layout(job.model).to_json()), RUN_TIMEOUT)
    finally:
        channel.close()
    return str(refused.value)


def test_an_external_server_joins_by_itself_and_servers_that_cannot_join_exit_saying_why(tmp_path):
    python = vllm_python()
    job = external_job("ext-vllm", steps=10)  # versions 0..5
    dump, pause = tmp_path / "dump", tmp_path / "pause"
    dump.mkdir()
    pause.mkdir()
    # the trainer holds before it is ready for version 1 while the refused servers try (nothing has
    # a deadline then: vLLM servers starting at once take minutes on two busy cores), and in
    # version 4 (announced to no one: the server is away) while the server, killed in the middle of
    # loading version 3 (paused, its update call in), starts again; each as long as the test takes.
    # (With the default limit, faults.PAUSE_LIMIT, version 1 once went on by itself while the refused
    # servers started, and version 3's load waited in its pause past the update call's deadline.)
    for point in ("trainer-0-before-ready-v1", "inference-0-loading-v3", "trainer-0-before-go-v4"):
        (pause / f"{point}.arm").touch()
    progress = io.StringIO()
    local = LocalJob(job, tmp_path / "run", {DUMP_DIR_ENV: str(dump), PAUSE_DIR_ENV: str(pause),
                                             PAUSE_LIMIT_ENV: str(RUN_TIMEOUT)},
                     progress=progress, join_env=tmp_path / "join.env")
    servers: list[ExternalServer] = []
    try:
        local.start()
        join = read_join_file(tmp_path / "join.env")
        server = ExternalServer(python, job.model, job.name, join, tmp_path / "server.log",
                                env={DUMP_DIR_ENV: str(dump), PAUSE_DIR_ENV: str(pause)})
        servers.append(server)
        reach(pause, "trainer-0-before-ready-v1", local)
        server.serving(0)
        key = control_key(join[JoinEnv.TOKEN].encode(), join[JoinEnv.JOB_ID])
        for bearer in (None, key):  # a client is refused; the job's key reaches the worker, which has nothing to do
            signed = {"Authorization": "Bearer " + sign(bearer, "POST", "/init_weight_transfer_engine")} if bearer else {}
            headers = {"Content-Type": "application/json", **signed}
            request = urllib.request.Request(server.url + "/init_weight_transfer_engine", b'{"init_info": {}}', headers)
            with pytest.raises(urllib.error.HTTPError) as answered:  # it joined as vLLM built it
                urllib.request.urlopen(request, timeout=60)
            assert (answered.value.code == 401) == (bearer is None), answered.value.code
        assert "joined job default/ext-vllm when its server started: there is nothing to initialize" in server.text()

        refused = {
            "other": ExternalServer(python, Model(config=OTHER, dtype="bfloat16"), job.name, join,
                                    tmp_path / "other.log"),
            "no-url": ExternalServer(python, job.model, job.name, join, tmp_path / "no-url.log", url=None),
        }
        servers += refused.values()
        beyond = f"http://127.0.0.1:{free_port()}"  # one server more than the job has: its worker's claim
        assert claim_refused(join, job, beyond) == (
            f"job default/ext-vllm is full: its 1 inference servers (spec.inference.replicas) have joined "
            f"({server.url}) and are there; a server joins only in place of one that stopped")
        lines = {
            "other": "cannot join job default/ext-vllm: this server serves another model than job default/ext-vllm: "
                     "tensor #",
            "no-url": "weightsync: WEIGHTSYNC_VLLM_SERVER is not set: a vLLM server that joins job default/ext-vllm "
                      "needs its own URL as the controller reaches it",
        }
        for what, other in refused.items():
            assert other.exited() != 0, what
            assert lines[what] in other.text(), f"{what}:\n{other.text()[-3000:]}"
        assert "intermediate_size" not in lines["other"] and "384" in refused["other"].text().split(lines["other"])[1]
        assert "Loading weights took" not in refused["no-url"].text(), "refused only after vLLM loaded the model"
        controller = local.pods[0].log.read_text(errors="replace")
        assert f"the vLLM server at {server.url} claimed inference rank 0" in controller
        assert f"refused the vLLM server at {beyond}: job default/ext-vllm is full" in controller
        until("weightsync run showing the claims", lambda: "refused the vLLM server" in progress.getvalue(), 10)
        assert f"the vLLM server at {server.url} claimed inference rank 0" in progress.getvalue()

        (pause / "trainer-0-before-ready-v1.release").touch()
        reach(pause, "inference-0-loading-v3", local)  # the server paused for version 3's load
        # only its API server process killed: its engine core and worker, which beat for the rank,
        # end with it at once, so the controller takes the server for gone (not for a live server
        # that failed the load, which would fail the job)
        server.kill_api_server()
        until("the server's engine core and worker ending with its API server", server.all_gone, 10)
        controller_log = local.pods[0].log
        until("the controller counting the killed server away",
              lambda: "inference rank 0 is away" in controller_log.read_text(errors="replace"), 60)
        until("version 3 going on without the killed server", lambda: "version 3 goes on without them"
              in controller_log.read_text(errors="replace"), 60)
        back = ExternalServer(python, job.model, job.name, join, tmp_path / "back.log", url=server.url,
                              port=server.port, env={DUMP_DIR_ENV: str(dump)})
        servers.append(back)
        until("the restarted server rejoining",
              lambda: "inference rank 0 rejoined (start 2" in controller_log.read_text(errors="replace"), UP_TIMEOUT)
        (pause / "trainer-0-before-go-v4.release").touch()
        summary = local.wait(RUN_TIMEOUT)
        # version 3 was loading in the killed server and version 4 went while it was away, so they
        # reached no one; the restarted one has the next in full
        assert summary["versions"] == 4 and summary["failed_verifications"] == 0, summary
        assert [t["inference_ranks"] for t in local.transfers] == [1, 1, 1, 0, 0, 1], local.transfers
        assert back.weight_version() == "5", "the server stopped serving the last version at the job's end"
        assert back.proc.poll() is None
    finally:
        for s in servers:
            s.stop()
        local.stop()
    assert_served_bit_for_bit(dump, versions=(0, 1, 2, 5))
    assert sorted(p.name for p in dump.glob("inference-*")) == [f"inference-0-v{v}.pt" for v in (0, 1, 2, 5)]
    assert "taken back at version 5" in back.text()


def test_both_roles_external_a_trainer_on_vllms_own_api_into_the_users_vllm_server(tmp_path):
    """The user's torchrun of examples/integrations/vllm_trainer_api.py, two FSDP2 ranks written
    against vLLM's trainer API alone (WeightTransferTrainerFactory, HTTPVLLMWeightSyncClient,
    ModuleSource) with weightsync's init info: each rank sends its own half of every version."""
    python = vllm_python()
    job = external_job("ext-both", trainers_external=True, trainers=2)
    dump = tmp_path / "dump"
    dump.mkdir()
    local = LocalJob(job, tmp_path / "run", {DUMP_DIR_ENV: str(dump)}, progress=io.StringIO(),
                     join_env=tmp_path / "join.env")
    assert [p.role for p in local.pods] == ["controller"]
    server = trainers = None
    try:
        local.start()
        join = read_join_file(tmp_path / "join.env")
        server = ExternalServer(python, job.model, job.name, join, tmp_path / "server.log", env={DUMP_DIR_ENV: str(dump)})
        script = [VLLM_API_EXAMPLE, "--config", json.dumps(LLAMA), "--steps", "4", "--send-every", "2",
                  "--server", server.url, "--save", str(tmp_path / "final.pt")]
        shell = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_") and k not in TORCHRUN_VARS}
        command = (f"set -a; . {shlex.quote(str(tmp_path / 'join.env'))}; set +a; exec {shlex.quote(python)} "
                   f"-m torch.distributed.run --standalone --nproc-per-node 2 {shlex.join(script)}")
        trainers = subprocess.Popen(["bash", "-c", command], env=shell, cwd=tmp_path, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        summary = local.wait(RUN_TIMEOUT)
        out, _ = trainers.communicate(timeout=120)
        assert trainers.returncode == 0, out
        assert summary["versions"] == 3 and summary["failed_verifications"] == 0, summary
        assert server.weight_version() == "2"
    finally:
        if trainers is not None and trainers.poll() is None:
            trainers.kill()
        if server is not None:
            server.stop()
        local.stop()
    shares = {int(rank): int(sent) / int(total) for rank, sent, total in
              re.findall(r"trainer rank (\d+)\] attached on cpu.*; sends (\d+) of (\d+) bytes per version", out)}
    assert sorted(shares) == [0, 1] and all(0.35 < share < 0.65 for share in shares.values()), (shares, out[-3000:])
    saved = fused({name: t.to(torch.bfloat16) for name, t in torch.load(tmp_path / "final.pt").items()})
    got = torch.load(dump / "inference-0-v2.pt")["tensors"]
    assert sorted(got) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), f"the server holds other bytes in {name}"
