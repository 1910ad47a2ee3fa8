"""`weightsync run job.yaml`: a whole WeightTransferJob as local processes, one per pod, on
127.0.0.1. Each gets the files (the defaulted spec, the job token) and the environment that its
pod gets in a cluster, with network mode tcp and ports of its own. As in a cluster, a pod that
exits or fails its liveness probe is started again, with back-off (kubelet.py), and the job's end
is what its controller reports: the run follows the controller's records until its completion
record, which names the rank that failed first when the job failed. Progress goes to stderr; the
run ends with a summary. Every process started here is stopped when the run ends, fails or is
interrupted.

The summary: versions delivered to and verified by every inference rank, failed verifications,
bytes delivered per version (version size x inference ranks), the median seconds per version,
GB/s from those two, the trainers' mean loss over the last steps, and the pods that restarted
(how often)."""

from __future__ import annotations

import http.client
import json
import os
import queue
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Mapping

from weightsync.job import (
    CONTROLLER,
    DATA_PORT,
    INFERENCE,
    MASTER_PORTS,
    SPEC_KEY,
    TOKEN_KEY,
    TORCHRUN_VARS,
    TRAINER,
    Env,
    Job,
    PodSite,
    dump_document,
    external_roles,
    load_job,
    pod_env,
    states,
)
from weightsync.local import ports
from weightsync.local.external import JoinOffer
from weightsync.local.kubelet import Kubelet, Pod, tail
from weightsync.local.ports import LOOPBACK
from weightsync.local.preflight import (
    check_command_env,
    check_join_env,
    check_runs_here,
    gpus_per_pod,
    note_pod_templates,
)
from weightsync.runtime.health import METRICS_PATH
from weightsync.runtime.procs import exit_status
from weightsync.transport.nccl import shared_gpu_env

EXIT_TIMEOUT = 60.0  # seconds for every process to exit once the job has ended
STATUS_FILE = "status.json"  # in the run's directory: the job's status, as the controller reports it
URL_POLL = 0.1  # seconds between two looks at whether the controller's metrics answer
# The pod's environment decides these; the shell's values must not leak into a local pod.
POD_OWNED_PREFIXES = ("WEIGHTSYNC_", "NCCL_", "GLOO_", "UCCL_", "KUBERNETES_", "KUBECONFIG", "PET_", "TORCHELASTIC_")


class RunFailed(RuntimeError):
    def __init__(self, message: str, summary: dict | None = None):
        super().__init__(message)
        self.summary = summary  # what the job got done before it failed


