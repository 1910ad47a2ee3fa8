"""The `cluster` fixture: a real local Kubernetes control plane (hack/cluster/controlplane.py)
shared by every test marked `@pytest.mark.cluster`, started once per session and stopped at its end.

`make test` runs the suite in two pytest-xdist workers (`--dist loadgroup`): every test marked
`cluster` goes to one worker, in one group, so that one control plane and one real node serve them
all while the other worker runs the tests of processes on loopback beside it; a test module that
holds what two tests cannot share at once (the shaped links' network namespaces) is a group of
its own."""
import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack" / "cluster"))
from controlplane import ControlPlane, find_binaries  # noqa: E402


# modules whose tests must not run beside each other, by the group they run in
EXCLUSIVE = {"test_links.py": "links"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups off the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("cluster") or "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("cluster"))
        elif item.path.name in EXCLUSIVE:
            item.add_marker(pytest.mark.xdist_group(EXCLUSIVE[item.path.name]))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, pytestconfig) -> ControlPlane:
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    # Shown as it happens: the first run builds the binaries (minutes), later runs start in seconds.
    shown = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    with shown:
        binaries = find_binaries(sys.stderr)
        cp = ControlPlane(tmp_path_factory.mktemp("cluster"), binaries).up(log=sys.stderr)
        print(f"\nlocal control plane up in {cp.timings['total']:.1f}s at {cp.server} (logs: {cp.dir}/logs)",
              file=sys.stderr)
    try:
        yield cp
    finally:
        cp.down()
