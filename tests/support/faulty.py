"""A local job with an armed pause point (runtime/faults.py PAUSE_DIR_ENV): the job holds a rank
there while a test kills or stops a process, so that "mid-bucket" really is in the middle of a
version's buckets; `weightsync run` meanwhile restarts dead pods and probes them as a kubelet does."""
from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path

from weightsync.local.runner import LocalJob, RunFailed
from weightsync.runtime.faults import DUMP_DIR_ENV, PAUSE_DIR_ENV

REACH_TIMEOUT = 240.0  # seconds for the job to reach the armed point (start-up on a loaded machine)
RUN_TIMEOUT = 400.0


class Faulty:
    """A local job with an armed pause point."""

    def __init__(self, tmp_path: Path, job, point: str):
        self.dump, self.pause = tmp_path / "dump", tmp_path / "pause"
        self.dump.mkdir()
        self.pause.mkdir()
        (self.pause / f"{point}.arm").touch()
        self.point = point
        self.local = LocalJob(job, tmp_path / "run", {DUMP_DIR_ENV: str(self.dump), PAUSE_DIR_ENV: str(self.pause)},
                              progress=io.StringIO())
        self.outcome: dict = {}
        self.follower = threading.Thread(target=self._follow, daemon=True)

    def pod(self, role: str, rank: int):
        return next(p for p in self.local.pods if p.role == role and rank in p.ranks)

    def strike(self, target, sig: int, *more, point: str | None = None) -> float:
        """Send `sig` to the target pod's processes (and to `more` pods', at once) once a rank
        holds at `point` (by default the one the job was made with, which the first strike starts
        the job for, followed by `weightsync run`'s loop on a thread, which restarts and probes
        pods), then let the paused rank go on; returns when it struck. A later point is armed here
        if it is not yet: a rank looks for armed points as it reaches them."""
        point = point or self.point
        if not self.follower.is_alive() and not self.outcome:
            self.local.start()
            self.follower.start()
        self.arm(point)
        self.reach(point)
        for pod in (target, *more):
            os.killpg(pod.proc.pid, sig)
        struck = time.monotonic()
        self.release(point)
        return struck

    def arm(self, point: str) -> None:
        """Hold the rank that reaches `point` there until `release(point)`."""
        if not (self.pause / f"{point}.reached").exists():
            (self.pause / f"{point}.arm").touch()

    def reach(self, point: str) -> None:
        """Until a rank holds at `point`."""
        deadline = time.monotonic() + REACH_TIMEOUT
        while not (self.pause / f"{point}.reached").exists():
            assert time.monotonic() < deadline, f"the job did not reach {point} within {REACH_TIMEOUT:.0f}s"
            assert self.follower.is_alive(), f"the job ended before {point}: {self.outcome}"
            time.sleep(0.02)

    def release(self, point: str) -> None:
        (self.pause / f"{point}.release").touch()

    def _follow(self) -> None:
        try:
            self.outcome["summary"] = self.local.wait(timeout=RUN_TIMEOUT)
        except RunFailed as e:
            self.outcome["failed"] = e

    def end(self) -> dict:
        """The run's summary; RunFailed if the job failed."""
        self.follower.join(RUN_TIMEOUT + 60)
        assert not self.follower.is_alive(), "the run did not end"
        if "failed" in self.outcome:
            raise self.outcome["failed"]
        return self.outcome["summary"]

    def log(self, pod) -> str:
        return pod.log.read_text(errors="replace")

    def status(self) -> dict:
        return json.loads((self.local.workdir / "status.json").read_text())


def wait_for_line(path: Path, text: str, timeout: float, running: Faulty | None = None, count: int = 1) -> float:
    """When `text` appeared (the `count`-th time) in the log at `path`; fails past `timeout`, or
    once the `running` job ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = running is not None and not running.follower.is_alive()  # before the read: a last line counts
        if path.exists() and path.read_text(errors="replace").count(text) >= count:
            return time.monotonic()
        assert not ended, f"the job ended before {text!r}: {running.outcome}"
        time.sleep(0.05)
    raise AssertionError(f"{text!r} did not appear {count} time(s) in {path.name} within {timeout:.0f}s")
