"""Fixtures for the end-to-end tests: helm, one namespace and one block of loopback addresses per
test, and the operator run from the chart (tools in e2e_harness.py)."""

from __future__ import annotations

import pytest
from e2e_harness import Helm, Loopback, Operator, new_namespace
from localpod import mount_namespaces_work


@pytest.fixture
def helm(cluster, tmp_path) -> Helm:
    return Helm(cluster, tmp_path / "helm")


@pytest.fixture
def namespace(cluster):
    name = new_namespace(cluster, "e2e")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def loopback() -> Loopback:
    return Loopback()


@pytest.fixture(scope="session")
def can_run_pods():
    why = mount_namespaces_work()
    if why:
        pytest.skip(f"local pods need private mount namespaces (as containers have): {why}")


@pytest.fixture
def operator_from_chart(cluster, loopback, tmp_path, can_run_pods):
    """operator_from_chart(helm_namespace, release) -> a context manager running the operator."""

    def start(helm_namespace: str, release: str) -> Operator:
        return Operator(cluster, helm_namespace, release, loopback.take(), tmp_path / "pods")

    return start
