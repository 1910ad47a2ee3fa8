"""The job a trainer on vLLM's RL API runs itself, with no job file (integrations/vllm.py): what it
is made of, what each server is told, and what a server's refusal says. No vLLM here, so that each
decision is tested without a server.

Why the job is made, not read: a trainer written against vLLM's trainer-side engine names its
servers (its clients) and its model (its ModuleSource) already, and torchrun names its ranks. A
job file would repeat those, and a second copy drifts; so the job is made from them (own_job), and
trainer rank 0 runs its controller in process (ranks.LocalController: the controller, store,
checks and verification every job has).

Why the secret is shared, not derived: vLLM's HTTP client sends no credentials, so nothing in a
request can prove the trainer but its body. The trainer and its servers hold one secret
(WEIGHTSYNC_TOKEN, or the file WEIGHTSYNC_TOKEN_FILE names: job/join.shared_token), and every init
a server gets carries a proof made with it (init_info: guard.sign_init over the job, its controller
and the server's URL). The servers' guard passes only such an init, and from then on answers the
control routes to that job's controller alone.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from weightsync.job import API_VERSION, KIND, Job, JoinEnv, SpecError, load_job
from weightsync.model.config import known_keys
from weightsync.vllm_backend.guard import MIDDLEWARE, sign_init

NAME = "vllm-trainer"  # the job's name where the init info names none
DTYPES = ("float32", "bfloat16", "float16")  # spec.model.dtype's
SERVER_ARGS_HINT = '--weight-transfer-config \'{"backend": "weightsync"}\''


def model_config(config) -> dict[str, Any]:
    """A transformers config (the trainer's model.config) as spec.model.config: the values that
    differ from its class's defaults, and its model_type; what no config of its class takes
    (transformers' own bookkeeping, architectures) left out."""
    values = config.to_diff_dict()
    known = known_keys(type(config))
    out = {k: v for k, v in values.items() if k in known and k not in ("architectures", "transformers_version",
                                                                        "torch_dtype", "dtype", "_name_or_path")}
    out["model_type"] = config.model_type
    return json.loads(json.dumps(out, default=str))


def dtype_of(config, given: str | None) -> str:
    """What the servers run the weights in (spec.model.dtype): the init info's, else the model
    config's where it is one a version can carry, else bfloat16 (vLLM's --dtype auto for a float32
    checkpoint on most machines)."""
    if given is not None:
        if given not in DTYPES:
            raise SpecError([f"WeightsyncTrainerInitInfo(dtype={given!r}): a version is sent in one of "
                             f"{', '.join(DTYPES)}; give the servers' --dtype"])
        return given
    said = str(getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or "").removeprefix("torch.")
    return said if said in ("bfloat16", "float16") else "bfloat16"


def trainer_world(declared: int | None, environ: Mapping[str, str], group: int | None) -> int:
    """The trainer ranks of the run: the init info's world_size where given, else torchrun's
    WORLD_SIZE, else 1; each of those and torch.distributed's group (`group`, where initialized)
    must agree, or SpecError says which differ."""
    said = environ.get("WORLD_SIZE")
    world = declared if declared is not None else int(said) if said and said.isdigit() else 1
    if declared is not None and said not in (None, str(declared)):
        raise SpecError([f"WeightsyncTrainerInitInfo(world_size={declared}), but torchrun's WORLD_SIZE={said}: give the "
                         "init info the world size this script runs at"])
    if group is not None and group != world:
        raise SpecError([f"the trainer runs {world} ranks (the init info's world_size, or WORLD_SIZE), but its "
                         f"torch.distributed group has {group}: every rank of the group is a trainer rank"])
    return world


def own_job(*, name: str, config: Mapping[str, Any], dtype: str, trainers: int, servers: int, tensor_parallel: int = 1,
            on_gpu: bool = False, min_available: int | None = None, away_grace_seconds: int | None = None,
            timeout_seconds: int | None = None, transport: str | None = None) -> Job:
    """The job of a trainer of `trainers` ranks and `servers` vLLM servers of `tensor_parallel`
    workers each, through the one schema (its defaults and rules: SpecError naming a field)."""
    inference: dict[str, Any] = {"replicas": servers, "gpusPerProc": int(on_gpu), "engine": "vllm", "external": True,
                                 "tensorParallel": tensor_parallel}
    if min_available is not None:
        inference["minAvailable"] = min_available
    if away_grace_seconds is not None:
        inference["awayGraceSeconds"] = away_grace_seconds
    transfer: dict[str, Any] = {}
    if timeout_seconds is not None:
        transfer["timeoutSeconds"] = timeout_seconds
    if transport is not None:
        transfer["transport"] = transport
    return load_job({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
                     "spec": {"model": {"config": dict(config), "dtype": dtype},
                              "trainer": {"replicas": trainers, "gpusPerProc": int(on_gpu), "external": True},
                              "inference": inference, "transfer": transfer, "network": {"mode": "tcp"}}})


def init_info(token: bytes, job: Job, controller: str, server: str) -> dict[str, str]:
    """What the trainer's init tells the server at `server` (engine.WeightsyncInitInfo's fields)."""
    return {"job_id": job.identity, "controller": controller, "server": server,
            "proof": sign_init(token, job.identity, controller, server)}


def said(text: str) -> str:
    """What a server answered, on one line: its error's message where it is vLLM's or the guard's
    JSON, else the text."""
    try:
        body = json.loads(text)
        message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("detail")
        text = str(message or text)
    except (ValueError, AttributeError):
        pass
    return " ".join(text.split())[:2000]


def init_refusal(url: str, status: int | None, text: str) -> str:
    """The one line a trainer says where the server at `url` refused its init (HTTP `status`, its
    answer `text`; None: it did not answer)."""
    answer = said(text)
    if status is None:
        return f"the vLLM server at {url} did not answer the init: {answer}"
    other = re.search(r"Invalid init_info for (\w+)", answer)
    if other and other.group(1) != "WeightsyncEngine":
        return (f"the vLLM server at {url} runs another weight-transfer backend ({other.group(1)}): start it with "
                f"{SERVER_ARGS_HINT}")
    if "Weight transfer not configured" in answer:
        return f"the vLLM server at {url} runs no weight-transfer backend: start it with {SERVER_ARGS_HINT}"
    if "cannot join" in answer or "serves another model" in answer:
        return f"the vLLM server at {url} cannot join the trainer's job: {answer}"
    return f"the vLLM server at {url} refused the init ({status}): {answer}"


def unguarded(url: str) -> str:
    return (f"the vLLM server at {url} answers its control routes to any client: start it with --middleware "
            f"{MIDDLEWARE} and {JoinEnv.TOKEN} (the trainer's secret) in its environment")