class LocalJob:
    """The processes of one job's pods on this machine. With `join_env` (a path), the pods of the
    job's external roles are not started: their ranks are processes the user starts with the
    variables this writes there once the controller's store is up (local/external.py)."""

    def __init__(self, job: Job, workdir: Path, extra_env: Mapping[str, str] | None = None,
                 progress: IO[str] = sys.stderr, share_gpus: bool = False, join_env: Path | None = None):
        # absolute: every pod's environment names its files from here, and pods run elsewhere
        self.job, self.workdir, self.progress = job, Path(workdir).resolve(), progress
        self.share_gpus = share_gpus
        self.extra_env = dict(extra_env or {})
        self.events: queue.Queue = queue.Queue()
        self.transfers: list[dict] = []
        self.completion: dict | None = None
        check_join_env(job, join_env)
        self._stopping = threading.Event()
        self.pods = self._pods()
        note_pod_templates(job, self.say)
        self.kubelet = Kubelet(self.pods, self.workdir, self.say)
        self.offer = None if join_env is None else JoinOffer(job, Path(join_env), self.store_port, self.token_file,
                                                             self.pods[0].log, self.say)

    # ------------------------------------------------------------ what each pod gets

    def _files(self) -> tuple[Path, Path]:
        """The ConfigMap's and the Secret's content, where the pod's mounts would put them."""
        spec_file = self.workdir / "spec" / SPEC_KEY
        token_file = self.workdir / "token" / TOKEN_KEY
        for folder in (self.workdir, spec_file.parent, token_file.parent):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder.chmod(0o700)  # private, also where it existed (mkdir's mode is masked, and not applied then)
        spec_file.write_text(dump_document(self.job.to_object()))
        # created with its final permissions: no moment in which another user may open it
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, 0o600)  # a file that existed keeps its mode through O_CREAT
            f.write(secrets.token_hex(32))
        return spec_file, token_file

    def _pods(self) -> list[Pod]:
        layout = self.job.layout
        spec_file, token_file = self._files()
        inference_procs = layout.procs_per_pod(INFERENCE)
        servers = layout.inferences if self.job.inference.runs_vllm else 0
        base = {k: v for k, v in os.environ.items() if not k.startswith(POD_OWNED_PREFIXES) and k not in TORCHRUN_VARS}
        base["PYTHONUNBUFFERED"] = "1"
        # a command such as [torchrun, ...] is this environment's, as in the image it is the image's:
        # its executables first, whether or not the user's shell activated it
        here = os.path.dirname(sys.executable)
        base["PATH"] = os.pathsep.join([here] + [p for p in base.get("PATH", "").split(os.pathsep) if p and p != here])
        # the pods share this machine's cores
        base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (layout.pods - 1))))
        gpus = gpus_per_pod(self.job, self.share_gpus)
        check_command_env(self.job)
        # leased until stop(); the trainers' rendezvous takes a port of MASTER_PORTS from master_port
        # on per resume (command.py)
        self.ports = ports.lease([1, MASTER_PORTS] + [1] * layout.pods
                                 + [inference_procs] * layout.inferences + [1] * servers)
        store_port, master_port, *picked = self.ports
        health_ports, data_ports = picked[:layout.pods], picked[layout.pods:layout.pods + layout.inferences]
        server_ports = picked[layout.pods + layout.inferences:]
        first_inference = layout.first_ordinal(INFERENCE)
        pods = []
        self.store_port, self.token_file = store_port, token_file
        external = external_roles(self.job)
        for ordinal in range(layout.pods):
            role = layout.role_of(ordinal)
            if role in external:  # the user starts these ranks
                continue
            site = PodSite(
                namespace=self.job.namespace,
                ordinal=str(ordinal),
                pod_name=self.job.pod_name(ordinal),
                pod_ip=LOOPBACK,
                controller_host=LOOPBACK,
                store_port=store_port,
                data_port=data_ports[ordinal - first_inference] if role == INFERENCE else DATA_PORT,
                health_port=health_ports[ordinal],
                spec_file=str(spec_file),
                token_file=str(token_file),
                master_addr=LOOPBACK,
                master_port=master_port,
                report_to_kubernetes=False,  # no cluster to report to: stdout, and the status file
                status_file=str(self.workdir / STATUS_FILE),
            )
            # CUDA_VISIBLE_DEVICES: what the device plugin gives the pod
            env = {**base, "CUDA_VISIBLE_DEVICES": gpus[ordinal], **pod_env(self.job, role, "tcp", site)}
            # spec.<role>.podTemplate's env, after the job's as in the pod (valueFrom: note_pod_templates)
            env.update({v.name: v.value or "" for v in self.job.pods(role).pod_template.env if v.value_from is None})
            if role == INFERENCE and servers:
                env[Env.VLLM_PORT] = str(server_ports[ordinal - first_inference])
            if self.share_gpus:
                env[Env.COLOCATED] = "1"
            if self.share_gpus and gpus[ordinal]:
                env.update(shared_gpu_env(self.job.pod_name(ordinal)))
            env.update(self.extra_env)
            name = self.job.pod_name(ordinal)
            # a user's command runs where `weightsync run` was started (its paths are the user's)
            cwd = Path.cwd() if role == TRAINER and self.job.trainer.command else None
            pods.append(Pod(ordinal, role, name, env, self.workdir / "logs" / f"{name}.log", layout.ranks_of(ordinal),
                            read_stdout=self._read_lines if role == CONTROLLER else None, cwd=cwd))
        return pods

    # ------------------------------------------------------------ running

    @property
    def started(self) -> bool:
        return any(p.proc is not None for p in self.pods)

    @property
    def metrics_url(self) -> str:
        """Where the controller serves the job's metrics (runtime/metrics.py) while it runs."""
        controller = next(p for p in self.pods if p.role == CONTROLLER)
        return f"http://{LOOPBACK}:{controller.env[Env.HEALTH_PORT]}{METRICS_PATH}"

    def start(self) -> None:
        (self.workdir / "logs").mkdir(mode=0o700, parents=True, exist_ok=True)
        self.kubelet.start()
        threading.Thread(target=say_once_up, args=(self.metrics_url, self._stopping, self.say,
                                                    "the controller's metrics for Prometheus: {url}"),
                         name="metrics-url", daemon=True).start()
        if self.offer is not None:
            self.offer.start()

    def _read_lines(self, stream) -> None:
        """The controller's stdout: its records (JSON lines), and anything else it prints. Both go
        into its log as well, as `kubectl logs` shows a pod's (what `weightsync report` reads)."""
        with open(self.pods[0].log, "ab") as log:
            for raw in stream:
                log.write(raw if raw.endswith(b"\n") else raw + b"\n")
                log.flush()
                self._take(raw)

    def _take(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").strip()
        if line:
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict) and "event" in event:
                if event["event"] == "completion":
                    self.kubelet.end()  # the job's end: from now on no pod is restarted
                self.events.put(event)
            else:
                self.say(f"controller: {line}")

    def say(self, text: str) -> None:
        self.progress.write(f"weightsync: {text}\n")
        self.progress.flush()

    def _drain(self, timeout: float = 0.0) -> None:
        try:
            while True:
                event = self.events.get(timeout=timeout)
                timeout = 0.0
                if event["event"] == "transfer":
                    self.transfers.append(event)
                    self.say(_describe_transfer(event))
                elif event["event"] == "completion":
                    self.completion = event
        except queue.Empty:
            pass

    def follow(self, timeout: float | None = None) -> dict:
        """Show progress until the controller reports the job's end (its completion record),
        while the kubelet restarts pods that die or fail their liveness probe. RunFailed past
        `timeout` seconds, or when a pod keeps dying (kubelet.CrashLoop)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.completion is None:
            self._drain(0.05)
            if self.completion is None and self.kubelet.failure is not None:
                raise RunFailed(f"{self.kubelet.failure}{self._restarts()}")
            if self.completion is None and deadline is not None and time.monotonic() > deadline:
                raise RunFailed(f"the job did not finish within {timeout:.0f}s{self._restarts()}")
        self.kubelet.end()
        if self.kubelet.restarts():
            self.say(f"restarted pods: {self.kubelet.describe_restarts()}")
        return self.completion

    def wait(self, timeout: float | None = None) -> dict:
        """Follow the job to its end and every running process to its exit; return the summary or
        raise RunFailed. A pod that was down (waiting to restart) when the job ended stays down.
        A failed job's processes are not waited for, but for the controller's (it reports the
        failure, to the status file too, before it exits)."""
        completion = self.follow(timeout)
        if self.offer is not None:
            self.offer.stop()
        exit_by = time.monotonic() + EXIT_TIMEOUT
        failed = completion["state"] != states.SUCCEEDED
        for pod in self.pods:
            if pod.restart_at is not None or (failed and pod.role != CONTROLLER):
                continue
            try:
                code = pod.proc.wait(max(0.0, exit_by - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RunFailed(f"{pod.describe()} did not exit within {EXIT_TIMEOUT:.0f}s after the job ended"
                                + (f"; the controller reports: {completion['message']}" if failed else "")) from None
            if code != 0 and not failed:
                raise RunFailed(f"{pod.describe()} {exit_status(code)} after the job ended\n{tail(pod.log)}")
        self._drain()
        if failed:
            raise RunFailed(f"the controller reports: {completion['message']}{self._restarts()}")
        return self.summary()

    def _restarts(self) -> str:
        described = self.kubelet.describe_restarts()
        return f"; restarted pods: {described}" if described else ""

    def summary(self) -> dict:
        seconds = [t["seconds"] for t in self.transfers]
        median = statistics.median(seconds) if seconds else 0.0
        bytes_per_version = self.transfers[-1]["bytes"] if self.transfers else 0
        completion = self.completion or {}
        # a version sent again to a rank that rejoined counts once; a round that reached no rank not at all
        return {"versions": len({t["version"] for t in self.transfers if t.get("inference_ranks", 1)}),
                "failed_verifications": completion.get("failed_verifications", 0),
                "bytes_per_version": bytes_per_version,
                "seconds_per_version": round(median, 6),
                "gbps": round(bytes_per_version / median / 1e9, 4) if median else 0.0,
                "final_loss": completion.get("final_loss"),
                "restarts": self.kubelet.restarts()}

    def stop(self) -> None:
        """Stop every process this run started (whole process groups), then reap them."""
        self._stopping.set()
        if self.offer is not None:
            self.offer.stop()
        self.kubelet.stop()
        ports.release(self.ports)
        self.ports = []


def say_once_up(url: str, stop: threading.Event, say, line: str) -> bool:
    """Say `line` (its {url} filled in) once `url` answers, not before: a user who copies it must
    find it there. Looks every URL_POLL seconds until it answers (True) or `stop` is set (False)."""
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=max(URL_POLL, 1.0)):
                say(line.format(url=url))
                return True
        except (OSError, http.client.HTTPException):  # not listening yet, or not answering as it will
            stop.wait(URL_POLL)
    return False


def run(source: str | os.PathLike | Job, *, logs: str | os.PathLike | None = None, extra_env: Mapping[str, str] | None = None,
        progress: IO[str] = sys.stderr, timeout: float | None = None, vllm_python: str | None = None,
        share_gpus: bool = False, join_env: str | os.PathLike | None = None) -> dict:
    """Run a job to its end; returns the summary, raises RunFailed (with the summary so far, when
    the job started), or before starting anything job.errors.SpecError or preflight.CannotRunHere. The
    inference pods of a vLLM job run vLLM with `vllm_python` (this Python by default). With
    `share_gpus` every pod that asks for GPUs gets the same ones (colocated training and
    inference on one GPU). A job with an external role needs `join_env`, the file the variables
    of its external ranks go to (and no other job takes one)."""
    job = source if isinstance(source, Job) else load_job(source)
    join_env = None if join_env is None else Path(join_env)
    vllm = check_runs_here(job, join_env, share_gpus, vllm_python)
    if vllm:
        extra_env = {**(extra_env or {}), **vllm}
    keep = logs is not None
    workdir = Path(logs).resolve() if keep else Path(tempfile.mkdtemp(prefix=f"weightsync-{job.name}-"))
    local = None
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        local = LocalJob(job, workdir, extra_env, progress, share_gpus, join_env)
        layout = job.layout
        yours = " and ".join(external_roles(job))
        local.say(f"job {job.name}: 1 controller, {layout.trainers} trainer pod(s) x {layout.trainer_procs} and "
                  f"{layout.inferences} inference pod(s) x {layout.inference_procs} processes on {LOOPBACK}"
                  + (f" (the {yours} ranks yours to start)" if yours else "") + f"; logs in {workdir / 'logs'}")
        local.start()
        summary = local.wait(timeout)
    except (RunFailed, Interrupted) as e:
        message = f"interrupted by {e}; stopped every process" if isinstance(e, Interrupted) else str(e)
        if local is not None:
            local.stop()
            local.say(f"logs kept in {workdir / 'logs'}")
        raise RunFailed(message, local.summary() if local and local.started else None) from None
    finally:
        if local is not None:
            local.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return summary


class Interrupted(Exception):
    pass


def _interrupt(signum, _frame):
    for s in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the clean-up short
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def _describe_transfer(t: dict) -> str:
    loss = f", loss {t['loss']:.4f}" if "loss" in t else ""
    delta = ""
    if t.get("deltaRanks"):
        changed = f", {t['changed']:.2%} of the elements changed" if "changed" in t else ""
        delta = f"; as a delta to {t['deltaRanks']}: {t['wireBytes'] / 1e6:.2f} MB on the wire{changed}"
    return (f"version {t['version']} (step {t.get('step', '?')}{loss}): {t['bytes'] / 1e6:.2f} MB "
            f"to {t.get('inference_ranks', '?')} inference ranks in {t['seconds']:.4f}s, "
            f"{t['gbps']:.3f} GB/s over {t['transport']}{delta}")
