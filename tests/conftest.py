"""The `cluster` fixture: a real local Kubernetes control plane (hack/cluster/controlplane.py)
shared by every test marked `@pytest.mark.cluster`, started once per session and stopped at its end.

`make test` runs the suite in two pytest-xdist workers (`-n 2`), scheduled by module, each module
whole on one worker (so that its fixtures, a vLLM job say, run once): the modules that run pods on
the real node, and those that start vLLM servers, go to one worker as one unit, in their order,
since a machine has room for one real node and vLLM's spinning workers starve pods beside them;
every other module goes to whichever worker is free, the longest kinds first (`weight_of`),
and each worker that runs a module of cluster tests starts its own control plane (seconds) for
them."""
import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack" / "cluster"))
from controlplane import ControlPlane, find_binaries  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REAL_NODE_LANE = "real-node"


def lane_of(nodeid: str) -> str:
    """The unit of work a test goes to a worker in: one for every module that runs pods on the
    real node (its `real_node` fixture) or starts vLLM servers, else the test's module. vLLM's
    CPU workers spin on both cores while they wait for work; beside them a real pod's heartbeat
    thread once went 11 s without the CPU and its job failed, so these never run at once."""
    module = nodeid.split("::", 1)[0]
    text = _source(module)
    return REAL_NODE_LANE if "real_node" in text or "vllm_python" in text else module


def weight_of(lane: str) -> int:
    """Which units go first (the lower, the sooner), so that no long one starts last while the
    other worker has nothing left: the real node's and vLLM's, then the modules of whole jobs,
    engines or a cluster, then the rest."""
    if lane == REAL_NODE_LANE:
        return 0
    text = _source(lane)
    if "pytestmark = pytest.mark.slow" in text or "pytest.mark.cluster" in text:
        return 1
    return 2


_SOURCES: dict[str, str] = {}


def _source(module: str) -> str:
    if module not in _SOURCES:
        path = ROOT / module
        _SOURCES[module] = path.read_text() if path.suffix == ".py" and path.is_file() else ""
    return _SOURCES[module]


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # the unit of least weight (then of most tests) first; the rest keep their order
            first = min(self.workqueue, key=lambda lane: (weight_of(lane), -len(self.workqueue[lane])))
            self.workqueue.move_to_end(first, last=False)
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
    try:
        yield cp
    finally:
        cp.down()
