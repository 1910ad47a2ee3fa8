"""An inference pod of spec.inference.engine vllm: runs one vLLM OpenAI-compatible server, whose
workers are the pod's inference ranks (vllm_backend/engine.py), and stands by it.

This process starts `vllm serve` on the job's model with weightsync as its weight-transfer backend
(for spec.model.config: the config written to a directory, dummy weights, and no tokenizer, so the
server asks for token ids; for spec.model.path: the checkpoint), waits for it to come up, and has
its workers join the job (the server's init route). A server of tensor-parallel size N (the
pod's model replica, job.Layout) runs N workers, each an inference rank receiving only its own
slices: vLLM is started with --tensor-parallel-size N, and on CPU with its multiprocessing
executor and one set of the pod's cores per worker (VLLM_CPU_OMP_THREADS_BIND, unless the pod's
environment sets it), and its log lines in the job's shape (vllm_backend/logs.py). The pod is ready
while the server is admitted to the job's fleet: it serves a version within
spec.inference.maxVersionLag of the latest (vllm_backend/admission.py).
A server of a LoRA job (spec.model.lora) is started with --enable-lora and serves the adapter
under spec.model.lora.name (vllm_backend/adapter.py).
The controller drives every update itself (control.py). When the job ends this process stops the
server. When the server dies first the pod exits: the controller, which no longer hears the
workers' heartbeats, counts the ranks away, and the pod's next start brings new workers that
rejoin the running job (a server that cannot come up at all fails the job). A server whose engine
died is dead too, though its API process may live on for minutes with its port closed (it waits
for the requests in flight, the controller's load among them, which will never be answered): the
pod ends a server that leaves its port closed for DEAD_AFTER seconds, which also breaks the
controller's call, so the fleet goes on without it at once rather than at the call's deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Sequence

from weightsync.job import INFERENCE, Env, Lora, Model, SpecError, WorkerContext, states
from weightsync.model.config import served_config
from weightsync.rendezvous.channel import Channel, connect_store
from weightsync.rendezvous.proofs import control_key
from weightsync.rendezvous.protocol import who
from weightsync.runtime import health
from weightsync.runtime.life import Farewell
from weightsync.runtime.procs import VLLM_STOP_GRACE, die_with_parent, stop
from weightsync.runtime.rank import JOIN_TIMEOUT, log
from weightsync.vllm_backend import BACKEND, lora_problem, max_lora_rank
from weightsync.vllm_backend.control import ControlError, Server, Unreachable
from weightsync.vllm_backend.guard import MIDDLEWARE
from weightsync.vllm_backend.logs import logging_env

OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"
INIT_TIMEOUT = 300.0  # seconds for the worker to join the job (its model is loaded by then)
ASK_TIMEOUT = 30.0  # seconds to reach the controller's store, to ask whether this pod's server joined before
WATCH_EVERY = 1.0  # seconds between looks at the server's process and the job's end
DEAD_AFTER = 5.0  # seconds a server's process may live on with its port closed before the pod ends it


def run(ctx: WorkerContext, ranks: Sequence[int]) -> int:
    """The pod's server, whose workers are inference ranks `ranks` (its model replica)."""
    rank, tp = ranks[0], len(ranks)
    me = who(INFERENCE, rank) + (f"..{ranks[-1]} (tensor-parallel size {tp})" if tp > 1 else "")
    vllm = ctx.job.inference.vllm
    port = int(os.environ.get(Env.VLLM_PORT) or vllm.port)
    url = f"http://{ctx.pod_ip}:{port}"
    python = os.environ.get(Env.VLLM_PYTHON) or sys.executable  # a vLLM image's own by default
    cpu = ctx.job.inference.gpus_per_proc == 0
    cmd = server_command(python, ctx.job.model, ctx.job.name, vllm.args, ctx.pod_ip, port, tensor_parallel=tp, cpu=cpu,
                         expert_parallel=vllm.expert_parallel)
    env = {**os.environ, **server_env(tp, cpu, os.environ), **logging_env(os.environ), **lora_env(ctx.job.model),
           Env.VLLM_SERVER: url, "VLLM_SERVER_DEV_MODE": "1"}  # dev mode serves the control routes (to the job's key)
    log(me, f"starting the vLLM server: {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: die_with_parent(os.getppid()))
    server = Server(url, control_key(ctx.token, ctx.job.identity))
    life = Farewell(ctx, INFERENCE, ranks, me)  # the end of its workers' lives: the pod speaks for them
    try:
        server.wait_up(JOIN_TIMEOUT, alive=lambda: proc.poll() is None)
        server.init_transfer(INIT_TIMEOUT)
        log(me, f"the vLLM server is up at {url} and its {'workers' if tp > 1 else 'worker'} joined the job")
        life.channel = Channel(connect_store(ctx.controller_host, ctx.store_port, ctx.token, ctx.job.identity,
                                             JOIN_TIMEOUT))
        state = _stand_by(proc, server, life.channel, me)
        if state is not None:
            life.bye()  # this process, not the workers, is the pod's last word
            log(me, f"the job ended ({state}); the vLLM server serves version {_served(server)}")
    except ControlError as e:
        stop(proc, grace=VLLM_STOP_GRACE)
        if _served_before(ctx, rank, life.channel):  # a restart that failed: restarted again, as any other
            log(me, f"{e}; its workers had joined the job before, so the pod starts it again")
            return 1
        life.report(str(e))
        return 1
    if state is None:  # the server died while the job ran: its workers' heartbeats stopped with it
        log(me, f"the vLLM server exited with code {proc.returncode}; ending the pod so that it starts again "
                "and its new workers rejoin the job")
        return 1
    stop(proc, grace=VLLM_STOP_GRACE)
    life.linger()
    return states.exit_code(state)


def server_command(python: str, model: Model, name: str, args: tuple[str, ...], host: str, port: int, *,
                   tensor_parallel: int = 1, cpu: bool = True, expert_parallel: bool = False,
                   guarded: bool = True, backend: bool = True) -> list[str]:
    """vLLM's OpenAI-compatible server for the job's model, run by `python` (one with vLLM), its
    weights sharded over `tensor_parallel` workers, a mixture of experts's experts by expert
    (`expert_parallel`) rather than within each, its control routes answered only to the job's
    controller (`guarded`: vllm_backend/guard.py; a server of no job, as the benchmark's, is not),
    weightsync its weight-transfer backend (`backend`; without, a plain vLLM server that reloads
    from disk, as the benches' and the tests' comparisons: weightsync's backend refuses to start a
    server of no job without its trainer's secret).
    Its module, not the `vllm serve` command, which needs a distribution named vllm (vLLM's CPU
    build is vllm-cpu)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server"]
    # refused here, before any server starts, where vLLM would not build a causal LM or cannot split the experts
    config = served_config(model, (tensor_parallel,), expert_parallel)
    if model.path is not None:
        cmd += ["--model", model.path]
    else:
        folder = tempfile.mkdtemp(prefix="weightsync-vllm-model-")
        config.save_pretrained(folder)
        cmd += ["--model", folder, "--load-format", "dummy", "--skip-tokenizer-init"]
    # --enable-scale-out serves /inference/v1/generate, whose choices name the weight version
    # of every token (the OpenAI routes do not)
    if tensor_parallel > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel)]
        if cpu:  # vLLM's CPU build runs tensor-parallel workers as processes of its own
            cmd += ["--distributed-executor-backend", "mp"]
    if expert_parallel:
        cmd += ["--enable-expert-parallel"]
    if guarded:
        cmd += ["--middleware", MIDDLEWARE]
    if model.lora is not None:
        cmd += lora_args(model.lora, args)
    return cmd + ["--dtype", model.dtype, "--host", host, "--port", str(port), "--served-model-name", name,
                  *(["--weight-transfer-config", json.dumps({"backend": BACKEND})] if backend else []), "--enable-scale-out",
                  *args]


def lora_args(lora: Lora, args: tuple[str, ...]) -> list[str]:
    """What a server of a LoRA job adds to its command (spec.model.lora): LoRA, one adapter at a
    time, of a rank that holds the adapter's; refused on one line where spec.inference.vllm.args
    set a --max-lora-rank below it."""
    given = {a.partition("=")[0]: a for a in args if a.startswith("--")}
    out = [] if "--enable-lora" in given else ["--enable-lora"]
    if "--max-lora-rank" in given:
        at = list(args).index(given["--max-lora-rank"])
        value = given["--max-lora-rank"].partition("=")[2] or (args[at + 1] if at + 1 < len(args) else "")
        problem = lora_problem(lora, True, int(value)) if value.isdigit() else None
        if problem is not None:
            raise SpecError([f"spec.inference.vllm.args: {problem}"])
    else:
        out += ["--max-lora-rank", str(max_lora_rank(lora.rank))]
    return out + ([] if "--max-loras" in given else ["--max-loras", "1"])


def lora_env(model: Model) -> dict[str, str]:
    """A LoRA job's server: the name it serves the adapter under (vllm_backend/adapter.py), and vLLM's
    switch that has it ask resolvers for a name it does not know."""
    if model.lora is None:
        return {}
    return {Env.VLLM_LORA: model.lora.name, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


def server_env(tensor_parallel: int, cpu: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """What a server of `tensor_parallel` workers on CPU needs in its environment: vLLM's CPU build
    binds every worker's OpenMP threads to cores of its own and, where the machine has one NUMA
    node, refuses to guess them. The pod's cores (its affinity) are split into that many groups,
    unless the pod's environment says VLLM_CPU_OMP_THREADS_BIND itself."""
    if not cpu or tensor_parallel == 1 or OMP_BIND in environ:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= tensor_parallel:
        step = len(cores) // tensor_parallel
        groups = [cores[i * step:(i + 1) * step] for i in range(tensor_parallel)]
    else:  # fewer cores than workers: they share them
        groups = [[cores[i % len(cores)]] for i in range(tensor_parallel)]
    return {OMP_BIND: "|".join(",".join(map(str, g)) for g in groups)}


def _stand_by(proc: subprocess.Popen, server: Server, channel: Channel, me: str) -> str | None:
    """Until the job ends (its state) or the server dies (None): its process exits, or lives on
    with its port closed for DEAD_AFTER seconds (its engine died; this ends it). The pod is ready
    while the server is admitted to the job's fleet (it serves a version the fleet accepts:
    admission.py)."""
    ready, closed_since = False, None
    while True:
        try:
            return channel.wait_for_end(WATCH_EVERY).state
        except TimeoutError:
            pass
        if proc.poll() is not None:
            return None
        try:
            admitted, said = server.admission()
            closed_since = None
        except Unreachable as e:
            admitted, said = False, {"why": str(e)}
            closed_since = (closed_since or time.monotonic()) if e.refused else None
            if closed_since is not None and time.monotonic() - closed_since >= DEAD_AFTER:
                log(me, f"the vLLM server's process lives on, but its port has been closed for {DEAD_AFTER:.0f}s "
                        "(its engine died): ending it")
                stop(proc, grace=DEAD_AFTER)  # its engine is gone: nothing to wait for
                return None
        if admitted != ready:
            log(me, f"the vLLM server serves version {said.get('held')}: ready" if admitted else
                f"the vLLM server is out of the job's fleet, not ready: {said.get('why', 'it does not answer')}")
            health.ready(admitted)
            ready = admitted


def _served_before(ctx: WorkerContext, rank: int, channel: Channel | None) -> bool:
    """Whether this pod's server had joined the job before this start (its first rank's join
    counter): a server that cannot come up at its first start fails the job, one that served
    before is restarted as the pod of any other engine would be."""
    try:
        channel = channel or Channel(connect_store(ctx.controller_host, ctx.store_port, ctx.token, ctx.job.identity,
                                                   ASK_TIMEOUT))
        return channel.starts(INFERENCE, rank) > 0
    except Exception:  # noqa: BLE001 - no store to ask: the failure is reported as at a first start
        return False


def _served(server: Server) -> str:
    try:
        return str(server.weight_version())
    except ControlError as e:
        return f"unknown ({e})"
