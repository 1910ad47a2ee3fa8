"""A worker that is its container's first process (PID 1) ends on SIGTERM, as a pod being deleted
sends it: the kernel gives PID 1 no default action for signals it does not handle. A real worker
pod process as PID 1 answers its probes (its health endpoint's thread) and still ends on SIGTERM."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="a new PID namespace (unshare --pid) needs root")

WORKER = """
import sys, time
from weightsync.roles import exit_on_sigterm
if sys.argv[1] == "handled":
    exit_on_sigterm()
print("ready", flush=True)
time.sleep(60)
"""


def pid_one(mode: str) -> tuple[subprocess.Popen, int]:
    """`python -c WORKER mode` as PID 1 of a new PID namespace; returns it and its host pid."""
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", WORKER, mode],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, child_of(proc)


def child_of(proc: subprocess.Popen) -> int:
    (child,) = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    return child


def exited(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_pid_one_ends_on_sigterm():
    proc, child = pid_one("handled")
    os.kill(child, signal.SIGTERM)
    assert proc.wait(20) == 128 + signal.SIGTERM


def test_without_the_handler_pid_one_ignores_sigterm():
    """What the handler is for: the same process without it outlives the signal."""
    proc, child = pid_one("unhandled")
    try:
        os.kill(child, signal.SIGTERM)
        assert not exited(child, 2)
    finally:
        proc.kill()
        proc.wait(10)


def test_a_worker_pod_as_pid_one_answers_its_probes_and_ends_on_sigterm(tmp_path):
    from support.health import DEADLINE, answer, until, worker_env

    from weightsync.job import READINESS, Env

    env = worker_env(tmp_path, ordinal=0)  # the controller's pod: ready once its rendezvous is up
    port = int(env[Env.HEALTH_PORT])
    with open(tmp_path / "out.log", "wb") as out:
        proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "weightsync.cli", "worker"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        until("the pod ready", lambda: answer(port, READINESS)[0] or proc.poll() is not None)
        assert proc.poll() is None, (tmp_path / "out.log").read_text()
        os.kill(child_of(proc), signal.SIGTERM)
        assert proc.wait(DEADLINE) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait(DEADLINE)
