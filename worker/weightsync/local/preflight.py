"""What `weightsync run` refuses before it starts anything: a job this machine cannot run as asked
(too few GPUs, too little memory, a model that cannot be built, vLLM missing from the Python that
would run it), or that asks for what only a cluster gives (values from Secrets or ConfigMaps), or
a --join-env that does not fit the job. Each refusal says what to change; the local runner
(runner.py) starts a job only once every check here has passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from weightsync.job import CONTROLLER, INFERENCE, ROLES, TRAINER, Env, Job, ValueFrom, external_roles
from weightsync.local.external import join_path_problem
from weightsync.local.memory import shortfall
from weightsync.model.build import check_fits, meta_layout
from weightsync.model.config import served_config
from weightsync.model.lora import adapter_layout
from weightsync.roles.tp_engine import check_block_slices

VLLM_PROBE_TIMEOUT = 180.0  # seconds to import vLLM in the Python that runs it


class CannotRunHere(RuntimeError):
    """A valid job that this machine cannot run (too little memory, too few GPUs), refused before
    any process starts."""



def check_runs_here(job: Job, join_env: Path | None, share_gpus: bool, vllm_python: str | None) -> dict[str, str]:
    """Refuse, before any file or process is made, a job this machine cannot run as asked (with
    job.errors.SpecError or CannotRunHere, each saying what to change); returns the environment
    its pods get besides (a vLLM job's: the Python that runs vLLM, `vllm_python` or this one)."""
    extra = {}
    check_join_env(job, join_env)
    if job.model.lora is not None:
        adapter_layout(job.model)  # an adapter on layers the model has not (built on the meta device)
    if job.inference.runs_vllm and not job.inference.external:
        # what vLLM would build of the model, and how it splits its experts, refused before anything starts
        served_config(job.model, job.inference.model_replicas, job.inference.vllm.expert_parallel)
        check_block_slices(job)  # fp8 slices that cut a block, named (vLLM would refuse naming no layer)
        extra[Env.VLLM_PYTHON] = check_vllm_python(vllm_python or sys.executable)
    layout = meta_layout(job.model)  # a model transformers cannot build is refused before anything starts
    if job.trainer.external:
        pass  # the user's own trainers: what they hold is their script's
    elif job.trainer.command:
        check_command_env(job)  # refused here if it needs a cluster (spec.training is the built-in trainer's)
    else:
        check_fits(job.model, job.training.seq_len)
    gpus_per_pod(job, share_gpus)  # this machine's GPUs and memory, before any file or process is made
    too_big = shortfall(job, layout)
    if too_big:
        raise CannotRunHere(too_big)
    return extra


def check_join_env(job: Job, join_env: Path | None) -> None:
    """A job with an external role is run with a join file to write, and only such a job."""
    external = external_roles(job)
    if external and join_env is None:
        raise CannotRunHere(f"job {job.name}'s {' and '.join(external)} ranks are external "
                            f"({', '.join(f'spec.{r}.external' for r in external)}): pass --join-env FILE, and weightsync "
                            "run writes there the variables your processes join the job with")
    if join_env is not None and not external:
        raise CannotRunHere(f"--join-env: job {job.name} has no external role (spec.trainer.external, "
                            "spec.inference.external), so no process of yours joins it; drop --join-env")
    problem = None if join_env is None else join_path_problem(join_env)
    if problem:
        raise CannotRunHere(f"--join-env: {problem}")


def note_pod_templates(job: Job, say) -> None:
    """What of each role's podTemplate a run on this machine leaves out, one line each: the env
    the cluster resolves (valueFrom, envFrom) and the fields only pods in a cluster have
    (volumes, scheduling, labels, resources). Its plain env values reach the processes."""
    for role in ROLES:
        if role in external_roles(job):
            continue
        template = job.pods(role).pod_template
        for line in template.unresolved_env():
            say(f"spec.{role}.podTemplate {line}; the local {role} processes run without it")
        for path in template.cluster_only():
            say(f"spec.{role}.podTemplate.{path}: not applicable locally (it applies to the job's pods in a cluster)")


def check_command_env(job: Job) -> None:
    """spec.trainer.env as a local process can take it: values only (what valueFrom names, a
    Secret or a ConfigMap, is the cluster's)."""
    for i, (name, value) in enumerate(job.trainer.env.items()):
        if isinstance(value, ValueFrom):
            raise CannotRunHere(f"spec.trainer.env[{i}] ({name}) takes its value from the cluster (valueFrom); "
                                "weightsync run takes only value")


def gpus_per_pod(job: Job, share: bool = False) -> dict[int, str]:
    """CUDA_VISIBLE_DEVICES for every pod: distinct GPUs of this machine for the pods that ask
    for them (procsPerPod x gpusPerProc), none for the others; with `share`, the same first
    GPUs for every pod that asks (colocated ranks on one GPU)."""
    layout = job.layout
    # the controller asks for none, nor the pods of a role whose ranks the user starts
    need = {o: 0 if layout.role_of(o) == CONTROLLER or job.pods(layout.role_of(o)).external
            else job.pods(layout.role_of(o)).gpus for o in range(layout.pods)}
    total = max(need.values()) if share else sum(need.values())
    visible: list[str] = []
    if total:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        given = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = [d for d in given.split(",") if d][:count] if given else [str(i) for i in range(count)]
        if len(visible) < total:
            asks = ", ".join(f"{role}: {layout.replicas(role)} pod(s) x {layout.procs_per_pod(role)} x "
                             f"{job.pods(role).gpus_per_proc}" for role in (TRAINER, INFERENCE))
            raise CannotRunHere(f"the job asks for {total} GPUs ({asks}) and this machine has {len(visible)}; "
                                "set spec.trainer.gpusPerProc and spec.inference.gpusPerProc to 0 to run on CPU")
    out, used = {}, 0
    for ordinal, n in need.items():
        out[ordinal] = ",".join(visible[used:used + n])
        used += 0 if share else n
    return out


def check_vllm_python(python: str) -> str:
    """`python` if it runs vLLM with weightsync's backend; CannotRunHere saying what to do if not."""
    probe = "import weightsync.vllm_backend as b; print(b.check_vllm())"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=VLLM_PROBE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CannotRunHere(f"this job's inference pods run vLLM, and {python} could not be asked for it: {e}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CannotRunHere(f"this job's inference pods run vLLM, which {python} cannot: {last}. Pass --vllm-python "
                            "with a Python that has vLLM and weightsync installed (`make vllm-env` makes one in "
                            "~/.cache/weightsync/vllm)")
    return python
