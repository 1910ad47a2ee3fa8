"""spec.<role>.podTemplate in the job contract: the CRD's schema takes only what a user may add
to a role's pods, its CEL rules refuse what collides with the job's own (the same rules the API
server runs, evaluated here as `weightsync run` does), and the names those rules reserve are
every name the job sets."""

import pytest

from weightsync.job import (
    API_VERSION,
    KIND,
    ROLES,
    SHM_MOUNT,
    SPEC_MOUNT,
    TMP_MOUNT,
    TOKEN_MOUNT,
    TORCHRUN_VARS,
    WRITABLE_ENV,
    EnvVar,
    PodSite,
    SpecError,
    load_job,
    pod_env,
    podtemplate,
)


def job(role="trainer", template=None, **section):
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "demo"},
            "spec": {"model": {"config": {"model_type": "gpt2"}}, role: {**section, "podTemplate": template or {}}}}


def worker(**fields):
    return {"spec": {"containers": [{"name": "worker", **fields}]}}


FULL = {
    "metadata": {"labels": {"team": "rl"}, "annotations": {"owner": "alice"}},
    "spec": {
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "llama"}}],
        "nodeSelector": {"zone": "a"}, "tolerations": [{"key": "spot", "operator": "Exists"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}],
        "priorityClassName": "high", "schedulerName": "volcano", "runtimeClassName": "nvidia",
        "imagePullSecrets": [{"name": "mine"}],
        "containers": [{"name": "worker", "env": [{"name": "HF_HOME", "value": "/models/hf"},
                                                  {"name": "NCCL_DEBUG", "value": "INFO"},
                                                  {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                        "envFrom": [{"configMapRef": {"name": "c"}}],
                        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
                        "resources": {"limits": {"memory": "64Gi"}}}],
    },
}


@pytest.mark.parametrize("role", ["controller", "trainer", "inference"])
def test_every_role_takes_a_template_and_reads_it_typed(role):
    j = load_job(job(role, FULL))
    t = j.pods(role).pod_template
    assert (t.labels, t.annotations) == ({"team": "rl"}, {"owner": "alice"})
    assert t.volumes[0]["persistentVolumeClaim"] == {"claimName": "llama"}
    assert set(t.scheduling) == {"nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
                                 "priorityClassName", "schedulerName", "runtimeClassName", "imagePullSecrets"}
    assert t.env[:2] == (EnvVar("HF_HOME", "/models/hf"), EnvVar("NCCL_DEBUG", "INFO"))
    assert t.env[2].value_from == {"secretKeyRef": {"name": "s", "key": "k"}}
    assert t.resources == {"limits": {"memory": "64Gi"}} and t.volume_mounts[0]["mountPath"] == "/models"
    assert t.unresolved_env() == ["env T: valueFrom (secretKeyRef) needs Kubernetes to resolve it",
                                  "envFrom[0] (configMapRef) needs Kubernetes to resolve it"]
    assert load_job(job(role)).pods(role).pod_template.empty


@pytest.mark.parametrize("template,field", [
    ({"spec": {"hostNetwork": True}}, "podTemplate.spec.hostNetwork"),
    ({"spec": {"serviceAccountName": "admin"}}, "podTemplate.spec.serviceAccountName"),
    ({"spec": {"securityContext": {"runAsUser": 0}}}, "podTemplate.spec.securityContext"),
    ({"spec": {"initContainers": []}}, "podTemplate.spec.initContainers"),
    (worker(image="mine"), "podTemplate.spec.containers[0].image"),
    (worker(command=["sh"]), "podTemplate.spec.containers[0].command"),
    (worker(ports=[]), "podTemplate.spec.containers[0].ports"),
    (worker(livenessProbe={}), "podTemplate.spec.containers[0].livenessProbe"),
    (worker(securityContext={"privileged": True}), "podTemplate.spec.containers[0].securityContext"),
    ({"metadata": {"name": "x"}}, "podTemplate.metadata.name"),
])
def test_what_the_job_owns_is_no_field_of_the_template(template, field):
    with pytest.raises(SpecError) as err:
        load_job(job("trainer", template))
    assert f"spec.trainer.{field}: unknown field" in str(err.value)


