"""The project's two images, built as a user builds them (`docker build` of Dockerfile.operator
and Dockerfile.worker, unchanged), on a machine that reaches Debian's archive and PyPI but no
image registry.

What a registry would give, this module makes from Debian's archive: debootstrap makes a Debian
root filesystem with Python, and `docker import` turns it into the image that stands in for
`python:3.12-slim` (the operator's base; Debian trixie's Python is 3.13). On top of it,
pytorch-base.Dockerfile adds a compiler and PyPI's torch in place of the CUDA PyTorch image that
Dockerfile.worker takes as BASE_IMAGE. Containers reach PyPI through this machine's TLS proxy only
with its CA certificates, so they go into the base too. The pod sandbox's `pause` and CoreDNS
become images of one static binary each.

A private dockerd builds them (no iptables, no bridge: builds use the host's network) with its data
in the cache, so that a second run rebuilds only what changed; the images are then loaded into the
real node's containerd, where pods find them without pulling.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SUITE = "trixie"
MIRROR = "http://deb.debian.org/debian"
# The base names the project's Dockerfiles start from, and the local images standing in for them.
PYTHON_BASE = "python:3.12-slim"
PYTORCH_BASE = "weightsync.local/pytorch:2.15.0-pypi"  # pytorch-base.Dockerfile: the lock's torch
LOCK = "requirements/dev.lock"  # in the build context (ROOT)
PAUSE_IMAGE = "weightsync.local/pause:1"
COREDNS_IMAGE = "weightsync.local/coredns:1"
EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")
# The real node's cache, kept between runs: the builder's data and the node's image store.
NODE_CACHE = Path(os.environ.get("WEIGHTSYNC_CACHE", Path.home() / ".cache/weightsync")) / "node"
TOOLS = ("docker", "dockerd", "debootstrap", "gcc")


def project_version() -> str:
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise RuntimeError("pyproject.toml has no version")


@dataclass(frozen=True)
class Images:
    """The tags of every image the real node runs, as `make images` names the project's two."""

    operator: str
    worker: str
    pause: str = PAUSE_IMAGE
    coredns: str = COREDNS_IMAGE

    @classmethod
    def default(cls, registry: str = "ghcr.io/weightsync") -> "Images":
        version = project_version()
        return cls(f"{registry}/operator:{version}", f"{registry}/worker:{version}")

    def all(self) -> tuple[str, ...]:
        return (self.operator, self.worker, self.pause, self.coredns)


def unavailable() -> str | None:
    """Why this machine cannot build the images, or None."""
    if os.geteuid() != 0:
        return "building images here needs root (dockerd, debootstrap)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    return f"missing tools: {' '.join(missing)} (hack/node/install-packages.sh installs them)" if missing else None


