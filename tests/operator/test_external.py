"""A job with an external role (spec.trainer.external, spec.inference.external): the operator's
children without that role's pods, the Secret "<job>-join" its processes join with, and a status
that waits only on the pods the operator runs. Pure functions, no cluster."""

import base64

import yaml

from weightsync.job import (
    ANNOTATION_NETWORK_MODE,
    ANNOTATION_NETWORK_REASON,
    ANNOTATION_TOKEN_SHA256,
    ANNOTATION_WORKER_IMAGE,
    API_VERSION,
    CONTROLLER,
    INFERENCE,
    KIND,
    SPEC_KEY,
    STORE_PORT,
    TOKEN_KEY,
    TRAINER,
    Env,
    load_job,
)
from weightsync.job.join import Join, JoinEnv
from weightsync.job.states import Condition
from weightsync_operator import reconcile, render, status, tokens

TOKEN = tokens.derive(b"k" * 32, "0b5e2c3a-uid")
EXTERNAL_TRAINERS = {"trainer": {"external": True, "replicas": 1, "procsPerPod": 2},
                     "inference": {"replicas": 2}}
EXTERNAL_VLLM = {"inference": {"external": True, "engine": "vllm", "replicas": 2}}


def job(spec, name="demo", namespace="team-a"):
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"config": {"model_type": "gpt2", "n_layer": 2}}, **spec}})


def by_kind(objs):
    out = {}
    for o in objs:
        out.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    return out


def body(j, uid="0b5e2c3a-uid"):
    """The job as the API server stores it, with the decisions the operator recorded."""
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": j.name, "namespace": j.namespace, "uid": uid,
                         "annotations": {ANNOTATION_NETWORK_MODE: "tcp",
                                         ANNOTATION_NETWORK_REASON: "spec.network.mode is tcp",
                                         ANNOTATION_WORKER_IMAGE: "worker:1",
                                         ANNOTATION_TOKEN_SHA256: tokens.fingerprint(TOKEN)}},
            "spec": j.spec}


def decoded(secret):
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_external_trainers_get_no_statefulset_and_the_rest_is_rendered_as_ever():
    j = job(EXTERNAL_TRAINERS)
    kinds = by_kind(render.children(j, "tcp", TOKEN))
    assert set(kinds["StatefulSet"]) == {"demo-controller", "demo-inference"}
    assert set(kinds["Secret"]) == {"demo-token", "demo-join"}
    assert set(kinds["Service"]) == {"demo"} and set(kinds["ConfigMap"]) == {"demo-spec"}
    assert {"ServiceAccount", "Role", "RoleBinding"} <= set(kinds)
    # The inference pods keep their place in the job's one ordinal space: after the trainers' ranks.
    inference = kinds["StatefulSet"]["demo-inference"]["spec"]
    assert (inference["ordinals"]["start"], inference["replicas"]) == (j.layout.first_ordinal(INFERENCE), 2) == (2, 2)
    # The ConfigMap says which roles are external: the controller waits for those ranks to join.
    assert load_job(yaml.safe_load(kinds["ConfigMap"]["demo-spec"]["data"][SPEC_KEY])).trainer.external


def test_external_vllm_servers_get_no_inference_statefulset():
    j = job(EXTERNAL_VLLM)
    kinds = by_kind(render.children(j, "tcp", TOKEN))
    assert set(kinds["StatefulSet"]) == {"demo-controller", "demo-trainer"}
    assert "demo-join" in kinds["Secret"]


def test_a_job_without_external_roles_has_no_join_secret():
    kinds = by_kind(render.children(job({}), "tcp", TOKEN))
    assert set(kinds["Secret"]) == {"demo-token"} and len(kinds["StatefulSet"]) == 3


def test_the_join_secret_holds_the_three_variables_a_joiner_parses():
    j = job(EXTERNAL_TRAINERS)
    secret = render.join_secret(j, TOKEN)
    assert secret["metadata"]["name"] == j.join_secret_name == "demo-join"
    assert secret["type"] == "Opaque" and secret["metadata"]["labels"] == j.labels()
    values = decoded(secret)
    assert values == {JoinEnv.CONTROLLER: f"demo-controller-0.demo.team-a.svc:{STORE_PORT}",
                      JoinEnv.JOB_ID: "team-a/demo", JoinEnv.TOKEN: TOKEN}
    # The controller is where the job's own pods dial it; the token is the token Secret's.
    pod_env = {e["name"]: e.get("value") for e in render.env(j, INFERENCE, "tcp")}
    assert values[JoinEnv.CONTROLLER] == f"{pod_env[Env.CONTROLLER_HOST]}:{pod_env[Env.STORE_PORT]}"
    assert base64.b64decode(render.secret(j, TOKEN)["data"][TOKEN_KEY]).decode() == values[JoinEnv.TOKEN]
    # What a process with envFrom of it reads back.
    joined = Join.from_environ(values)
    assert (joined.controller_host, joined.store_port, joined.job_id, joined.token) == (
        j.controller_host, STORE_PORT, j.identity, TOKEN.encode())


