"""vLLM servers the user starts as a job's inference ranks (spec.inference.external), for real:
`weightsync run --join-env FILE` runs the controller and the built-in trainer, and the test starts
vLLM's OpenAI-compatible server (its CPU build) itself with the variables of FILE, its own URL and
weightsync as its weight-transfer backend; nobody calls the server afterwards but the controller.

What is checked: the server's worker joins by itself as vLLM builds it, and every version it serves
is the trainer's, bit for bit; after the job it goes on serving the last one. Its engine core
alone killed in the middle of loading a version (its server paused; the OOM killer takes the
process that holds the model), its worker ends with it, and the version goes on without it at
once, not when the controller's load call, which the API server holds open, would have timed out;
the user then ends what is left of the server and starts it again under its URL: it rejoins and
receives the next version in full, three versions after it went away, and a client asking it
every 0.2 s from its start is refused (503, naming no version) until it holds the fleet's
version, then answered only from that version. Without a job file (the user's torchrun of
examples/integrations/vllm_trainer_api.py, two FSDP2 ranks written against vLLM's own trainer API
with weightsync's init info, into two vLLM servers started with nothing but a secret shared with
the trainer): trainer rank 0 runs the job's controller, each server joins at the trainer's init,
every version is what vLLM's own reload of the trainer's checkpoint from disk holds, each rank
sends half of it, and a server killed between two sends is counted away. An int8 job
(spec.model.quantization): a server on the job's int8 checkpoint takes its versions, each worker's
int8 weights and scales the trainer's bytes, and one of the same model unquantized is refused at
its worker's init on one line. While
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
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.external_vllm import (
    LLAMA,
    SERVER_ARGS,
    UP_TIMEOUT,
    VLLM_API_EXAMPLE,
    ExternalServer,
    assert_served_bit_for_bit,
    free_port,
    read_join_file,
    traced_init,
    vllm_python,
)
from support.vllm import (
    amx_tiles,
    assert_int8_slices,
    checker,
    completion,
    int8_checkpoint,
    post,
    save_checkpoint,
    vllm_job,
)
from support.vllm_asker import Asker, spans
from support.waits import until
from transformers import AutoConfig, AutoModelForCausalLM

from weightsync.job import API_VERSION, KIND, TORCHRUN_VARS, Model, load_job
from weightsync.job.join import Join, JoinEnv
from weightsync.local.runner import LocalJob
from weightsync.model.build import meta_layout
from weightsync.rendezvous.claims import Claim, ClaimRefused, claim
from weightsync.rendezvous.external_rank import fetch_job
from weightsync.rendezvous.proofs import control_key
from weightsync.runtime.faults import DUMP_DIR_ENV, PAUSE_DIR_ENV, PAUSE_LIMIT_ENV
from weightsync.vllm_backend.guard import sign

pytestmark = pytest.mark.slow  # whole jobs and vLLM servers as processes: not in `make unit`

OTHER = {**LLAMA, "intermediate_size": 384}  # another model: its MLP's shapes differ
NO_JOB = "vllm-trainer"  # the job a trainer with no job file runs (its init info's default name)
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
    # The trainer holds once more before version 5 is ready until the restarted server's client was
    # refused: a server whose API came up only after version 5 reached it would show no refusal.
    for point in ("trainer-0-before-ready-v1", "inference-0-loading-v3", "trainer-0-before-go-v4",
                  "trainer-0-before-ready-v5"):
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
        # only its engine core killed: its worker, which beats for the rank, ends with it, so the
        # controller takes the server for gone (not for a live server that failed the load, which
        # would fail the job), and gives up the load call the API server holds open
        server.kill_engine_core()
        killed = time.monotonic()
        controller_log = local.pods[0].log
        until("the controller counting the killed server away",
              lambda: "inference rank 0 is away" in controller_log.read_text(errors="replace"), 60)
        until("version 3 going on without the killed server", lambda: "version 3 goes on without them"
              in controller_log.read_text(errors="replace"), 60)
        took = time.monotonic() - killed
        assert took < job.transfer.timeout / 2, f"version 3 went on {took:.0f}s after the engine core died"
        print(f"engine core killed mid-load: version 3 went on without the server {took:.1f}s later "
              f"(the load call's deadline: {job.transfer.timeout:.0f}s)")
        server.stop()  # what is left of it (its API process), as the user's supervisor ends a server whose engine died
        back = ExternalServer(python, job.model, job.name, join, tmp_path / "back.log", url=server.url,
                              port=server.port, env={DUMP_DIR_ENV: str(dump)})
        servers.append(back)
        client = Asker(back.url, job.name, 0.2)  # a client of the server that joins late, from its start on
        until("the restarted server rejoining",
              lambda: "inference rank 0 rejoined (start 2" in controller_log.read_text(errors="replace"), UP_TIMEOUT)
        (pause / "trainer-0-before-go-v4.release").touch()
        reach(pause, "trainer-0-before-ready-v5", local)
        until("the restarted server refusing its client before it holds the fleet's version",
              lambda: any(status == 503 for _, status, _ in client.seen), UP_TIMEOUT)
        (pause / "trainer-0-before-ready-v5.release").touch()
        summary = local.wait(RUN_TIMEOUT)
        # version 3 was loading in the killed server and version 4 went while it was away, so they
        # reached no one; the restarted one has the next in full
        assert summary["versions"] == 4 and summary["failed_verifications"] == 0, summary
        assert [t["inference_ranks"] for t in local.transfers] == [1, 1, 1, 0, 0, 1], local.transfers
        assert back.weight_version() == "5", "the server stopped serving the last version at the job's end"
        assert back.proc.poll() is None
        until("the server that joined late answering its client", client.admitted, 60)
        client.stop()
        # three versions after it went away (3 and 4 reached no one): refused, naming no version,
        # until it held the fleet's version, then only tokens of that version
        refusals, first = client.refused_until("5")
        print(f"external server joining late: up {refusals[0][0]:.1f}s after its start, refused {len(refusals)} "
              f"requests (503), admitted {client.seen[first][0]:.1f}s after its start: "
              + "; ".join(f"{a:.1f}-{b:.1f}s {'no answer' if st is None else st} {v or ''}".rstrip()
                          for a, b, st, v in spans(client.seen)))
    finally:
        for s in servers:
            s.stop()
        local.stop()
    assert_served_bit_for_bit(dump, versions=(0, 1, 2, 5))
    assert sorted(p.name for p in dump.glob("inference-*")) == [f"inference-0-v{v}.pt" for v in (0, 1, 2, 5)]
    assert "taken back at version 5" in back.text()


def test_a_server_on_the_jobs_int8_checkpoint_takes_its_versions_and_an_unquantized_one_is_refused(tmp_path):
    """spec.model.quantization int8 with servers the user starts: one on the job's own int8
    checkpoint (vLLM's load from disk, its compressed-tensors quantization_config) claims its rank
    with the checkpoint's int8 layout, and after every version holds the trainer's int8 weights and
    scales, read back from vLLM's int8 kernel. One started at the same time on the same model
    unquantized is refused on one line before it claims a rank, and receives nothing."""
    python = vllm_python()
    dtype = "bfloat16" if amx_tiles() else "float32"  # vLLM's AMX int8 kernel takes 16-bit activations only
    job = vllm_job("ext-int8", trainers=1, servers=1, steps=4, quantization="int8", dtype=dtype,
                   checkpoint=int8_checkpoint(tmp_path / "checkpoint"), external=True)  # versions 0..2
    dump = tmp_path / "dump"
    dump.mkdir()
    local = LocalJob(job, tmp_path / "run", {DUMP_DIR_ENV: str(dump)}, join_env=tmp_path / "join.env")
    servers: list[ExternalServer] = []
    try:
        local.start()
        join = read_join_file(tmp_path / "join.env")
        server = ExternalServer(python, job.model, job.name, join, tmp_path / "server.log", env={DUMP_DIR_ENV: str(dump)})
        plain = ExternalServer(python, Model(config=LLAMA, dtype=dtype), job.name, join, tmp_path / "plain.log")
        servers += [server, plain]
        assert plain.exited() != 0
        summary = local.wait(RUN_TIMEOUT)
    finally:
        for s in servers:
            s.stop()
        local.stop()
    assert summary["versions"] == 3 and summary["failed_verifications"] == 0, summary
    line = (f"[vLLM server {plain.url}] cannot join job default/ext-int8: the weightsync backend loads the job's "
            "spec.model.quantization int8 (compressed-tensors) in place; this server serves them unquantized")
    assert line in plain.text(), plain.text()[-3000:]
    controller = local.pods[0].log.read_text(errors="replace")
    assert f"the vLLM server at {server.url} claimed inference rank 0" in controller
    assert plain.url not in controller, "the unquantized server claimed a rank"
    assert_int8_slices(dump, job, LLAMA, 1, (0, 1, 2))


def test_a_trainer_on_vllms_own_api_runs_its_own_job_into_two_vllm_servers_with_no_job_file(tmp_path):
    """The user's torchrun of examples/integrations/vllm_trainer_api.py, two FSDP2 ranks written
    against vLLM's trainer API alone (WeightTransferTrainerFactory, HTTPVLLMWeightSyncClient,
    ModuleSource) with weightsync's init info, into two vLLM servers, and no job file: the servers
    and the trainer share a secret in their environment, trainer rank 0 runs the job's controller,
    and each server joins at the trainer's init. After each send_weights() both servers hold what
    vLLM's own reload of that step's checkpoint from disk holds (vLLM's weight checker: server 0,
    checksummed with the other first, then reloads the checkpoint and compares; the servers start
    on a checkpoint, so that they have vLLM's loader from disk) and answer its greedy tokens; each
    rank sent about half of every version. One server killed between two sends: the next version
    goes on with the other (the run's rules, --min-available 1), and the run ends well.
    Besides: the init info each server's engine is given (WeightsyncEngine.init_transfer_engine),
    and what it names, takes at most 20 steps between modules, none back up a layer
    (support/paths.py), traced in the vLLM process that runs the init (support/traced_init)."""
    python = vllm_python()
    token = secrets.token_hex(32)
    secret = {JoinEnv.TOKEN: token}
    key = control_key(token.encode(), f"default/{NO_JOB}")
    pause, checkpoints = tmp_path / "pause", tmp_path / "checkpoints"
    pause.mkdir()
    for version in (1, 2):  # trainer rank 0 holds before each next version while the test compares
        (pause / f"trainer-0-before-ready-v{version}.arm").touch()
    start = save_checkpoint(dict(AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA)).state_dict()), LLAMA,
                            tmp_path / "start")  # the servers start on other weights than any version
    model = Model(path=str(start), dtype="bfloat16")
    inits = [tmp_path / f"init-{i}.json" for i in range(2)]
    servers = [ExternalServer(python, model, NO_JOB, secret, tmp_path / f"server-{i}.log", url=None,
                              env=traced_init(inits[i])) for i in range(2)]
    trainers = None
    reloads: dict[int, float] = {}
    try:
        for server in servers:
            server.up()
        script = [VLLM_API_EXAMPLE, "--config", json.dumps(LLAMA), "--steps", "4", "--send-every", "2",
                  "--server", servers[0].url, "--server", servers[1].url, "--checkpoints", str(checkpoints),
                  "--min-available", "1", "--away-grace", "10"]
        shell = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_") and k not in TORCHRUN_VARS}
        shell.update({**secret, PAUSE_DIR_ENV: str(pause), PAUSE_LIMIT_ENV: str(RUN_TIMEOUT)})
        out = tmp_path / "trainers.log"
        trainers = subprocess.Popen([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                     *script], env=shell, cwd=tmp_path, stdout=out.open("w"), stderr=subprocess.STDOUT)

        def same_as_a_disk_reload(version: int, step: int, live: list[ExternalServer]) -> None:
            for server in live:
                server.serving(version)
            held = {s.url: checker(s.url, "checksum", key=key)["checksums"] for s in live}
            answered = {s.url: completion(s.url, NO_JOB, key=key) for s in live}
            began = time.monotonic()  # then the first server reloads the step's checkpoint as vLLM alone would
            post(live[0].url, "/collective_rpc", {"method": "reload_weights", "kwargs": {
                "weights_path": str(checkpoints / f"step-{step}")}}, key=key)
            reloads[version] = time.monotonic() - began
            tokens = completion(live[0].url, NO_JOB, key=key)
            for server in live:
                assert checker(live[0].url, "compare", held[server.url], key=key) == {"match": True, "mismatches": []}, \
                    f"version {version}: {server.url} holds other weights than vLLM's reload of step {step} from disk"
                assert answered[server.url] == tokens, f"version {version}: other greedy tokens"

        for version in (1, 2):
            reach_point(pause / f"trainer-0-before-ready-v{version}", trainers, out)
            same_as_a_disk_reload(version - 1, 2 * (version - 1), servers)
            if version == 2:
                servers[1].kill()  # gone between two sends
            (pause / f"trainer-0-before-ready-v{version}.release").touch()
        trainers.wait(RUN_TIMEOUT)
        log = out.read_text(errors="replace")
        assert trainers.returncode == 0, log[-5000:]
        same_as_a_disk_reload(2, 4, servers[:1])
    finally:
        if trainers is not None and trainers.poll() is None:
            trainers.kill()
        for server in servers:
            server.stop()
    records = [json.loads(line) for line in log.splitlines() if line.startswith('{"event": "transfer"')]
    assert [(r["version"], r["inference_ranks"]) for r in records] == [(0, 2), (1, 2), (2, 1)], records
    assert "version 2 went to 1 of 2 servers' workers" in log and re.search(r"inference rank \d is away", log), log[-5000:]
    shares = {int(rank): int(sent) / int(total) for rank, sent, total in
              re.findall(r"trainer rank (\d+)\] attached on cpu.*; sends (\d+) of (\d+) bytes per version", log)}
    assert sorted(shares) == [0, 1] and all(0.35 < share < 0.65 for share in shares.values()), (shares, log[-3000:])
    for server, init in zip(servers, inits):
        assert f"the vLLM server at {server.url} claimed inference rank" in log, server.text()[-3000:]
        assert init.exists(), f"no init of {server.url}'s engine was traced:\n{server.text()[-3000:]}"
        traced = json.loads(init.read_text())
        assert len(traced) == 1 and traced[0]["failed"] is None, traced
        path = traced[0]
        print(f"{server.url}: its engine's init info, from init_transfer_engine on, {path['said']}")
        assert path["steps"][:1] == [["weightsync.vllm_backend.engine", "weightsync.vllm_backend.placement"]], path["said"]
        assert len(path["steps"]) <= 20 and not path["up"], path["said"]
    # the benchmark: a version's time (the controller's record: sent, verified, loaded into both
    # servers) against vLLM's own reload of the same weights from disk, on this machine
    for r in records:
        print(f"version {r['version']}: {r['seconds']:.3f}s into {r['inference_ranks']} server(s); vLLM's reload "
              f"of the step's checkpoint from disk: {reloads[r['version']]:.3f}s; ratio "
              f"{r['seconds'] / reloads[r['version']]:.2f}")


def reach_point(point: Path, trainers: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not point.with_suffix(".reached").exists():
        assert trainers.poll() is None, f"the trainers exited before {point.name}:\n{out.read_text()[-5000:]}"
        assert time.monotonic() < deadline, f"{point.name} was not reached within {RUN_TIMEOUT:.0f}s"
        time.sleep(0.1)
