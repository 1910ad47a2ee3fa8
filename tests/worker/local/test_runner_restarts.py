"""`weightsync run` keeps its pods up as a kubelet does (weightsync/kubelet.py), in real jobs on
loopback: a pod whose process dies is started again after a back-off that doubles; each restart is
said in the progress, the pod's log and the summary; in a cluster every process stays up after the
job's end until SIGTERM, and nothing is restarted then. A pod that stops answering its liveness
probe (SIGSTOP) is killed and started again: the frozen controller of test_faults.py, whose job
checks that and the job's outcome at once.

What becomes of the job then (a restarted inference rank rejoins, a restarted trainer or
controller fails the job saying so) is the rendezvous' business: test_faults.py."""
from __future__ import annotations

import io
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from support import waits
from support.jobs import assert_nothing_left, make_job, store_of

from weightsync.job import LIVENESS, Env
from weightsync.local import kubelet
from weightsync.local.runner import LocalJob, RunFailed

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`

DEADLINE = 300  # seconds for a whole job on a loaded machine
SLACK = 30.0  # seconds a loaded machine may add to a restart's due time


class Progress(io.StringIO):
    """The run's progress, written by the thread that follows the job and read by the test."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            return super().write(text)

    def text(self) -> str:
        with self.lock:
            return self.getvalue()


def until(what: str, check, timeout: float = DEADLINE, every: float = 0.001):
    return waits.until(what, check, timeout, every)


def run_in_background(local: LocalJob) -> tuple[threading.Thread, dict]:
    """local.wait() in a thread: the result is {"summary": ...} or {"failed": message}."""
    result: dict = {}

    def follow():
        try:
            result["summary"] = local.wait(timeout=DEADLINE)
        except RunFailed as e:
            result["failed"] = str(e)

    thread = threading.Thread(target=follow, name="follow", daemon=True)
    thread.start()
    return thread, result


def new_process(pod: kubelet.Pod, old):
    return pod.proc if pod.proc is not old else None


def rank_processes(pid: int) -> list[int]:
    """The pod process's children that run ranks (not multiprocessing's resource tracker)."""
    found = []
    try:
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
    except OSError:
        pass
    return found


def test_a_pod_that_dies_is_restarted_after_a_back_off_that_doubles(tmp_path):
    # A trainer pod of two rank processes, killed three times in a row before its ranks could join
    # the job: its own process at once after its start (as the OOM killer would: SIGKILL, nothing
    # in its log yet), then one of its ranks (the pod then fails), then its own process again.
    job = make_job("backoff", trainers=(1, 2), steps=2, every=2)
    progress = Progress()
    local = LocalJob(job, tmp_path / "run", progress=progress)
    victim = local.pods[1]
    local.start()
    thread, result = run_in_background(local)
    waited = []  # from each kill to the restart it caused
    try:
        proc = victim.proc
        for n in range(3):
            if n == 1:
                (rank,) = until("a rank process", lambda: rank_processes(proc.pid)[:1])
                os.kill(rank, signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            proc = until("a restart", lambda: new_process(victim, proc))
            waited.append(time.monotonic() - killed)
        thread.join(DEADLINE)
        assert not thread.is_alive(), "the job did not end"
    finally:
        local.stop()
    assert_nothing_left(local)

    # Each restart waited out its back-off (1 s, 2 s, 4 s), and not much more (the second also
    # waited for the pod to stop its other rank).
    for n, seconds in enumerate(waited):
        due = kubelet.BACKOFF_BASE * 2 ** n
        assert due <= seconds < due + SLACK, (n, seconds)
    said = progress.text()
    pod = victim.describe()
    assert f"weightsync: {pod} was probably out of memory (killed by SIGKILL); restarting it in 1s (restart 1)\n" \
           f"its log {victim.log} is empty" in said
    assert f"weightsync: {pod} exited with code 1; restarting it in 2s (restart 2)" in said
    assert f"weightsync: {pod} was probably out of memory (killed by SIGKILL); restarting it in 4s (restart 3)" in said
    log = victim.log.read_text()
    # the rank killed is the pod's first child listed in /proc, which may be either rank's process
    assert any(f"trainer-rank-{r} was probably out of memory (killed by SIGKILL); stopping the pod's other ranks" in log
               for r in (0, 1)), log
    assert [line for line in log.splitlines() if line.startswith("weightsync run: ")] == [
        "weightsync run: restart 1 of backoff-trainer-1: it was probably out of memory (killed by SIGKILL)",
        "weightsync run: restart 2 of backoff-trainer-1: it exited with code 1",
        "weightsync run: restart 3 of backoff-trainer-1: it was probably out of memory (killed by SIGKILL)"]
    # The pod died before its ranks joined: the job went on as if nothing happened.
    assert "failed" not in result, result["failed"]
    assert result["summary"]["versions"] == 2 and result["summary"]["restarts"] == {victim.name: 3}
    assert f"weightsync: restarted pods: {victim.name} 3 times (last: it was probably out of memory" in said


def test_a_pod_that_keeps_dying_ends_the_run_naming_it(tmp_path, monkeypatch):
    # The controller's health port is taken: its pod dies at once, every time it starts (each start
    # a process that imports what the controller runs). The back-off's cap at 2 s here (16 s as
    # shipped) and its limit at 3 restarts in a row (6): the doubling reaches the cap and stays
    # there, and the limit ends the run (the doubling itself, 1 s, 2 s, 4 s:
    # test_a_pod_that_dies_is_restarted_after_a_back_off_that_doubles).
    assert kubelet.BACKOFF_MAX == 16 and kubelet.CRASH_LOOP_LIMIT == 6
    monkeypatch.setattr(kubelet, "BACKOFF_MAX", 2.0)
    monkeypatch.setattr(kubelet, "CRASH_LOOP_LIMIT", 3)
    job = make_job("crash-loop")
    progress = Progress()
    local = LocalJob(job, tmp_path / "run", progress=progress)
    controller = local.pods[0]
    taken = socket.socket()
    taken.bind(("127.0.0.1", int(controller.env[Env.HEALTH_PORT])))
    taken.listen()
    local.start()
    try:
        with pytest.raises(RunFailed) as failure:
            local.wait(timeout=DEADLINE)
    finally:
        local.stop()
        taken.close()
    assert_nothing_left(local)
    message = str(failure.value)
    assert message.startswith(f"{controller.describe()} exited with code 1, after {kubelet.CRASH_LOOP_LIMIT} restarts "
                              "in a row; it is not started again"), message
    assert f"the health and metrics endpoint cannot listen on 127.0.0.1:{controller.env[Env.HEALTH_PORT]}" in message
    assert message.endswith(f"restarted pods: {controller.name} {kubelet.CRASH_LOOP_LIMIT} times (last: it exited with code 1)")
    # The back-off doubled up to its cap.
    said = [line for line in progress.text().splitlines() if "restarting it in" in line]
    assert [line.split("restarting it in ")[1] for line in said] == [
        "1s (restart 1)", "2s (restart 2)", "2s (restart 3)"]


def test_in_a_cluster_every_process_stays_up_after_the_end_until_sigterm_and_none_is_restarted(tmp_path):
    # In a pod an exiting process is restarted, so after the job's end every rank and the controller
    # wait for the operator to remove its pod (SIGTERM), and end cleanly then; a pod that dies or
    # freezes meanwhile is neither restarted nor killed. Two inference pods: one is killed, the
    # other ends on SIGTERM.
    job = make_job("after-the-end", steps=2, every=2, inferences=(2, 1))
    local = LocalJob(job, tmp_path / "run", {"KUBERNETES_SERVICE_HOST": "127.0.0.1"}, progress=io.StringIO())
    local.start()
    try:
        assert local.follow(timeout=DEADLINE)["state"] == "Succeeded"
        store = store_of(local)
        # the completion comes once every rank has seen the end: after it the operator removes the
        # pods, the controller's store with them
        assert store.check(["bye/trainer/0", "bye/inference/0", "bye/inference/1"])
        still = time.monotonic() + 1.0
        while time.monotonic() < still:
            assert [p.proc.poll() for p in local.pods] == [None] * len(local.pods)
            time.sleep(0.05)
        controller = local.pods[0]
        # what it ran it ran without torch (roles/__init__.py): a controller's start is not a torch import
        assert "libtorch" not in Path(f"/proc/{controller.proc.pid}/maps").read_text()
        trainer, inference, killed = (next(p for p in local.pods if p.role == role and rank in p.ranks)
                                      for role, rank in (("trainer", 0), ("inference", 0), ("inference", 1)))
        frozen, dead = controller.proc, killed.proc
        os.kill(frozen.pid, signal.SIGSTOP)
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(DEADLINE)
        # The run ended (the runner is told so by follow()): its probes stopped, so none can kill the
        # frozen one, and a tick restarts nothing (no wait for a probe's timers to prove it).
        for thread in (t for t in local.kubelet.threads if t.name.startswith("probe-")):
            thread.join(LIVENESS.deadline + LIVENESS.period_seconds)
            assert not thread.is_alive(), f"the kubelet's {thread.name} goes on after the end"
        local.kubelet.tick()
        assert (controller.proc, killed.proc) == (frozen, dead)
        assert frozen.poll() is None and Path(f"/proc/{frozen.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
        assert local.kubelet.restarts() == {} and all(pod.exits == [] for pod in local.pods)
        os.kill(frozen.pid, signal.SIGCONT)
        ending = [frozen, trainer.proc, inference.proc]
        for proc in ending:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(30) for proc in ending] == [0, 0, 0]  # cleanly: each was lingering
    finally:
        local.stop()
    assert_nothing_left(local)
