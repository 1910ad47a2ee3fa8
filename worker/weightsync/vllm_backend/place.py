"""Where a vLLM worker's place in its job comes from: its context, its inference rank, its server,
and what a version of the job is (its layout, built once: version_layout).

A worker of one of the job's own pods (spec.inference.engine vllm) reads the pod's contract: its
rank is its pod's ordinal's, at vLLM's worker rank, and its server's URL is the one the pod's
process gave it. A worker of a server the user started (spec.inference.external) has the join
variables instead (job/join.py) and WEIGHTSYNC_VLLM_SERVER, the server's URL as the controller
reaches it (vLLM's configuration holds no address of its HTTP server, so nothing can stand in for
it). It joins when vLLM constructs the engine, once the model is loaded: it reads the job from the
controller's store (rendezvous/external_rank.py), checks the layout of the model it serves (Hugging Face
names, shapes, dtype) against spec.model, claims its rank with that layout (rendezvous/claims.py:
the controller refuses another model than the trainers', the same server twice, a full job), and
is then admitted as a pod's worker is. Nobody calls the server's init route for it, and every
refusal is one line in the server's log that ends its start. The server's data port is
WEIGHTSYNC_DATA_PORT where set, else one the system picks.

A server started for a trainer that runs its job's controller itself (vLLM's trainer-side engine
with no job file) has neither: only the secret it shares with that trainer (job/join.shared_token),
without which it refuses to start (waits_for_init). It learns its job from vLLM's own handshake,
the trainer's init (its controller, its job, this server's URL as the controller reaches it, and
a proof made with the secret: guard.sign_init), and then joins and claims its rank exactly as a
server with the join variables does; a refusal is the init's answer, one line.
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass, replace

import torch
from transformers import AutoModelForCausalLM

from weightsync.job import INFERENCE, Env, Job, Model, SpecError, WorkerContext
from weightsync.job.join import Join, JoinEnv, shared_token
from weightsync.model.build import layout_of, meta_layout
from weightsync.model.flat import ITEMSIZE, FlatLayout, LayoutMismatch
from weightsync.model.lora import adapter_layout
from weightsync.model.quant import VLLM_METHOD, format_of
from weightsync.rendezvous.channel import Channel
from weightsync.rendezvous.claims import Claim, ClaimRefused, claim
from weightsync.rendezvous.external_rank import JoinError, joined_context
from weightsync.rendezvous.protocol import ProofError
from weightsync.vllm_backend import joining
from weightsync.vllm_backend.guard import init_proven

CLAIM_TIMEOUT = 300.0  # seconds for the controller to answer a claim (it answers between two of its steps)


@dataclass(frozen=True)
class Place:
    ctx: WorkerContext
    rank: int
    server: str  # the server's URL, where the controller asks it to load a version
    external: bool  # a server the user started (it says goodbye at the job's end itself)
    layout: FlatLayout  # a version's layout (version_layout), built once
    by_init: bool = False  # joined at its trainer's init (a server of no job until then)


def version_layout(model: Model, checked: FlatLayout | None = None) -> FlatLayout:
    """What a version of the job is: spec.model's tensors (`checked`, where the join already built
    them to check the server against), or, where versions are a LoRA adapter, the adapter's alone
    (the base weights are the checkpoint's, loaded by vLLM). Built once per worker, here."""
    if model.lora is not None:
        return adapter_layout(model)
    return meta_layout(model) if checked is None else checked


def waits_for_init(environ=os.environ) -> None:
    """A server with no job at its start (neither a pod's contract nor the join variables) waits
    for a trainer's init, and must hold the secret that init is proven with: JoinError, after one
    line in the server's log, where it has none."""
    if environ.get(Env.SPEC_FILE) or joining(environ) is not None:
        return
    try:
        token = shared_token(environ)
        problem = None if token else (
            f"this vLLM server runs weightsync's weight-transfer backend with no job: set {JoinEnv.TOKEN} (or "
            f"{JoinEnv.TOKEN_FILE}, a file holding it) to the secret its trainer has, in the server's environment, "
            "or the join variables of a job")
    except SpecError as e:
        problem = e.problems[0]
    if problem is not None:
        print(f"weightsync: {problem}", file=sys.stderr, flush=True)
        raise JoinError(problem)


def init_join(init, environ=os.environ) -> tuple[Join, str]:
    """The job a trainer's init names (its fields: engine.WeightsyncInitInfo), as join variables
    would name it, once its proof is seen to be the secret's (JoinError, one line, otherwise)."""
    token = shared_token(environ)
    if token is None:
        raise JoinError(f"this vLLM server has no secret to check its trainer's init with: set {JoinEnv.TOKEN} (or "
                        f"{JoinEnv.TOKEN_FILE}) in its environment, the trainer's")
    if not init_proven(token, init.job_id, init.controller, init.server, init.proof):
        raise JoinError(f"the init of job {init.job_id} is not proven with this server's secret: give the trainer and "
                        f"the server the same {JoinEnv.TOKEN}")
    join = Join.from_environ({JoinEnv.CONTROLLER: init.controller, JoinEnv.JOB_ID: init.job_id,
                              JoinEnv.TOKEN: token.decode(), JoinEnv.POD_IP: environ.get(JoinEnv.POD_IP, ""),
                              JoinEnv.VLLM_SERVER: init.server})
    return join, init.server.rstrip("/")


def place_of(parallel_config, model_config, init=None) -> Place:
    """This worker's place; for a server the user started, joined as described above (JoinError
    and the like, after one line in the server's log, where it cannot be). `init`: the trainer's
    init (engine.WeightsyncInitInfo), which names the job of a server that has none of its own."""
    worker = parallel_config.rank
    by_init = init is not None and bool(init.controller)
    try:
        found = init_join(init) if by_init else joining()
    except SpecError as e:
        raise JoinError(e.problems[0]) from None
    if found is None:
        ctx = WorkerContext.from_environ()
        problem = quantization_problem(ctx.job.model, model_config)
        if problem is not None:
            raise ValueError(problem)
        return Place(ctx, ctx.job.layout.ranks_of(ctx.ordinal)[worker], os.environ[Env.VLLM_SERVER], external=False,
                     layout=version_layout(ctx.job.model))
    join, url = found
    try:
        ctx, rank, checked = _claimed(join, url, worker, parallel_config.world_size, model_config)
    except (JoinError, ClaimRefused, SpecError, ProofError, TimeoutError) as e:
        problem = "; ".join(e.problems) if isinstance(e, SpecError) else str(e)
        print(f"[vLLM server {url}] cannot join job {join.job_id}: {problem}", file=sys.stderr, flush=True)
        raise JoinError(problem) from None
    return Place(ctx, rank, url, external=True, layout=version_layout(ctx.job.model, checked), by_init=by_init)


def _claimed(join: Join, url: str, worker: int, workers: int, model_config) -> tuple[WorkerContext, int, FlatLayout]:
    """This worker's context, its claimed rank, and spec.model's layout the server was checked against."""
    claimed: list[int] = []
    built: list[FlatLayout] = []

    def rank_of(job: Job, channel: Channel) -> int:
        """The inference rank the controller gives this worker, once this server is seen to serve
        the job's model, quantized as the job's versions are."""
        problem = quantization_problem(job.model, model_config)
        if problem is not None:
            raise JoinError(problem)
        layout = served_layout(model_config)
        built[:] = [meta_layout(job.model)]
        try:
            built[0].check_matches(layout, what="this server")
        except LayoutMismatch as e:
            raise JoinError(f"this server serves another model than job {job.identity}: {e}; serve spec.model (its "
                            "config or checkpoint) in spec.model.dtype (--dtype)") from None

        def ended() -> None:
            end = channel.end()
            if end is not None:
                raise JoinError(f"job {job.identity} ended before this server could join: {end.message}")

        claimed.append(claim(channel, Claim(url, worker, workers, layout.to_json()), CLAIM_TIMEOUT, ended))
        return claimed[0]

    ctx, channel = joined_context(join, INFERENCE, rank_of)
    channel.close()
    return replace(ctx, data_port=int(os.environ.get(Env.DATA_PORT) or 0)), claimed[0], built[0]


def served_quantization(model_config) -> str | None:
    """The format (spec.model.quantization's name) of the weights this server serves quantized,
    as vLLM's model config says (a quantized checkpoint's quantization_config, or --quantization);
    None where it serves them unquantized, or quantizes them in a way weightsync does not send."""
    method = getattr(model_config, "quantization", None)
    return next((name for name, vllm in VLLM_METHOD.items() if vllm == method), None)


def quantization_problem(model: Model, model_config) -> str | None:
    """Why a server whose vLLM model config is `model_config` cannot load the versions of
    spec.model `model` in place (the line that refuses it), or None where it quantizes its
    weights as the job's versions are quantized: vLLM's reload of a quantized version processes
    its tensors for the server's own quantized kernels, so the server must already run them."""
    served = getattr(model_config, "quantization", None)
    fmt = format_of(model.quantization)
    if served == (VLLM_METHOD[fmt.name] if fmt is not None else None):
        return None
    wanted = f"spec.model.quantization {fmt.name} ({VLLM_METHOD[fmt.name]})" if fmt else "unquantized weights"
    how = f"quantizes them as {served}" if served else "serves them unquantized"
    return (f"the weightsync backend loads the job's {wanted} in place; this server {how}: serve the job's model "
            "as spec.model says (a quantized checkpoint's own quantization_config, no --quantization of another)")


def served_layout(model_config) -> FlatLayout:
    """The layout of the model this server serves, as the trainers send it: the Hugging Face names
    and shapes of its config's causal LM (what vLLM's load_weights takes), in its --dtype, its
    linear layers' weights and their scales where it serves them quantized (served_quantization)."""
    dtype = str(model_config.dtype).removeprefix("torch.")
    if dtype not in ITEMSIZE:
        raise SpecError([f"this server runs the model in {dtype}; serve it in spec.model.dtype (--dtype)"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(model_config.hf_config), dtype=torch.float32)
    return layout_of(model, dtype, served_quantization(model_config))
