"""What a kubelet does for its pods, done for the local runner's pod processes, on threads of
its own from start() on: start each pod's process; start it again whenever it exits
(restartPolicy Always), after an exponential back-off; and probe its /healthz as the kubelet's
startup and liveness probes do (job.STARTUP until it first answers, then job.LIVENESS: the
numbers the operator renders), killing a pod that fails them (SIGKILL to its whole process
group, as the kubelet kills a container's processes) so that it is started again. A restarted pod
is the same command with the same environment, and its output goes on in the same log, after a
line that says which restart it is and why.

Nothing is restarted, and nothing probed, once the job has ended (end(), called as soon as the
controller's completion record is read). A pod that keeps dying is not started forever: after
CRASH_LOOP_LIMIT restarts in a row the kubelet gives up (`failure`; in a cluster the pod would
stay in CrashLoopBackOff, which the job's Ready condition shows; locally nobody would be watching).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable

from weightsync.job import CONTROLLER, LIVENESS, STARTUP, Env
from weightsync.runtime import procs
from weightsync.runtime.health import probe

# The kubelet's back-off has this shape: doubling from a base, capped, and back to the base once a
# container ran long enough. Its numbers (10 s, 300 s, 10 minutes) are for pods that run for days;
# a local job runs for minutes, so each is smaller here.
BACKOFF_BASE = 1.0  # seconds before the first restart, doubled for each further one in a row
BACKOFF_MAX = 16.0  # seconds: the longest wait before a restart
BACKOFF_RESET = 60.0  # seconds a pod must run for its next restart to wait BACKOFF_BASE again
# Restarts in a row (each after less than BACKOFF_RESET of running) before the run gives up on a
# pod: 1 + 2 + 4 + 8 + 16 + 16 seconds of back-off, a minute of crashing.
CRASH_LOOP_LIMIT = 6
LOG_TAIL = 15  # lines of a pod's log shown when it dies
TICK = 0.05  # seconds between two looks at the pods' processes


class CrashLoop(RuntimeError):
    """A pod died CRASH_LOOP_LIMIT times in a row after short runs (the message names it)."""


@dataclasses.dataclass
class Pod:
    ordinal: int
    role: str
    name: str
    env: dict
    log: Path
    ranks: range
    read_stdout: Callable[[IO[bytes]], None] | None = None  # reads the process's stdout (else: the log)
    cwd: Path | None = None  # where it runs, if not in the run's directory
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exits: list[str] = dataclasses.field(default_factory=list)  # how each of its processes ended
    started_at: float = 0.0
    in_a_row: int = 0  # restarts since it last ran BACKOFF_RESET seconds
    restart_at: float | None = None  # it is down, to be started again at this time.monotonic()
    killed_for: str | None = None  # why the prober killed the current process
    reaped: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def describe(self) -> str:
        if self.role == CONTROLLER:
            return f"controller pod {self.name} (ordinal 0)"
        ranks = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {self.ranks[0]}-{self.ranks[-1]}"
        return f"{self.role} pod {self.name} (ordinal {self.ordinal}, {self.role} {ranks})"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.restart_at is None and self.proc.poll() is None


class Kubelet:
    def __init__(self, pods: list[Pod], cwd: Path, say: Callable[[str], None]):
        self.pods, self.cwd, self.say = pods, cwd, say
        self.ended = threading.Event()  # the job ended: no restarts, no probes
        self.stopped = threading.Event()  # every process is being stopped
        self.failure: CrashLoop | None = None  # why it gave up on a pod
        self.lock = threading.Lock()  # one look at the pods at a time: tick(), end(), stop()
        self.threads: list[threading.Thread] = []
        # the liveness probe each pod gets once it started: the operator's (job.LIVENESS); a run that
        # stops a pod on purpose for longer than that deadline (a fault drill) may set a longer one
        self.liveness = LIVENESS

    def start(self) -> None:
        for pod in self.pods:
            self._start(pod)
        for pod in self.pods:
            self._thread(self._probe, pod, name=f"probe-{pod.name}")
        self._thread(self._supervise, name="kubelet")

    def _supervise(self) -> None:
        # This thread starts the restarted processes and lives until stop() has killed them all:
        # a process's "parent" for procs.die_with_parent (PR_SET_PDEATHSIG) is the thread that
        # started it, and the process gets SIGKILL when that thread ends.
        while not self.stopped.wait(TICK):
            if self.failure is None:
                try:
                    self.tick()
                except CrashLoop as e:
                    self.failure = e

    def _start(self, pod: Pod, why: str | None = None) -> None:
        if not why:
            pod.log.write_bytes(b"")
        # appending (O_APPEND): the process keeps its own copy, and the run adds the controller's
        # records, whole lines each, between its lines (runner.py)
        with open(pod.log, "ab") as log:
            if why:
                log.write(f"{_line_break(pod.log)}weightsync run: restart {pod.restarts} of {pod.name}: {why}\n".encode())
            proc = subprocess.Popen(
                [sys.executable, "-m", "weightsync.cli", "worker"], env=pod.env, cwd=pod.cwd or self.cwd,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if pod.read_stdout else log, stderr=log,
                # nothing outlives the run, even if this process is killed. A process group of its
                # own (stopped whole), in the run's session: the kernel shares the CPU between
                # sessions (autogroup), and a vLLM server's engine core, which spins on sched_yield
                # while its worker generates, yields only within its session: in a session of its
                # own it left the other pods (and the run) waiting for seconds on 2 cores
                process_group=0, preexec_fn=functools.partial(procs.die_with_parent, os.getpid()))
        with pod.lock:
            pod.proc, pod.started_at, pod.restart_at, pod.killed_for = proc, time.monotonic(), None, None
        if pod.read_stdout:
            self._thread(_read, pod.read_stdout, proc.stdout, name=f"stdout-{pod.name}")

    def _thread(self, target, *args, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)

    def tick(self) -> None:
        """Notice the pods that died (and schedule their restart), and restart those whose back-off
        is over. Raises CrashLoop."""
        with self.lock:
            if self.ended.is_set():
                return
            now = time.monotonic()
            for pod in self.pods:
                if pod.proc is not None and pod.restart_at is None and pod.proc.poll() is not None:
                    self._died(pod, now)
                elif pod.restart_at is not None and now >= pod.restart_at:
                    pod.restarts += 1
                    self._start(pod, f"it {pod.exits[-1]}")

    def _died(self, pod: Pod, now: float) -> None:
        with pod.lock:
            how = pod.killed_for or procs.exit_status(pod.proc.returncode)
        procs.signal_group(pod.proc.pid, signal.SIGKILL)  # what is left of the pod: its rank processes
        pod.exits.append(how)
        if now - pod.started_at >= BACKOFF_RESET:
            pod.in_a_row = 0
        if pod.in_a_row >= CRASH_LOOP_LIMIT:
            raise CrashLoop(f"{pod.describe()} {how}, after {pod.in_a_row} restarts in a row; it is not started again\n"
                            f"{tail(pod.log)}")
        delay = min(BACKOFF_BASE * 2 ** pod.in_a_row, BACKOFF_MAX)
        pod.in_a_row += 1
        pod.restart_at = now + delay
        self.say(f"{pod.describe()} {how}; restarting it in {delay:g}s (restart {pod.restarts + 1})\n{tail(pod.log)}")

    def _probe(self, pod: Pod) -> None:
        """The pod's probes, from the pod's start until the job ends: each process's startup probe
        until it first answers, then its liveness probe, each one every period of its own."""
        failures, seen, spec = 0, None, STARTUP
        host, port = pod.env[Env.POD_IP], int(pod.env[Env.HEALTH_PORT])
        next_probe = time.monotonic() + spec.period_seconds
        while not self.ended.wait(max(0.0, next_probe - time.monotonic())):
            with pod.lock:
                proc = pod.proc if pod.running else None
            if proc is not seen:  # a new process (or none): it starts again with its startup probe
                failures, seen, spec = 0, proc, STARTUP
            if proc is None:
                next_probe += spec.period_seconds
                continue
            ok, detail = probe(host, port, spec)
            failures = 0 if ok else failures + 1
            if ok and spec is STARTUP:
                spec = self.liveness  # started: liveness from now on, its first probe a period later
            next_probe += spec.period_seconds
            if failures < spec.failure_threshold:
                continue
            with pod.lock:
                if pod.proc is proc and proc.poll() is None and not self.ended.is_set():
                    which = "startup" if spec is STARTUP else "liveness"
                    pod.killed_for = f"failed its {which} probe {failures} times in a row ({detail}), and was killed"
                    procs.signal_group(proc.pid, signal.SIGKILL)
            failures = 0

    def end(self) -> None:
        """The job has ended: no more restarts or probes. A pod that died since the last tick is
        said to have died; it stays down, as do those waiting for their restart."""
        with self.lock:
            if self.ended.is_set():
                return
            self.ended.set()
            for pod in self.pods:
                if pod.restart_at is not None:
                    self.say(f"{pod.describe()}: the job has ended, so it is not restarted")
                elif pod.proc is not None and pod.proc.poll() is not None and pod.proc.returncode:
                    with pod.lock:
                        how = pod.killed_for or procs.exit_status(pod.proc.returncode)
                    pod.exits.append(how)
                    self.say(f"{pod.describe()} {how} as the job ended, so it is not restarted\n{tail(pod.log)}")
                else:
                    continue
                pod.restart_at = float("inf")

    def restarts(self) -> dict[str, int]:
        """{pod name: restarts} of the pods that restarted."""
        return {p.name: p.restarts for p in self.pods if p.restarts}

    def describe_restarts(self) -> str:
        return ", ".join(f"{p.name} {p.restarts} time{'s' if p.restarts > 1 else ''} (last: it {p.exits[p.restarts - 1]})"
                         for p in self.pods if p.restarts)

    def stop(self) -> None:
        """Stop every process started here (whole process groups), then reap them."""
        with self.lock:  # after the tick under way, none
            self.ended.set()
        started = [p for p in self.pods if p.proc is not None and not p.reaped]
        procs.stop(*(pod.proc for pod in started), grace=procs.STOP_GRACE, group=True)
        for pod in started:
            pod.reaped = True
        self.stopped.set()
        for thread in self.threads:
            # probes and the supervisor see the end; stdout readers reach the end of their pipe
            thread.join(procs.STOP_GRACE)


def _read(read_stdout: Callable[[IO[bytes]], None], stream: IO[bytes]) -> None:
    with stream:
        read_stdout(stream)


def _line_break(log: Path) -> str:
    """A newline, if the log does not end with one (a process killed mid-line)."""
    with open(log, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return ""
        f.seek(-1, os.SEEK_END)
        return "" if f.read(1) == b"\n" else "\n"


def tail(path: Path) -> str:
    """The last LOG_TAIL lines of a pod's log, to show why it died."""
    try:
        lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL:]
    except OSError:
        return ""
    if not lines:
        return f"its log {path} is empty"
    return f"last lines of {path}:\n" + "\n".join(f"  {line}" for line in lines)
