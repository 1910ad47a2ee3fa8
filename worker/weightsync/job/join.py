"""What a process the user started needs to join a job as one of its external ranks
(spec.trainer.external, spec.inference.external): three environment variables, the same in a
cluster (the operator's Secret "<job>-join", for envFrom) and on one machine (`weightsync run
--join-env FILE` writes them to FILE). The joiner gets no spec file and no token file: it reads the
job from the controller's store once it has proven the token there (rendezvous/external_rank.py), so the
three variables are all it has to carry and they cannot disagree with the job.

Here: their names (JoinEnv), their values for a job (join_env) and their parsing (Join), each
refusing a missing or malformed value with one line naming the variable. No torch, no sockets
but the one that finds the local address of the route to the controller.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping

from weightsync.job.spec import Job, SpecError
from weightsync.job.token import MIN_BYTES, read_token
from weightsync.job.topology import INFERENCE, TRAINER


class JoinEnv:
    """Names of the variables a joining process reads."""

    CONTROLLER = "WEIGHTSYNC_CONTROLLER"  # host:port of the controller's rendezvous store
    JOB_ID = "WEIGHTSYNC_JOB_ID"  # namespace/name (Job.identity)
    TOKEN = "WEIGHTSYNC_TOKEN"  # the job's token as text (what the pods' token file holds)
    # Or the path of a file that holds it (a pod's token file; for a run without a job file, one
    # every process of the run reads): the secret kept out of the environment's dumps.
    TOKEN_FILE = "WEIGHTSYNC_TOKEN_FILE"
    # Optional: the address other ranks dial this process at (default: the local address of the
    # route to the controller), and an external vLLM server's own URL as the controller reaches it;
    # a pod of the job gets them too (pod.Env names them from here).
    POD_IP = "WEIGHTSYNC_POD_IP"
    VLLM_SERVER = "WEIGHTSYNC_VLLM_SERVER"
    REQUIRED = (CONTROLLER, JOB_ID, TOKEN)


def join_env(job: Job, controller_host: str, store_port: int, token: bytes) -> dict[str, str]:
    """The three variables for `job`, whose controller's store listens at controller_host:store_port."""
    host = f"[{controller_host}]" if ":" in controller_host else controller_host
    return {JoinEnv.CONTROLLER: f"{host}:{store_port}", JoinEnv.JOB_ID: job.identity,
            JoinEnv.TOKEN: token.decode()}


def shared_token(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The secret that a trainer running its job's controller itself (no job file, no join
    variables: vLLM's trainer-side engine) shares with the vLLM servers it drives: WEIGHTSYNC_TOKEN,
    or the file WEIGHTSYNC_TOKEN_FILE names; None where neither is set. SpecError, one line, where
    it is too short or the file cannot be read. The value is never printed."""
    text = environ.get(JoinEnv.TOKEN, "").strip()
    if text:
        if len(text) < MIN_BYTES:
            raise SpecError([f"{JoinEnv.TOKEN} is shorter than {MIN_BYTES} bytes: give the trainer and every vLLM server "
                             "the same long random secret (for example `openssl rand -hex 32`)"])
        return text.encode()
    path = environ.get(JoinEnv.TOKEN_FILE, "").strip()
    if not path:
        return None
    try:
        return read_token(path)
    except OSError as e:
        raise SpecError([f"{JoinEnv.TOKEN_FILE}={path}: {e.strerror or e}; it must name a file this process can read "
                         "that holds the run's secret"]) from None


def external_roles(job: Job) -> tuple[str, ...]:
    """The roles whose ranks the user starts (trainer, inference), in that order."""
    return tuple(role for role in (TRAINER, INFERENCE) if job.pods(role).external)


@dataclass(frozen=True)
class Join:
    """A joining process's view of its job, from its environment (Join.from_environ)."""

    controller_host: str
    store_port: int
    job_id: str
    """namespace/name."""
    token: bytes
    pod_ip: str | None = None
    """WEIGHTSYNC_POD_IP, if set: the address other ranks dial this process at."""
    vllm_server: str | None = None
    """WEIGHTSYNC_VLLM_SERVER, if set: an external vLLM server's URL as the controller reaches it."""

    @property
    def namespace(self) -> str:
        return self.job_id.split("/", 1)[0]

    @property
    def name(self) -> str:
        return self.job_id.split("/", 1)[1]

    @property
    def controller(self) -> str:
        """host:port, as WEIGHTSYNC_CONTROLLER says it."""
        host = f"[{self.controller_host}]" if ":" in self.controller_host else self.controller_host
        return f"{host}:{self.store_port}"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "Join | None":
        """The join variables of `environ`; None where WEIGHTSYNC_CONTROLLER is unset (this
        process is not joining). SpecError naming the variable when one is missing or malformed."""
        if not environ.get(JoinEnv.CONTROLLER):
            return None
        missing = [name for name in JoinEnv.REQUIRED if not environ.get(name)]
        if missing:
            raise SpecError([f"{JoinEnv.CONTROLLER} is set but {' and '.join(missing)} is not: a process joining a job "
                             f"needs all of {', '.join(JoinEnv.REQUIRED)} (the Secret <job>-join, or the file "
                             "`weightsync run --join-env FILE` wrote)"])
        host, port = _host_port(environ[JoinEnv.CONTROLLER])
        job_id = environ[JoinEnv.JOB_ID].strip()
        namespace, _, name = job_id.partition("/")
        if not namespace or not name or "/" in name:
            raise SpecError([f"{JoinEnv.JOB_ID}={job_id!r}: expected namespace/name, for example default/my-job"])
        token = environ[JoinEnv.TOKEN].strip().encode()
        if len(token) < MIN_BYTES:
            raise SpecError([f"{JoinEnv.TOKEN} is shorter than {MIN_BYTES} bytes: it must hold the job's whole token "
                             "(the Secret <job>-token's, or the one `weightsync run --join-env FILE` wrote)"])
        return cls(host, port, job_id, token, pod_ip=environ.get(JoinEnv.POD_IP) or None,
                   vllm_server=environ.get(JoinEnv.VLLM_SERVER) or None)

    def local_address(self) -> str:
        """The address other ranks dial this process at: WEIGHTSYNC_POD_IP, or else this machine's
        address on the route to the controller (the interface its packets to the controller
        leave by, which is the one the job's other ranks share a network with)."""
        if self.pod_ip:
            return self.pod_ip
        try:
            family, _, _, _, address = socket.getaddrinfo(self.controller_host, self.store_port,
                                                          type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(address)  # a datagram socket's connect sends nothing: it only picks the route
                return probe.getsockname()[0]
        except OSError as e:
            raise SpecError([f"cannot find this machine's address on the route to the controller "
                             f"{self.controller} ({e.strerror or e}); set {JoinEnv.POD_IP} to the address the job's "
                             "other ranks reach this process at"]) from None


def _host_port(value: str) -> tuple[str, int]:
    value = value.strip()
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecError([f"{JoinEnv.CONTROLLER}={value!r}: expected host:port of the controller's store, for example "
                         "my-job-controller-0.my-job.default.svc:29500"])
    return host, int(port)
