"""The `cluster` fixture: a real local Kubernetes control plane (hack/cluster/controlplane.py)
shared by the tests marked `@pytest.mark.cluster` of one pytest process, started once and stopped
at its end.

`make test` runs the suite in two pytest-xdist workers, scheduled in lanes: the modules that run
real pods (the ones that use the real node: there can be only one on a machine) go to one worker as
one lane, the other modules of cluster tests (the operator on KWOK's fake nodes, the chart, the
control plane's own tests) to the other as a second lane, each worker with a control plane of its
own; every other module goes whole to whichever worker is free, so that its own fixtures (a vLLM
job, say) run once. The two lanes start first, side by side: the fake nodes' lane asks little of
the CPU, so the real pods' trainers have the cores they need while their job runs. After them
pytest-xdist hands out the modules with the most tests first, so that the many short unit modules
run before the few long vLLM ones. Putting the heaviest beside the real pods starved them: beside
whole jobs or vLLM's spinning CPU workers a real trainer went 9-11 s without a heartbeat."""
import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack" / "cluster"))
from controlplane import ControlPlane, find_binaries  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REAL_PODS_LANE, CLUSTER_LANE = "real pods", "cluster"
_UP: list[ControlPlane] = []  # this process's control plane, once a test started it


def lane_of(nodeid: str) -> str:
    """The unit of work a test goes to a worker in: one of the two cluster lanes for the modules of
    cluster tests, else the test's module."""
    module = nodeid.split("::", 1)[0]
    source = _source(module)
    if "pytest.mark.cluster" not in source:
        return module
    return REAL_PODS_LANE if "real_node" in source else CLUSTER_LANE


_SOURCES: dict[str, str] = {}


def _source(module: str) -> str:
    if module not in _SOURCES:
        path = ROOT / module
        _SOURCES[module] = path.read_text() if path.suffix == ".py" else ""
    return _SOURCES[module]


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            for lane in (CLUSTER_LANE, REAL_PODS_LANE):  # the two lanes first, one to each worker
                if lane in self.workqueue:
                    self.workqueue.move_to_end(lane, last=False)
            super()._assign_work_unit(node)

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
    _UP.append(cp)
    try:
        yield cp
    finally:
        _UP.clear()
        cp.down()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """At the end of each module that deleted namespaces, waits until they are gone (the tests
    themselves only wait for what ran in them: ControlPlane.delete_namespaces), so that the next
    module starts on a clean cluster and the namespace controller's fixed delay is paid once per
    module rather than once per test."""
    result = yield
    if _UP and _UP[0].terminating and nextitem is not None and nextitem.path != item.path:
        _UP[0].wait_namespaces_gone()
    return result
