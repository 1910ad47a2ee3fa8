"""Fixtures: the CRD applied, the operator running against the session's cluster, and one
namespace per test."""

import uuid

import pytest
from support.operator_harness import CRD, Namespace, running_operator


@pytest.fixture(scope="session")
def crd_applied(cluster):
    out = cluster.kubectl("apply", "-f", str(CRD))
    cluster.wait_served("weighttransferjobs.weightsync.io")
    return out


@pytest.fixture(scope="module")
def operator(cluster, crd_applied, tmp_path_factory):
    yield from running_operator(cluster, tmp_path_factory)


@pytest.fixture
def ns(cluster, operator):
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield Namespace(cluster, name)
    finally:
        cluster.delete_namespaces(name)
