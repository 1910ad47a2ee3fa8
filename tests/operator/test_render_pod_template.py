"""spec.<role>.podTemplate merged into the pods the operator renders: every field it takes, how
each merges with the job's own, what the render refuses, and what rolls which role's pods."""

import pytest

from weightsync.job import API_VERSION, CONTROLLER, INFERENCE, KIND, LABEL_ROLE, TRAINER, Job, SpecError, load_job
from weightsync_operator import render


def job(spec=None):
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "demo", "namespace": "team-a"},
        "spec": {"model": {"config": {"model_type": "gpt2", "n_layer": 2}}, **(spec or {})}})


def unchecked(spec):
    """A job the CRD's rules never saw (an older CRD): the render checks the template itself."""
    return Job("demo", "team-a", job().spec | spec)


def pod(j, role, mode="tcp"):
    return render.statefulset(j, role, mode)["spec"]["template"]


def worker(j, role, mode="tcp"):
    (c,) = pod(j, role, mode)["spec"]["containers"]
    return c


def template(spec=None, metadata=None, **container):
    out = {"spec": {**(spec or {}), **({"containers": [{"name": "worker", **container}]} if container else {})}}
    return out | ({"metadata": metadata} if metadata else {})


PVC = {"name": "models", "persistentVolumeClaim": {"claimName": "llama", "readOnly": True}}
MOUNT = {"name": "models", "mountPath": "/models", "readOnly": True}
AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}
SPREAD = [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
           "labelSelector": {"matchLabels": {"weightsync.io/job": "demo"}}}]