class Docker:
    """A dockerd of the tests' own: its data in `home` (kept between runs), nothing on the host's
    network configuration. One at a time per machine (a lock in `home`)."""

    def __init__(self, home: Path, log=None):
        self.home = home
        self.socket = home / "docker.sock"
        self.log = log or sys.stderr
        self._proc: subprocess.Popen | None = None
        self._lock = None

    def __enter__(self) -> "Docker":
        self.home.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.home / ".lock", "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        with open(self.home / "dockerd.log", "ab") as log:
            self._proc = subprocess.Popen(
                ["dockerd", f"--data-root={self.home / 'data'}", f"--exec-root={self.home / 'exec'}",
                 f"--pidfile={self.home / 'dockerd.pid'}", f"--host=unix://{self.socket}",
                 "--iptables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while self("version", check=False, capture=True).returncode != 0:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"dockerd did not start; see {self.home / 'dockerd.log'}")
            time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        if self._lock is not None:
            self._lock.close()

    def __call__(self, *args: str, check: bool = True, capture: bool = False, **kw) -> subprocess.CompletedProcess:
        """Runs the docker CLI against this daemon. Unless `capture`, its output goes to the log
        only when it fails (a build's steps are long and say nothing while they succeed)."""
        out = subprocess.run(["docker", *args], env=self.env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE if capture else subprocess.STDOUT, **kw)
        if check and out.returncode != 0:
            if not capture:
                print(out.stdout[-20000:], file=self.log)
            raise RuntimeError(f"docker {' '.join(args[:3])} ... failed ({out.returncode})"
                               + (f": {out.stderr.strip()}" if capture else ""))
        return out

    @property
    def env(self) -> dict[str, str]:
        """The docker CLI's environment for this daemon (its legacy builder: no buildx here)."""
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "0"}

    def has(self, tag: str) -> bool:
        return self("image", "inspect", tag, check=False, capture=True).returncode == 0

    def image_id(self, tag: str) -> str:
        return self("image", "inspect", "--format", "{{.Id}}", tag, capture=True).stdout.strip()

    def import_tree(self, tree: Path, tag: str, *changes: str) -> None:
        """`docker import` of a directory tree as an image's only layer."""
        tar = subprocess.Popen(["tar", "-C", str(tree), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        self("import", *[a for c in changes for a in ("--change", c)], "-", tag, stdin=tar.stdout)
        if tar.wait() != 0:
            raise RuntimeError(f"tar of {tree} failed")


def python_base(docker: Docker, work: Path, log) -> None:
    """Debian with Python, pip and this machine's CA certificates, tagged as PYTHON_BASE."""
    rootfs = work / "rootfs"
    print(f"images: debootstrap {SUITE} for {PYTHON_BASE} (once)", file=log, flush=True)
    subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-pip,python-is-python3,ca-certificates",
                    SUITE, str(rootfs), MIRROR], check=True, stdout=log, stderr=log)
    for cert in sorted(EXTRA_CA_DIR.glob("*.crt")):
        shutil.copy(cert, rootfs / "usr/local/share/ca-certificates" / cert.name)
    subprocess.run(["chroot", str(rootfs), "update-ca-certificates"], check=True, stdout=log, stderr=log)
    # As in the official python images: pip installs into the system Python, and trusts the system
    # CA bundle (which now holds the proxy's certificates).
    for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    (rootfs / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
    docker.import_tree(rootfs, PYTHON_BASE, "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                       "ENV LANG=C.UTF-8", 'CMD ["python3"]')


def binary_image(docker: Docker, work: Path, tag: str, binary: Path, name: str, *changes: str) -> None:
    tree = work / name
    tree.mkdir()
    shutil.copy(binary, tree / name)
    docker.import_tree(tree, tag, f'ENTRYPOINT ["/{name}"]', *changes)


def build(docker: Docker, images: Images, coredns: Callable[[], Path], log=None) -> dict[str, str]:
    """Builds whatever is missing or out of date; returns tag -> image ID for every image. CoreDNS's
    binary is asked for last, when its image is missing: it may still be building beside this."""
    log = log or sys.stderr
    with tempfile.TemporaryDirectory(prefix="weightsync-images-") as tmp:
        work = Path(tmp)
        if not docker.has(PYTHON_BASE):
            python_base(docker, work, log)
        if not docker.has(PYTORCH_BASE):
            print(f"images: {PYTORCH_BASE} (once; PyPI's torch is several GB)", file=log, flush=True)
        docker("build", "--network=host", "-t", PYTORCH_BASE, "-f", str(HERE / "pytorch-base.Dockerfile"), str(HERE))
        if not docker.has(PAUSE_IMAGE):
            subprocess.run(["gcc", "-O2", "-static", "-o", str(work / "pause.bin"), str(HERE / "pause.c")], check=True)
            binary_image(docker, work, PAUSE_IMAGE, work / "pause.bin", "pause")
        # The project's images, from its Dockerfiles as they are; the layer cache makes an unchanged
        # source tree a no-op.
        print("images: the operator and worker images (docker build)", file=log, flush=True)
        # Both install the versions the suite passed with (the dev environment's lock).
        locked = ("--build-arg", f"CONSTRAINTS={LOCK}")
        docker("build", "--network=host", "-f", str(ROOT / "Dockerfile.operator"), *locked, "-t", images.operator,
               str(ROOT))
        docker("build", "--network=host", "-f", str(ROOT / "Dockerfile.worker"), *locked, "--build-arg",
               f"BASE_IMAGE={PYTORCH_BASE}", "-t", images.worker, str(ROOT))
        if not docker.has(COREDNS_IMAGE):
            binary_image(docker, work, COREDNS_IMAGE, coredns(), "coredns", "USER 65532:65532")
    prune(docker, log)
    return {tag: docker.image_id(tag) for tag in images.all()}


def prune(docker: Docker, log) -> None:
    """Removes the images a rebuild left without a tag: each change of the source tree makes a new
    worker image of several hundred MB, and the cache is kept between runs, so on a machine that
    runs the tests again and again they would fill its disk. The layers the tagged images are built
    from stay, and with them the build cache."""
    out = docker("image", "prune", "--force", capture=True).stdout.strip().splitlines()
    if out and out[-1].startswith("Total reclaimed space") and not out[-1].endswith(" 0B"):
        print(f"images: removed the untagged images of earlier builds ({out[-1].split(': ', 1)[1]})", file=log, flush=True)


def load(docker: Docker, ids: dict[str, str], containerd, stamp: Path, log=None) -> None:
    """Copies into containerd's Kubernetes namespace each image it does not hold at that ID."""
    log = log or sys.stderr
    loaded = json.loads(stamp.read_text()) if stamp.exists() else {}
    wanted = {containerd.normalize(tag) for tag in ids}
    present = set(remove_stale(containerd, wanted, log))
    missing = {tag: image_id for tag, image_id in ids.items()
               if not (loaded.get(containerd.normalize(tag)) == image_id and containerd.normalize(tag) in present)}
    for tag, image_id in missing.items():
        full = containerd.normalize(tag)
        print(f"images: loading {tag} into the node's containerd", file=log, flush=True)
        # `ctr images import` points the name at the new image before it unpacks the layers, which
        # leaves the old image's snapshots unreferenced: containerd's garbage collector may remove
        # a layer the unpacker has just found present and is about to build on ("parent snapshot
        # does not exist"). A second name holds the old image until the new one is unpacked.
        held = f"{full}-replaced"
        if full in present:
            containerd.ctr("images", "tag", "--force", full, held)
        try:
            save = subprocess.Popen(["docker", "save", tag], stdout=subprocess.PIPE, env=docker.env)
            try:
                containerd.ctr("images", "import", "--snapshotter=overlayfs", "-", stdin=save.stdout)
            except Exception as e:
                save.kill()
                if "no space left on device" in str(e):
                    raise out_of_space(containerd.root, e) from None
                raise
            if save.wait() != 0:
                raise RuntimeError(f"docker save {tag} failed")
        finally:
            if full in present:
                containerd.ctr("images", "rm", held)
        loaded[full] = image_id
        stamp.write_text(json.dumps(loaded, indent=1))
    if missing:
        remove_stale(containerd, wanted, log)  # what the images replaced


def remove_stale(containerd, wanted: set[str], log) -> dict[str, str]:
    """Removes from containerd's Kubernetes namespace every image but `wanted` (names in full)
    and the references its CRI plugin keeps to them by ID; returns {wanted name present: its
    digest}. An image whose name a load moved to a new one stays referenced by its ID and would
    keep its layers, several hundred MB a load, on a disk kept between runs."""
    refs = {}
    for line in containerd.ctr("images", "ls").splitlines()[1:]:
        ref, _, digest, *_ = line.split()
        refs[ref] = digest
    kept = {refs[name] for name in wanted if name in refs}
    for ref, digest in sorted(refs.items()):
        if ref not in wanted and digest not in kept:
            print(f"images: removing {ref} from the node's containerd (not one of the images it runs)", file=log,
                  flush=True)
            containerd.ctr("images", "rm", ref)
    return {name: refs[name] for name in wanted if name in refs}


def out_of_space(root: Path, error: Exception) -> OSError:
    """What to tell where a load ran out of disk midway (its own message names one layer)."""
    gib = 1 << 30
    free = shutil.disk_usage(root if root.exists() else root.parent).free
    return OSError(f"the disk of the real node's image store ({root}) is full ({free / gib:.1f} GiB free): free disk "
                   f"space there (old test folders in {Path(tempfile.gettempdir()) / 'pytest-of-*'}, other "
                   f"containers' images) and run the tests again; containerd said: {error}")
