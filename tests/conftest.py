"""The `cluster` fixture: a real local Kubernetes control plane (hack/cluster/controlplane.py)
shared by every test marked `@pytest.mark.cluster`, started once per session and stopped at its end."""
import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack" / "cluster"))
from controlplane import ControlPlane, find_binaries  # noqa: E402


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