@pytest.mark.parametrize("role", [CONTROLLER, TRAINER, INFERENCE])
def test_every_field_of_a_roles_template_reaches_its_pods_alone(role):
    j = job({role: {"podTemplate": template(
        {"volumes": [PVC], "affinity": AFFINITY, "topologySpreadConstraints": SPREAD, "priorityClassName": "rl-high",
         "schedulerName": "volcano", "runtimeClassName": "nvidia", "imagePullSecrets": [{"name": "mine"}]},
        {"labels": {"team": "rl"}, "annotations": {"owner": "alice"}},
        env=[{"name": "NCCL_DEBUG", "value": "INFO"},
             {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        envFrom=[{"configMapRef": {"name": "vllm-settings"}}], volumeMounts=[MOUNT])}})
    p = pod(j, role)
    assert p["metadata"]["labels"]["team"] == "rl" and p["metadata"]["labels"][LABEL_ROLE] == role
    assert p["metadata"]["annotations"]["owner"] == "alice" and render.SPEC_HASH_ANNOTATION in p["metadata"]["annotations"]
    s = p["spec"]
    assert s["volumes"][-1] == PVC and [v["name"] for v in s["volumes"][:3]] == ["spec", "token", "tmp"]
    assert (s["affinity"], s["topologySpreadConstraints"]) == (AFFINITY, SPREAD)
    assert (s["priorityClassName"], s["schedulerName"], s["runtimeClassName"]) == ("rl-high", "volcano", "nvidia")
    assert s["imagePullSecrets"] == [{"name": "mine"}]
    c = s["containers"][0]
    assert c["volumeMounts"][-1] == MOUNT and c["envFrom"] == [{"configMapRef": {"name": "vllm-settings"}}]
    assert c["env"][-2:] == [{"name": "NCCL_DEBUG", "value": "INFO"},
                             {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    # What the job owns is as it renders it without a template.
    plain = pod(job(), role)
    for name in ("command", "image", "ports", "securityContext", "startupProbe", "livenessProbe", "readinessProbe"):
        assert c.get(name) == plain["spec"]["containers"][0].get(name), name
    assert s["securityContext"] == plain["spec"]["securityContext"]
    for other in {CONTROLLER, TRAINER, INFERENCE} - {role}:
        assert "affinity" not in pod(j, other)["spec"] and "team" not in pod(j, other)["metadata"]["labels"]


def test_a_templates_env_follows_the_jobs_and_replaces_its_writable_defaults_in_place():
    j = job({"inference": {"podTemplate": template(env=[{"name": "HF_HOME", "value": "/models/hf"},
                                                        {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}])}})
    names = [e["name"] for e in worker(j, INFERENCE)["env"]]
    plain = [e["name"] for e in worker(job(), INFERENCE)["env"]]
    assert names == [*plain, "VLLM_LOGGING_LEVEL"] and names.count("HF_HOME") == 1
    assert {"name": "HF_HOME", "value": "/models/hf"} in worker(j, INFERENCE)["env"]


def test_node_selectors_and_tolerations_add_to_the_roles_own_and_pull_secrets_to_the_jobs():
    j = job({"imagePullSecrets": [{"name": "registry"}], "trainer": {
        "nodeSelector": {"pool": "train"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
        "podTemplate": template({"nodeSelector": {"zone": "a"}, "tolerations": [{"key": "spot", "operator": "Exists"}],
                                 "imagePullSecrets": [{"name": "registry"}, {"name": "mine"}]})}})
    s = pod(j, TRAINER)["spec"]
    assert s["nodeSelector"] == {"pool": "train", "zone": "a"}
    assert s["tolerations"] == [{"key": "gpu", "operator": "Exists"}, {"key": "spot", "operator": "Exists"}]
    assert s["imagePullSecrets"] == [{"name": "registry"}, {"name": "mine"}]


def test_resources_in_the_template_take_the_roles_gpus_and_rdma_device_as_spec_resources_do():
    j = job({"trainer": {"gpusPerProc": 1, "podTemplate": template(resources={"limits": {"memory": "64Gi"}})}})
    assert worker(j, TRAINER, "rdma")["resources"]["limits"] == {
        "memory": "64Gi", render.GPU_RESOURCE: "1", "rdma/rdma_shared_device_a": "1"}


REFUSED = [
    ({"metadata": {"labels": {"weightsync.io/role": "x"}}}, "weightsync.io/role is the job's own label"),
    ({"metadata": {"labels": {"app.kubernetes.io/instance": "x"}}}, "app.kubernetes.io/instance is the job's own label"),
    ({"metadata": {"annotations": {"weightsync.io/spec-hash": "x"}}}, "weightsync.io/spec-hash is the job's own annotation"),
    ({"metadata": {"annotations": {"prometheus.io/port": "1"}}}, "prometheus.io/port is the job's own annotation"),
    (template({"volumes": [{"name": "tmp", "emptyDir": {}}]}), "tmp is the job's own volume"),
    (template({"volumes": [{"name": "creds", "projected": {"sources": []}}]}), "creds is a projected volume"),
    (template({"nodeSelector": {"pool": "b"}}), "pool is set in the role's nodeSelector too"),
    (template(env=[{"name": "WEIGHTSYNC_ORDINAL", "value": "0"}]), "WEIGHTSYNC_ORDINAL is set by the job itself"),
    (template(env=[{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}]), "NCCL_SOCKET_IFNAME is set by the job itself"),
    (template(env=[{"name": "MASTER_ADDR", "value": "x"}]), "MASTER_ADDR is set by the job itself"),
    (template(env=[{"name": "MINE", "value": "x"}]), "MINE is set in spec.trainer.env too"),
    (template({"volumes": [PVC]}, volumeMounts=[{"name": "other", "mountPath": "/x"}]), "other is not a volume"),
    (template({"volumes": [PVC]}, volumeMounts=[{"name": "models", "mountPath": "/dev/shm"}]), "/dev/shm is the job's own mount"),
    (template(resources={"limits": {"cpu": "2"}}), "resources are set in spec.<role>.resources too"),
    ({"spec": {"containers": [{"name": "sidecar"}]}}, "'sidecar' is not the job's container"),
]


@pytest.mark.parametrize("podtemplate,message", REFUSED, ids=[m for _, m in REFUSED])
def test_the_render_refuses_what_collides_with_the_jobs_own(podtemplate, message):
    trainer = {"command": ["python", "train.py"], "env": [{"name": "MINE", "value": "1"}],
               "nodeSelector": {"pool": "a"}, "resources": {"limits": {"cpu": "1"}}, "podTemplate": podtemplate}
    with pytest.raises(SpecError, match="spec.trainer.podTemplate") as err:
        pod(unchecked({"trainer": {**job({"trainer": {"command": ["python"]}}).spec["trainer"], **trainer}}), TRAINER)
    assert message in str(err.value)


PLACING = [template({"affinity": AFFINITY}), template({"topologySpreadConstraints": SPREAD}),
           template({"priorityClassName": "rl-high"}), template({"schedulerName": "volcano"}),
           template({"runtimeClassName": "nvidia"}), template({"imagePullSecrets": [{"name": "mine"}]}),
           template({"nodeSelector": {"zone": "a"}}), template({"tolerations": [{"key": "spot", "operator": "Exists"}]}),
           {"metadata": {"labels": {"team": "rl"}, "annotations": {"owner": "alice"}}},
           template(resources={"requests": {"memory": "8Gi"}})]


@pytest.mark.parametrize("podtemplate", PLACING, ids=lambda t: str(t)[:60])
def test_a_template_field_that_only_places_or_sizes_pods_replaces_that_roles_pods_alone(podtemplate):
    before, after = job(), job({"trainer": {"podTemplate": podtemplate}})
    assert pod(before, TRAINER) != pod(after, TRAINER)
    for role in (CONTROLLER, INFERENCE):
        assert pod(before, role) == pod(after, role), role


@pytest.mark.parametrize("podtemplate", [template({"volumes": [PVC]}, volumeMounts=[MOUNT]),
                                         template(env=[{"name": "NCCL_DEBUG", "value": "INFO"}]),
                                         template(envFrom=[{"secretRef": {"name": "s"}}])], ids=["volumes", "env", "envFrom"])
def test_a_template_field_the_processes_read_rolls_every_role(podtemplate):
    before, after = job(), job({"trainer": {"podTemplate": podtemplate}})
    for role in (CONTROLLER, TRAINER, INFERENCE):
        assert (pod(before, role)["metadata"]["annotations"][render.SPEC_HASH_ANNOTATION]
                != pod(after, role)["metadata"]["annotations"][render.SPEC_HASH_ANNOTATION]), role
