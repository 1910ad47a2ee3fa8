"""The join contract (job/join.py): the three variables an external rank needs, written for a job
and read back, each missing or malformed one refused with a line naming it; the spec's external
roles and the CEL rules that go with them, as the local runner applies them."""

import os
import socket

import pytest

from weightsync.job import (
    API_VERSION,
    KIND,
    Env,
    Join,
    JoinEnv,
    SpecError,
    WorkerContext,
    external_roles,
    join_env,
    load_job,
)

TOKEN = b"0123456789abcdef-job-token"


def job(spec=None, name="demo"):
    base = {"model": {"config": {"model_type": "gpt2", "n_layer": 2}}}
    return load_job({"apiVersion": API_VERSION, "kind": KIND,
                              "metadata": {"name": name, "namespace": "team"}, "spec": {**base, **(spec or {})}})


def test_join_env_reads_back_as_the_join_it_describes():
    j = job({"trainer": {"external": True}})
    env = join_env(j, "demo-controller-0.demo.team.svc", 29500, TOKEN)
    assert set(env) == set(JoinEnv.REQUIRED)
    join = Join.from_environ(env)
    assert join == Join("demo-controller-0.demo.team.svc", 29500, "team/demo", TOKEN)
    assert (join.namespace, join.name, join.controller) == ("team", "demo", env[JoinEnv.CONTROLLER])
    ipv6 = Join.from_environ(join_env(j, "::1", 4000, TOKEN))
    assert (ipv6.controller_host, ipv6.store_port, ipv6.controller) == ("::1", 4000, "[::1]:4000")


def test_the_optional_variables_are_read():
    env = {**join_env(job(), "10.0.0.1", 1, TOKEN), JoinEnv.POD_IP: "10.0.0.9", JoinEnv.VLLM_SERVER: "http://a:8000"}
    join = Join.from_environ(env)
    assert (join.pod_ip, join.vllm_server, join.local_address()) == ("10.0.0.9", "http://a:8000", "10.0.0.9")
    assert JoinEnv.POD_IP == Env.POD_IP and JoinEnv.VLLM_SERVER == Env.VLLM_SERVER


def test_without_the_controller_variable_a_process_is_not_joining():
    assert Join.from_environ({}) is None
    assert Join.from_environ({JoinEnv.JOB_ID: "a/b", JoinEnv.TOKEN: TOKEN.decode()}) is None


@pytest.mark.parametrize("change, expected", [
    ({JoinEnv.TOKEN: ""}, "WEIGHTSYNC_CONTROLLER is set but WEIGHTSYNC_TOKEN is not"),
    ({JoinEnv.JOB_ID: None, JoinEnv.TOKEN: None}, "but WEIGHTSYNC_JOB_ID and WEIGHTSYNC_TOKEN is not"),
    ({JoinEnv.CONTROLLER: "controller"}, "WEIGHTSYNC_CONTROLLER='controller': expected host:port"),
    ({JoinEnv.CONTROLLER: "controller:http"}, "WEIGHTSYNC_CONTROLLER='controller:http': expected host:port"),
    ({JoinEnv.CONTROLLER: "controller:70000"}, "expected host:port"),
    ({JoinEnv.JOB_ID: "demo"}, "WEIGHTSYNC_JOB_ID='demo': expected namespace/name"),
    ({JoinEnv.JOB_ID: "a/b/c"}, "WEIGHTSYNC_JOB_ID='a/b/c': expected namespace/name"),
    ({JoinEnv.TOKEN: "short"}, "WEIGHTSYNC_TOKEN is shorter than 16 bytes"),
])
def test_a_missing_or_malformed_variable_is_named(change, expected):
    env = {**join_env(job(), "10.0.0.1", 29500, TOKEN), **change}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(SpecError) as err:
        Join.from_environ(env)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_the_local_address_is_the_one_on_the_route_to_the_controller():
    assert Join.from_environ(join_env(job(), "127.0.0.1", 29500, TOKEN)).local_address() == "127.0.0.1"


def test_external_roles_and_the_join_secret():
    assert external_roles(job()) == ()
    j = job({"trainer": {"external": True}, "inference": {"external": True, "engine": "vllm"}})
    assert external_roles(j) == ("trainer", "inference") and j.trainer.external and j.inference.external
    assert not j.controller.external and j.join_secret_name == "demo-join"
    assert j.spec["trainer"]["external"] is True and job().spec["inference"]["external"] is False


def test_a_joined_context_is_built_without_files():
    j = job({"trainer": {"external": True, "replicas": 2, "procsPerPod": 2}})
    join = Join.from_environ(join_env(j, "127.0.0.1", 4000, TOKEN))
    ctx = WorkerContext.from_join(join, j, "trainer", 3, network_mode="tcp")
    assert (ctx.role, ctx.ordinal, list(ctx.ranks), ctx.pod_ip) == ("trainer", 2, [2, 3], "127.0.0.1")
    assert (ctx.controller_host, ctx.store_port, ctx.token, ctx.report_to_kubernetes) == ("127.0.0.1", 4000, TOKEN, False)
    # the controller names it by where it runs (the user's pod, in a cluster), not a pod weightsync would have made
    assert ctx.pod_name == f"{socket.gethostname()} (pid {os.getpid()})"


@pytest.mark.parametrize("spec, expected", [
    ({"inference": {"external": True}}, "spec.inference: spec.inference.external needs spec.inference.engine vllm"),
    ({"trainer": {"external": True, "command": ["torchrun", "train.py"]}},
     "spec.trainer: spec.trainer.command runs in the trainer pods weightsync starts"),
    ({"trainer": {"external": "yes"}}, "spec.trainer.external"),
])
def test_external_roles_are_refused_where_they_cannot_work(spec, expected):
    with pytest.raises(SpecError) as err:
        job(spec)
    assert expected in str(err.value)
