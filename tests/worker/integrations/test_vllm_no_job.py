"""vLLM's trainer-side engine with no job file (integrations/vllm.py), each decision tested without
vLLM: the job made from the trainer's shape (vllm_job.own_job), the secret the trainer and the
servers share (job/join.shared_token), the init each server gets and what its guard and its
workers make of it (vllm_backend/guard.py, place.py), and the one line a refusal is. (The whole run,
two FSDP2 ranks into two real vLLM servers: vllm_backend/test_external_vllm.py; the engine's own
refusals in vLLM's Python: vllm_backend/test_plugin.py.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from support.vllm import LLAMA
from transformers import AutoConfig

from weightsync.integrations.vllm_job import dtype_of, init_info, init_refusal, model_config, own_job, trainer_world
from weightsync.job import Env, JoinEnv, SpecError
from weightsync.job.join import shared_token
from weightsync.rendezvous.external_rank import JoinError
from weightsync.rendezvous.proofs import control_key
from weightsync.vllm_backend.guard import INIT_ROUTE, ControlGuard, sign
from weightsync.vllm_backend.place import init_join, waits_for_init

TOKEN = b"s" * 32
SECRET = {JoinEnv.TOKEN: TOKEN.decode()}
URL = "http://127.0.0.1:8000"
CONTROLLER = "127.0.0.1:29700"


def job(**more):
    config = model_config(AutoConfig.for_model(**LLAMA))
    return own_job(name="vllm-trainer", config=config, dtype="bfloat16", trainers=2, servers=2, **more)


def test_the_job_is_the_trainers_shape_its_servers_external_vllm_ones():
    made = job(min_available=1, away_grace_seconds=10)
    assert made.identity == "default/vllm-trainer"
    assert made.layout.world_size("trainer") == 2 and made.layout.world_size("inference") == 2
    assert made.inference.engine == "vllm" and made.inference.external and made.trainer.external
    assert made.inference.min_available == 1 and made.inference.away_grace_seconds == 10
    assert dict(made.model.config)["hidden_size"] == 256 and made.model.dtype == "bfloat16"
    with pytest.raises(SpecError, match="minAvailable"):  # the one schema's rules
        job(min_available=5)


def test_the_versions_dtype_is_the_init_infos_else_the_configs_16_bit_one_else_bfloat16():
    config = AutoConfig.for_model(**LLAMA)
    assert dtype_of(config, None) == "bfloat16"
    assert dtype_of(AutoConfig.for_model(**LLAMA, dtype="float16"), None) == "float16"
    assert dtype_of(config, "float32") == "float32"
    with pytest.raises(SpecError, match=r"WeightsyncTrainerInitInfo\(dtype='int4'\): a version is sent in one of"):
        dtype_of(config, "int4")


def test_a_trainer_world_size_other_than_the_one_declared_is_refused_on_one_line():
    assert trainer_world(None, {"WORLD_SIZE": "2"}, 2) == 2 and trainer_world(None, {}, None) == 1
    with pytest.raises(SpecError) as e:
        trainer_world(3, {"WORLD_SIZE": "2"}, 2)
    assert e.value.problems == ["WeightsyncTrainerInitInfo(world_size=3), but torchrun's WORLD_SIZE=2: give the init "
                                "info the world size this script runs at"]
    with pytest.raises(SpecError, match="the trainer runs 2 ranks .* but its torch.distributed group has 4"):
        trainer_world(2, {}, 4)


def test_the_secret_comes_from_the_environment_or_a_file_and_is_never_short(tmp_path):
    assert shared_token(SECRET) == TOKEN and shared_token({}) is None
    file = tmp_path / "secret"
    file.write_text(TOKEN.decode() + "\n")
    assert shared_token({JoinEnv.TOKEN_FILE: str(file)}) == TOKEN
    with pytest.raises(SpecError, match="WEIGHTSYNC_TOKEN is shorter than 16 bytes"):
        shared_token({JoinEnv.TOKEN: "short"})
    with pytest.raises(SpecError, match=f"WEIGHTSYNC_TOKEN_FILE={tmp_path}/none: No such file"):
        shared_token({JoinEnv.TOKEN_FILE: str(tmp_path / "none")})


def test_a_server_with_no_job_refuses_to_start_without_the_secret(capsys):
    with pytest.raises(JoinError) as e:
        waits_for_init({})
    line = ("this vLLM server runs weightsync's weight-transfer backend with no job: set WEIGHTSYNC_TOKEN (or "
            "WEIGHTSYNC_TOKEN_FILE, a file holding it) to the secret its trainer has, in the server's environment, or "
            "the join variables of a job")
    assert str(e.value) == line and capsys.readouterr().err == f"weightsync: {line}\n"
    with pytest.raises(JoinError, match="shorter than 16 bytes"):
        waits_for_init({JoinEnv.TOKEN: "short"})
    waits_for_init(SECRET)  # waits for its trainer's init
    waits_for_init({Env.SPEC_FILE: "/etc/weightsync/spec.json"})  # a pod's server: its contract says it all


def test_a_worker_joins_the_job_its_trainers_init_names_only_proven_with_its_secret():
    made = job()
    given = SimpleNamespace(**init_info(TOKEN, made, CONTROLLER, URL + "/"))
    join, url = init_join(given, SECRET)
    assert (join.controller, join.job_id, join.token, url) == (CONTROLLER, made.identity, TOKEN, URL)
    with pytest.raises(JoinError, match="the init of job default/vllm-trainer is not proven with this server's secret"):
        init_join(given, {JoinEnv.TOKEN: "o" * 32})
    with pytest.raises(JoinError, match="no secret to check its trainer's init with"):
        init_join(given, {})
    forged = SimpleNamespace(**{**vars(given), "controller": "10.9.9.9:1"})  # another store than the one proven
    with pytest.raises(JoinError, match="not proven"):
        init_join(forged, SECRET)


def send(guard: ControlGuard, path: str, body: dict, status: int = 200, bearer: str | None = None):
    """(the guard's answer: status and body; whether the server got it), the server answering `status`."""
    reached, sent = [], []

    async def server(scope, receive, send_):
        reached.append(json.loads((await receive())["body"] or b"{}"))
        await send_({"type": "http.response.start", "status": status, "headers": []})
        await send_({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def collect(message):
        sent.append(message)

    guard.app = server
    headers = [(b"authorization", f"Bearer {bearer}".encode())] if bearer else []
    asyncio.run(guard({"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": headers},
                      receive, collect))
    return sent[0]["status"], json.loads(sent[1]["body"]), bool(reached)


def test_the_guard_passes_an_init_proven_with_its_secret_once_and_then_answers_that_jobs_controller():
    made = job()
    key = control_key(TOKEN, made.identity)
    guard = ControlGuard(None, SECRET)
    assert send(guard, "/pause", {}, bearer=sign(key, "POST", "/pause"))[0] == 403  # no job yet: no one's
    wrong = {"init_info": init_info(b"o" * 32, made, CONTROLLER, URL)}
    status, said, reached = send(guard, INIT_ROUTE, wrong)
    assert (status, reached) == (403, False)
    assert said["error"]["message"] == (
        "/init_weight_transfer_engine: this vLLM server refused the init of job default/vllm-trainer: it carried a "
        "control key that is not this job's, or a signature of another request; give the trainer and this server the "
        "same secret (WEIGHTSYNC_TOKEN or WEIGHTSYNC_TOKEN_FILE)")
    status, said, reached = send(guard, INIT_ROUTE, {"init_info": {}})
    assert (status, reached) == (400, False) and "names its job, its controller, this server and a proof" in \
        said["error"]["message"]
    good = {"init_info": init_info(TOKEN, made, CONTROLLER, URL)}
    assert send(guard, INIT_ROUTE, good, status=500)[2]  # passed, and the workers refused it: still no job
    assert guard.key is None
    good = {"init_info": init_info(TOKEN, made, CONTROLLER, URL)}
    assert send(guard, INIT_ROUTE, good)[:1] == (200,) and guard.job == made.identity
    status, said, reached = send(guard, INIT_ROUTE, good)  # the same init again: a replay
    assert (status, reached) == (403, False) and "a request answered before (a replay)" in said["error"]["message"]
    assert send(guard, "/pause", {}, bearer=sign(key, "POST", "/pause"))[2]  # the job's controller
    assert send(guard, "/pause", {})[0] == 401  # anyone else


def test_a_server_without_the_secret_refuses_a_trainers_init_on_one_line():
    status, said, reached = send(ControlGuard(None, {}), INIT_ROUTE, {"init_info": init_info(TOKEN, job(), CONTROLLER,
                                                                                                 URL)})
    assert (status, reached) == (401, False)
    assert said["error"]["message"] == (
        "POST /init_weight_transfer_engine: this vLLM server has no weightsync secret, so it takes no trainer's init: "
        "start it with WEIGHTSYNC_TOKEN (or WEIGHTSYNC_TOKEN_FILE) set to its trainer's secret")
    with pytest.raises(SystemExit, match="weightsync: WEIGHTSYNC_TOKEN is shorter than 16 bytes"):
        ControlGuard(None, {JoinEnv.TOKEN: "short"})


def test_a_servers_refusal_of_the_init_is_one_line_that_says_what_to_do():
    # vLLM's answer where the server runs another weight-transfer backend: its engine's parse_init_info
    other = json.dumps({"error": {"message": "Invalid init_info for NCCLWeightTransferEngine: NCCLWeightTransferInit"
                                             "Info.__init__() got an unexpected keyword argument 'job_id'", "code": 400}})
    assert init_refusal(URL, 400, other) == (
        f"the vLLM server at {URL} runs another weight-transfer backend (NCCLWeightTransferEngine): start it with "
        "--weight-transfer-config '{\"backend\": \"weightsync\"}'")
    none = json.dumps({"error": {"message": "Weight transfer not configured. Please set weight_transfer_config to "
                                            "enable weight transfer.", "code": 500}})
    assert init_refusal(URL, 500, none).startswith(f"the vLLM server at {URL} runs no weight-transfer backend")
    model = json.dumps({"error": {"message": "JoinError: this server serves another model than job default/vllm-"
                                             "trainer: tensor #3\nshape [384, 256]", "code": 500}})
    line = init_refusal(URL, 500, model)
    assert line.startswith(f"the vLLM server at {URL} cannot join the trainer's job: JoinError: this server serves "
                           "another model") and "\n" not in line
    assert init_refusal(URL, None, "Connection refused") == f"the vLLM server at {URL} did not answer the init: " \
                                                           "Connection refused"


def test_nothing_of_the_secret_is_in_what_the_server_is_told():
    told = json.dumps(init_info(TOKEN, job(), CONTROLLER, URL))
    assert TOKEN.decode() not in told and control_key(TOKEN, "default/vllm-trainer") not in told