CEL = [
    ({"metadata": {"labels": {"weightsync.io/job": "x"}}}, {}, "podTemplate.metadata.labels may not set weightsync.io/*"),
    ({"metadata": {"labels": {"controller-revision-hash": "x"}}}, {}, "podTemplate.metadata.labels may not set"),
    ({"metadata": {"annotations": {"prometheus.io/scrape": "false"}}}, {}, "may not set weightsync.io/*, prometheus.io/*"),
    ({"metadata": {"annotations": {"k8s.v1.cni.cncf.io/networks": "n"}}}, {}, "set spec.network.rdma.networks"),
    ({"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}, {}, "podTemplate volume names spec, token, tmp and dshm"),
    ({"spec": {"containers": [{"name": "sidecar"}]}}, {}, "podTemplate.spec.containers takes only the job's container"),
    ({"spec": {"volumes": [{"name": "host", "hostPath": {"path": "/"}}]}}, {}, "may not be hostPath, secret or projected"),
    ({"spec": {"volumes": [{"name": "creds", "secret": {"secretName": "s"}}]}}, {}, "take a Secret's keys through"),
    ({"spec": {"containers": [{"name": "worker"}, {"name": "worker"}]}}, {}, "podTemplate.spec.containers: "),
    (worker(env=[{"name": "WEIGHTSYNC_JOB", "value": "x"}]), {}, "may not set WEIGHTSYNC_* variables"),
    (worker(env=[{"name": "NCCL_IB_HCA", "value": "mlx5_0"}]), {}, "set them in spec.network.rdma or spec.network.tcp"),
    (worker(env=[{"name": "WORLD_SIZE", "value": "2"}]), {}, "may not set torchrun's MASTER_ADDR"),
    (worker(env=[{"name": "A", "value": "1", "valueFrom": {}}]), {}, "take value or valueFrom, not both"),
    (worker(volumeMounts=[{"name": "v", "mountPath": "/v"}]), {}, "every podTemplate volumeMount must name a volume"),
    ({"spec": {"volumes": [{"name": "v"}], "containers": [{"name": "worker", "volumeMounts": [
        {"name": "v", "mountPath": "/tmp"}]}]}}, {}, "may not mount at /tmp, /dev/shm"),
    (worker(resources={"limits": {"cpu": "1"}}), {"resources": {"limits": {"cpu": "2"}}},
     "set the role's resources in spec.<role>.resources or in its podTemplate's worker container, not both"),
    ({"spec": {"nodeSelector": {"pool": "b"}}}, {"nodeSelector": {"pool": "a"}},
     "a node label is set in both spec.<role>.nodeSelector and its podTemplate.spec.nodeSelector"),
    (worker(env=[{"name": "MINE", "value": "1"}]), {"command": ["python"], "env": [{"name": "MINE", "value": "2"}]},
     "a variable is set in both spec.trainer.env and spec.trainer.podTemplate's worker env"),
]


@pytest.mark.parametrize("template,section,message", CEL, ids=[m[:50] for _, _, m in CEL])
def test_collisions_with_the_jobs_own_are_refused_by_the_crds_rules(template, section, message):
    with pytest.raises(SpecError) as err:
        load_job(job("trainer", template, **section))
    assert message in str(err.value) and "spec.trainer" in str(err.value)
    # The operator's render refuses the same collisions, should one reach it past an older CRD.
    spec = job("trainer", template, **section)["spec"]["trainer"]
    if message not in ("podTemplate.spec.containers: ", "take value or valueFrom, not both"):
        assert podtemplate.pod_template_problems(template, spec, {e["name"]: 1 for e in spec.get("env", [])})


@pytest.mark.parametrize("role", ["controller", "inference"])
def test_the_role_rules_hold_in_every_role(role):
    with pytest.raises(SpecError, match=f"spec.{role}: a node label is set in both"):
        load_job(job(role, {"spec": {"nodeSelector": {"pool": "b"}}}, nodeSelector={"pool": "a"}))


@pytest.mark.parametrize("role,more", [("trainer", {}), ("inference", {"engine": "vllm"})])
def test_an_external_role_has_no_pods_to_template(role, more):
    with pytest.raises(SpecError, match=f"spec.{role}: spec.<role>.podTemplate applies to the pods weightsync"):
        load_job(job(role, worker(env=[{"name": "A", "value": "1"}]), external=True, **more))


def test_the_reserved_names_are_every_name_the_job_sets():
    j = load_job(job("trainer", {}, command=["python"]) | {"spec": {
        "model": {"config": {"model_type": "gpt2"}}, "trainer": {"command": ["python"]},
        "network": {"rdma": {"hcas": ["mlx5_0"]}, "tcp": {"socketIfname": "eth0"}}}})
    site = PodSite("ns", "0", "p", "1.2.3.4", "c", 1, 2, 3, "/s", "/t", "m", 4, False,
                            writable=WRITABLE_ENV)
    names = {n for role in ROLES for mode in ("rdma", "tcp") for n in pod_env(j, role, mode, site)}
    unreserved = {n for n in names if not n.startswith(podtemplate.RESERVED_ENV_PREFIX)} - set(WRITABLE_ENV)
    assert unreserved <= set(podtemplate.NETWORK_ENV) | set(podtemplate.TORCHRUN_ENV), unreserved
    assert set(podtemplate.TORCHRUN_ENV) == set(TORCHRUN_VARS)
    for name in [*podtemplate.NETWORK_ENV, *podtemplate.TORCHRUN_ENV]:  # the CRD's lists are these
        with pytest.raises(SpecError, match="podTemplate env may not set"):
            load_job(job("inference", worker(env=[{"name": name, "value": "1"}])))
    for name in WRITABLE_ENV:
        load_job(job("inference", worker(env=[{"name": name, "value": "/models"}])))
    assert {SPEC_MOUNT, TOKEN_MOUNT, TMP_MOUNT, SHM_MOUNT} <= set(
        podtemplate.RESERVED_MOUNT_PATHS)
