"""The `cluster` fixture: a real local Kubernetes control plane (hack/cluster/controlplane.py)
shared by every test marked `@pytest.mark.cluster`, started once per session and stopped at its end.

`make test TEST_WORKERS=2` runs the suite in two pytest-xdist workers, scheduled by module: every module
with tests marked `cluster` goes to one worker, as one unit in its order, so that one control plane
and one real node (there can be only one on a machine) serve them all, while the other worker runs
the other modules (processes on loopback, vLLM, shaped links) beside them, each module whole on
one worker, so that a module's fixtures (a vLLM job, say) run once. pytest-xdist hands out the
modules of most tests first: the many short unit modules run beside the real pods at the start,
and vLLM's (a few long tests each) beside the operator's tests on fake nodes at the end. Putting
the heaviest first starved the real pods: beside whole jobs or vLLM's spinning CPU workers a real
trainer went 9-11 s without a heartbeat (the controller's limit is 8 s), and its job failed."""
import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack" / "cluster"))
from controlplane import ControlPlane, find_binaries  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_LANE = "cluster"


def lane_of(nodeid: str) -> str:
    """The unit of work a test goes to a worker in: the cluster's lane for the modules of
    cluster tests, else the test's module."""
    module = nodeid.split("::", 1)[0]
    return CLUSTER_LANE if _uses_cluster(module) else module


_CLUSTER_MODULES: dict[str, bool] = {}


def _uses_cluster(module: str) -> bool:
    if module not in _CLUSTER_MODULES:
        path = ROOT / module
        _CLUSTER_MODULES[module] = path.suffix == ".py" and "pytest.mark.cluster" in path.read_text()
    return _CLUSTER_MODULES[module]


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return Lanes(config, log)


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
