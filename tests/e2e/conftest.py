"""Fixtures for the end-to-end tests: helm, one namespace per test (gone before the next test
starts), the real node that runs the project's images, and the operator as the chart runs it
(tools in e2e_harness.py)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
from e2e_harness import Helm, Operator, install, new_namespace, restricted

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hack" / "node"))
from node import RealNode, unavailable  # noqa: E402


@pytest.fixture
def helm(cluster, tmp_path) -> Helm:
    return Helm(cluster, tmp_path / "helm")


@pytest.fixture
def namespace(cluster):
    name = new_namespace(cluster, "e2e")
    yield name
    cluster.delete_namespaces(name)


@pytest.fixture(scope="module")
def real_node(cluster, tmp_path_factory, pytestconfig) -> RealNode:
    """A real node (containerd, kubelet, kube-proxy, CoreDNS) for this module's tests. KWOK's
    CPU-only node is cordoned while it runs, so that pods that need no GPU run here for real."""
    why = unavailable()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the real-pod tests, but: {why}")
        pytest.skip(f"real pods cannot run on this machine: {why}")
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    shown = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    node = RealNode(cluster, tmp_path_factory.mktemp("node"))
    with shown:
        node.up(log=sys.stderr)
        t = node.timings
        print(f"\nreal node {node.name} up in {t['total']:.1f}s (containerd {t['containerd']:.1f}s, images "
              f"{t['images']:.1f}s, kubelet {t['kubelet']:.1f}s, cluster DNS {t['dns']:.1f}s)", file=sys.stderr)
    try:
        yield node
    finally:
        node.down()


@pytest.fixture
def operator_from_chart(cluster, real_node):
    """operator_from_chart(helm_namespace, release) -> a context manager for the chart's operator pod."""

    def start(helm_namespace: str, release: str) -> Operator:
        return Operator(cluster, helm_namespace, release, real_node.name)

    return start


@pytest.fixture
def chart(cluster, helm, namespace, tmp_path):
    """The chart's package, as `make dist` builds it, installed as `make deploy-*` installs it,
    watching the test's namespace, with the images the tests built (the chart's defaults, as
    `make images` tags them)."""
    release, ns = "weightsync", new_namespace(cluster, "weightsync-system")
    restricted(cluster, ns)
    package = helm.package(tmp_path / "chart")
    install(helm, release, ns, f"watchNamespaces={{{namespace}}}", "metrics.scrapeConfig.enabled=true",
            "metrics.scrapeConfig.interval=1s", chart=package)
    yield release, ns
    helm("uninstall", release, "--namespace", ns, "--ignore-not-found", "--wait", check=False)
    cluster.delete_namespaces(ns)