def test_every_child_of_an_external_job_is_owned_by_it():
    j = job(EXTERNAL_TRAINERS)
    owned = reconcile.desired(j, body(j), "tcp", TOKEN, "worker:1", None)
    join_secret = next(m for m in owned if m["metadata"]["name"] == "demo-join")
    assert join_secret["metadata"]["ownerReferences"] == [{
        "apiVersion": API_VERSION, "kind": KIND, "name": "demo", "uid": "0b5e2c3a-uid",
        "controller": True, "blockOwnerDeletion": True}]
    assert all(m["metadata"]["ownerReferences"] == join_secret["metadata"]["ownerReferences"] for m in owned)


def test_a_changed_or_foreign_join_secret_is_put_back_and_the_right_one_is_left_alone():
    j = job(EXTERNAL_TRAINERS)
    stored = body(j)
    right = render.join_secret(j, TOKEN)
    assert not reconcile.drifted(None, stored, right)
    for key, value in ((JoinEnv.TOKEN, "x" * 43), (JoinEnv.JOB_ID, "team-a/other"),
                       (JoinEnv.CONTROLLER, "elsewhere:29500")):
        changed = {**right, "data": {**right["data"], key: base64.b64encode(value.encode()).decode()}}
        assert reconcile.drifted(None, stored, changed), key
    extra = {**right, "data": {**right["data"], "MORE": base64.b64encode(b"1").decode()}}
    assert reconcile.drifted(None, stored, extra)
    # The token Secret is still told apart by its own key.
    assert not reconcile.drifted(None, stored, render.secret(j, TOKEN))


def test_status_of_an_external_role_says_external_and_ready_waits_only_on_the_operators_pods():
    j = job(EXTERNAL_TRAINERS)
    layout, external = j.layout, (TRAINER,)
    created = status.condition(Condition.CHILDREN_CREATED, True, "Created", "ok")
    pending = status.compute({}, layout, {CONTROLLER: {"ready": 1}}, [], [created], external=external)
    assert pending["phase"] == "Pending"
    assert pending["replicas"][TRAINER] == {"ready": 0, "desired": 0, "summary": "external (2 ranks)",
                                            "restarts": 0, "rejoins": 0}
    ready = {c["type"]: c for c in pending["conditions"]}[Condition.READY]
    assert ready["message"] == "ready pods: controller 1/1, trainer external (2 ranks), inference 0/2"

    running = status.compute(pending, layout, {CONTROLLER: {"ready": 1}, INFERENCE: {"ready": 2}}, [],
                             external=external)
    assert running["phase"] == "Running"
    ready = {c["type"]: c for c in running["conditions"]}[Condition.READY]
    assert ready["status"] == "True"
    assert ready["message"].startswith("1 controller and 2 inference pods are ready; the 2 trainer ranks are external")
    assert {r: v["summary"] for r, v in running["replicas"].items()} == {
        CONTROLLER: "1/1", TRAINER: "external (2 ranks)", INFERENCE: "2/2"}

    done = status.compute({**running, "completion": {"state": "Succeeded", "versions": 3}}, layout, {}, [],
                          external=external)
    assert done["phase"] == "Succeeded"
    assert done["replicas"][TRAINER]["summary"] == "external (2 ranks)"


def test_the_created_condition_names_the_external_ranks_and_their_secret():
    j = job(EXTERNAL_TRAINERS)
    message = reconcile.created_message(j, render.children(j, "tcp", TOKEN))
    assert message == ("Service, Secrets (token, join), ConfigMap, ServiceAccount, Role, RoleBinding and 2 "
                       "StatefulSets (3 pods) match the job; no pods for the trainer ranks (external: your own "
                       "processes join with envFrom Secret demo-join)")
    plain = job({})
    assert reconcile.created_message(plain, render.children(plain, "tcp", TOKEN)) == (
        "Service, Secret, ConfigMap, ServiceAccount, Role, RoleBinding and 3 StatefulSets (3 pods) match the job")
