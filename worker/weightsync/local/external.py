"""`weightsync run JOB --join-env FILE`: the job's external roles are processes the user starts
(their torchrun, their vLLM servers), so the run starts every pod but theirs and, as soon as the
controller's store accepts connections, writes FILE with the three variables those processes
join with (job/join.py; KEY=value lines a shell can source, readable by the user alone since they
hold the job's token) and says in one line how to start them. Until the job's ranks are all in,
the controller's lines about who joined and who is still missing are shown with the run's own
progress (in a cluster they are the controller pod's log).
"""

from __future__ import annotations

import os
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from weightsync.job import INFERENCE, TRAINER, Job, external_roles, join_env
from weightsync.vllm_backend.guard import MIDDLEWARE

STORE_WAIT = 300.0  # seconds for the controller's store to accept connections
POLL = 0.2  # seconds between two looks at the store, and at the controller's log
# the controller's lines about external ranks (roles/controller/, rendezvous/roster.py)
ADMISSION_MARKS = ("ranks are external", "(external, at ", "waiting for the ranks to join", "did not join within",
                   "a second process claimed", "claimed inference rank", "refused the vLLM server", "takes over replica")


def write_join_file(path: Path, values: dict[str, str]) -> None:
    """KEY=value lines, shell-quoted, written whole (a reader never sees half a file) and readable
    by this user alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{key}={shlex.quote(value)}\n" for key, value in values.items())
    os.chmod(partial, 0o600)  # whatever the umask left
    os.replace(partial, path)


def join_path_problem(path: Path) -> str | None:
    """Why the join file cannot be written at `path` (a folder, a device, under a file or a
    folder this user cannot write in), None if it can: said before anything starts."""
    if path.is_dir():
        return f"{path} is a folder; name the file to write the join variables to, such as {path / 'join.env'}"
    if path.exists() and not path.is_file():
        return f"{path} is not a regular file (a device, a pipe or a socket); name a file to write"
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # the folders missing in between are made
    if not folder.is_dir():
        return f"{folder} is not a folder, so {path} cannot be written"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"this user cannot write in {folder}, so {path} cannot be written"
    return None


def how_to_join(job: Job, path: Path) -> str:
    """One line: what the user starts, and with what."""
    parts = []
    if TRAINER in external_roles(job):
        world = job.layout.world_size(TRAINER)
        parts.append(f"its {world} trainer rank(s): `set -a; . {path}; set +a; torchrun --standalone --nproc-per-node "
                     f"{world} YOUR_SCRIPT.py` (RANK 0..{world - 1}, WORLD_SIZE={world}; each calls "
                     "weightsync.attach(model))")
    if INFERENCE in external_roles(job):
        servers = job.layout.world_size(INFERENCE)
        parts.append(f"its {servers} vLLM server(s) with the variables of {path}, WEIGHTSYNC_VLLM_SERVER set to each "
                     "server's URL, --weight-transfer-config '{\"backend\": \"weightsync\"}' and --middleware "
                     f"{MIDDLEWARE}")
    return (f"job {job.name} waits for you to start {' and '.join(parts)} within "
            f"{job.trainer.attach_timeout_seconds}s (spec.trainer.attachTimeoutSeconds)")


class JoinOffer:
    """From start() on, a thread that writes the join file once the controller's store accepts
    connections and tells the user, then shows the controller's lines about external ranks."""

    def __init__(self, job: Job, path: Path, store_port: int, token_file: Path, controller_log: Path,
                 say: Callable[[str], None], host: str = "127.0.0.1"):
        self.job, self.path, self.store_port, self.host = job, Path(path), store_port, host
        self.token_file, self.controller_log, self.say = token_file, controller_log, say
        self.written = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="join-offer", daemon=True)

    def start(self) -> None:
        self.path.unlink(missing_ok=True)  # a file from an earlier run holds another job's token
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _run(self) -> None:
        if not self._store_up():
            if not self._stop.is_set():
                self.say(f"the controller's store did not accept connections within {STORE_WAIT:.0f}s: {self.path} "
                         f"was not written (the controller's log: {self.controller_log})")
            return
        token = self.token_file.read_bytes().strip()
        try:
            write_join_file(self.path, join_env(self.job, self.host, self.store_port, token))
        except OSError as e:  # checked before the run (join_path_problem), changed since
            self.say(f"{self.path} could not be written: {e.strerror}; no process of yours can join")
            return
        self.written.set()
        self.say(how_to_join(self.job, self.path))
        self._echo_admission()

    def _store_up(self) -> bool:
        deadline = time.monotonic() + STORE_WAIT
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.store_port), timeout=POLL):
                    return True  # it listens; a joiner then proves the token, and waits for the job's key
            except OSError:
                self._stop.wait(POLL)
        return False

    def _echo_admission(self) -> None:
        """The controller's lines about external ranks, as its log gets them, until the run ends."""
        offset, rest = 0, b""
        while not self._stop.wait(POLL):
            try:
                with open(self.controller_log, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            offset += len(chunk)
            *lines, rest = (rest + chunk).split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace").strip()
                if any(mark in line for mark in ADMISSION_MARKS):
                    self.say(line)
