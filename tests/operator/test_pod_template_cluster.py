"""spec.<role>.podTemplate against a real API server: the CRD (with its CEL rules, within the
API server's cost limits) takes a full template, and refuses what the job owns naming the field,
and what collides with the job's own with its rule's message (dry runs); and the operator's
StatefulSets and pods carry what a role's template adds."""

import pytest
import yaml
from controlplane import wait_for

from weightsync.job import API_VERSION, KIND

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def dry_run(cluster, role_section: dict):
    obj = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "tpl", "namespace": "default"},
           "spec": {"model": {"config": {"model_type": "gpt2"}}, "trainer": role_section}}
    return cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(obj), check=False)


def test_the_api_server_takes_a_template_and_refuses_what_the_job_owns(cluster, crd_applied):
    worker = {"name": "worker", "env": [{"name": "HF_HOME", "value": "/models/hf"}, {"name": "NCCL_DEBUG", "value": "INFO"}],
              "volumeMounts": [{"name": "models", "mountPath": "/models"}], "resources": {"limits": {"memory": "8Gi"}}}
    template = {"metadata": {"labels": {"team": "rl"}},
                "spec": {"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "llama"}}],
                         "affinity": {"nodeAffinity": {}}, "priorityClassName": "high", "containers": [worker]}}
    accepted = dry_run(cluster, {"podTemplate": template})
    assert accepted.returncode == 0, accepted.stderr

    owned = dry_run(cluster, {"podTemplate": {"spec": {"hostNetwork": True}}})
    assert owned.returncode != 0 and 'unknown field "spec.trainer.podTemplate.spec.hostNetwork"' in owned.stderr, owned.stderr

    clash = dry_run(cluster, {"podTemplate": {"spec": {"containers": [
        {"name": "worker", "env": [{"name": "WEIGHTSYNC_ORDINAL", "value": "0"}]}]}}})
    assert clash.returncode != 0, clash.stderr
    assert "spec.trainer.podTemplate.spec.containers[0].env[0]" in clash.stderr
    assert "podTemplate env may not set WEIGHTSYNC_* variables" in clash.stderr

    host = dry_run(cluster, {"podTemplate": {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}})
    assert host.returncode != 0 and "spec.trainer.podTemplate.spec.volumes[0]" in host.stderr, host.stderr
    assert "may not be hostPath, secret or projected volumes" in host.stderr


def test_the_operators_pods_carry_a_roles_template(ns):
    """What the operator renders from a template, as the API server stores it, and pods made from it."""
    worker = {"name": "worker", "env": [{"name": "HF_HOME", "value": "/models/hf"}, {"name": "NCCL_DEBUG", "value": "INFO"}],
              "volumeMounts": [{"name": "models", "mountPath": "/models"}]}
    template = {"metadata": {"labels": {"team": "rl"}, "annotations": {"owner": "alice"}},
                "spec": {"volumes": [{"name": "models", "emptyDir": {}}], "containers": [worker],
                         "tolerations": [{"key": "spot", "operator": "Exists"}]}}
    ns.apply_job("tpl", {"trainer": {"replicas": 1, "podTemplate": template}, "network": {"mode": "tcp"}})
    sts = wait_for("the trainers' StatefulSet", lambda: ns.get("statefulset", "tpl-trainer"))
    pod = sts["spec"]["template"]
    assert pod["metadata"]["labels"]["team"] == "rl" and pod["metadata"]["annotations"]["owner"] == "alice"
    assert pod["spec"]["volumes"][-1]["name"] == "models" and {"key": "spot", "operator": "Exists"} in pod["spec"]["tolerations"]
    (c,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert (env["HF_HOME"], env["NCCL_DEBUG"]) == ("/models/hf", "INFO") and c["volumeMounts"][-1]["mountPath"] == "/models"
    inference = wait_for("the inference StatefulSet", lambda: ns.get("statefulset", "tpl-inference"))
    assert "team" not in inference["spec"]["template"]["metadata"]["labels"]
    wait_for("a trainer pod with the template's label",
             lambda: [p for p in ns.get("pods", selector="team=rl")["items"] if p["metadata"]["name"] == "tpl-trainer-1"])
