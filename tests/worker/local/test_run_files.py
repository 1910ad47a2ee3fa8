"""What `weightsync run` writes before any pod starts: its run directory, named by an absolute
path in every pod's environment (a relative --logs works wherever a pod's process runs), private
to the user, and the job's token created with its final permissions, never readable by others for
a moment. No process is started here."""

from __future__ import annotations

import io
import os
import stat
import sys

from support.jobs import make_job
from weightsync.job import Env
from weightsync.local.runner import LocalJob


def test_a_relative_run_directory_is_made_absolute_and_private(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir(mode=0o755)
    os.chmod(tmp_path / "logs", 0o755)  # a directory the user made beforehand, readable by all
    local = LocalJob(make_job("files"), "logs", progress=io.StringIO())
    assert local.workdir == tmp_path / "logs"
    for pod in local.pods:
        for name in (Env.SPEC_FILE, Env.TOKEN_FILE):
            assert os.path.isabs(pod.env[name]) and os.path.exists(pod.env[name]), (pod.name, name, pod.env[name])
    token = pod.env[Env.TOKEN_FILE]
    assert stat.S_IMODE(os.stat(token).st_mode) == 0o600
    for folder in (local.workdir, local.workdir / "spec", local.workdir / "token"):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder


def test_the_token_file_is_created_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        local = LocalJob(make_job("umask"), tmp_path / "run", progress=io.StringIO())
    finally:
        os.umask(old)
    token = local.pods[0].env[Env.TOKEN_FILE]
    assert stat.S_IMODE(os.stat(token).st_mode) == 0o600


def test_the_pods_find_this_environments_executables_first(tmp_path, monkeypatch):
    """A command such as [torchrun, ...] runs this environment's torchrun, whether or not the
    user's shell activated it (in a cluster, the image's is on its PATH)."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    local = LocalJob(make_job("path"), tmp_path / "run", progress=io.StringIO())
    for pod in local.pods:
        assert pod.env["PATH"].split(os.pathsep)[:3] == [os.path.dirname(sys.executable), "/usr/bin", "/bin"]
