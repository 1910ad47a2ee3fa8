"""What `weightsync run` writes before any pod starts: its run directory, named by an absolute
path in every pod's environment (a relative --logs works wherever a pod's process runs), private
to the user, and the job's token created with its final permissions, never readable by others for
a moment; the controller's metrics URL said only once it answers. No process is started here."""

from __future__ import annotations

import http.server
import io
import os
import socket
import stat
import sys
import threading
import time

from support import waits
from support.jobs import make_job

from weightsync.job import Env
from weightsync.local.runner import LocalJob, say_once_up


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


def test_the_metrics_url_is_said_once_it_answers_not_before():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there until the server below
    said, stop = [], threading.Event()
    line = "metrics at {url}"
    looking = threading.Thread(target=lambda: said.append((say_once_up(f"http://127.0.0.1:{port}/metrics", stop,
                                                                       lambda m: said.append((m, time.monotonic())),
                                                                       line))), daemon=True)
    looking.start()
    answered = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            answered.append(time.monotonic())
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    assert said == []  # nothing answers at that port yet
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        waits.until("the URL said", lambda: len(said) == 2, 30)
        assert said[0][0] == f"metrics at http://127.0.0.1:{port}/metrics" and said[1] is True
        assert answered and answered[0] <= said[0][1]
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    stop = threading.Event()
    stop.set()  # the run ended before it answered: nothing is said
    assert say_once_up(f"http://127.0.0.1:{port}/metrics", stop, said.append, line) is False and len(said) == 2
