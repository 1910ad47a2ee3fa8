"""spec.<role>.podTemplate against a real API server: the CRD (with its CEL rules, within the
API server's cost limits) takes a full template, and refuses what the job owns naming the field,
and what collides with the job's own with its rule's message. Dry runs: nothing is created."""

import pytest
import yaml

from weightsync import job as contract

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def dry_run(cluster, role_section: dict):
    obj = {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "tpl", "namespace": "default"},
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
