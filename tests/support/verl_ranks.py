"""verl's side of tests/worker/integrations/test_verl_engine.py, run by verl's Python (`make
verl-env`): weightsync's checkpoint engine driven as verl 0.9.1's CheckpointEngineManager drives
one, on worker processes of its own.

The driver imports the engine module as verl does (verl.utils.import_utils.import_external_libs of
custom_backend_module), takes the class from verl's CheckpointEngineRegistry, then forks two actor
workers and two rollout workers, each making its engine with the arguments verl's workers pass
(CheckpointEngineRegistry.new(backend, is_master=rank == 0, bucket_size=..., **engine_kwargs) on the
actor side, without is_master on the rollout side). Each update is verl's: prepare on every worker,
build_topology here with their metadata, init_process_group on every worker with its share,
send_weights on the actors beside receive_weights on the rollouts, finalize on every worker. The
actors hand a tiny Llama's state_dict (tied lm_head included) as verl's get_per_tensor_param hands
whole tensors, changed at every step. Before the run, and between its first prepare and
build_topology, it records what bad input is refused with. It writes one JSON document: the
refusals, and per update and rollout worker whether what it received is bit for bit what the
actors handed (cast to the job's dtype), with the engines' metrics; then what each worker said of
one update more, whose bytes the test has a trainer change on the way (WEIGHTSYNC_TEST_CORRUPT_VERSION),
and the controller's exit; then the same of a second run, whose rollout workers verl asks for
another global step than its actors publish.

    python verl_ranks.py JOB.yaml OUT.json STEPS
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import multiprocessing
import sys
import time
import traceback
from pathlib import Path

import torch
import verl
import yaml
from transformers import AutoConfig, AutoModelForCausalLM
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

BACKEND, MODULE = "weightsync", "weightsync.integrations.verl"
BUCKET = 2 << 20  # verl's update_weights_bucket_megabytes, in bytes: not the job's bucketMB (1)


def model_of(job: dict):
    config = AutoConfig.for_model(**job["spec"]["model"]["config"])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def version_at(model, step: int) -> dict[str, torch.Tensor]:
    """The actors' weights at a global step: the same on every actor worker, as verl gathers them."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def worker(conn, actor: bool, index: int, kwargs: dict, job: dict) -> None:
    """One verl worker: its engine, made as verl makes it, answering the driver's calls."""
    if actor:
        engine = CheckpointEngineRegistry.new(BACKEND, is_master=index == 0, bucket_size=BUCKET, **kwargs)
        model = model_of(job)
    else:
        engine = CheckpointEngineRegistry.new(BACKEND, bucket_size=BUCKET, **kwargs)
    loop = asyncio.new_event_loop()
    while True:
        call, arg = conn.recv()
        try:
            if call == "prepare":
                conn.send(("ok", engine.prepare()))
            elif call == "init_process_group":
                conn.send(("ok", engine.init_process_group(**arg)))
            elif call == "send_weights":
                sent = version_at(model, arg)
                metrics = loop.run_until_complete(engine.send_weights(((n, t) for n, t in sent.items()), global_steps=arg))
                conn.send(("ok", {"metrics": metrics, "tensors": sent}))
            elif call == "receive_weights":
                got = {}

                async def take():
                    async for n, t in engine.receive_weights(global_steps=arg):
                        got[n] = t.clone()
                try:
                    loop.run_until_complete(take())
                except Exception as e:  # noqa: BLE001 - with how much of the version verl was handed
                    conn.send(("error", f"{type(e).__name__}: {e} [{len(got)} tensors taken]"))
                    continue
                conn.send(("ok", {"tensors": got}))
            elif call == "finalize":
                conn.send(("ok", engine.finalize()))
            elif call == "close":
                engine.close()
                conn.send(("ok", engine.controller.exit if engine.controller is not None else None))
                return
        except Exception as e:  # noqa: BLE001 - handed to the driver, which records or raises it
            traceback.print_exc()
            conn.send(("error", f"{type(e).__name__}: {e}"))


class Workers:
    def __init__(self, job: dict, kwargs: dict):
        fork = multiprocessing.get_context("fork")
        self.conns, self.procs = [], []
        for actor, index in ((True, 0), (True, 1), (False, 0), (False, 1)):
            mine, theirs = fork.Pipe()
            proc = fork.Process(target=worker, args=(theirs, actor, index, kwargs, job), daemon=True)
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)

    def call(self, call: str, args: list) -> list:
        """`call` on every worker at once (args[i] for worker i: the actors' first), as verl's
        ray.get over both worker groups; raises the first error."""
        for conn, arg in zip(self.conns, args):
            conn.send((call, arg))
        replies = [conn.recv() for conn in self.conns]
        errors = [value for kind, value in replies if kind == "error"]
        if errors:
            raise RuntimeError(f"{call}: {errors[0]}")
        return [value for _, value in replies]


def refused(make, call) -> str:
    """The one line a call is refused with (AssertionError where it is not refused)."""
    try:
        result = call(make())
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    except Exception as e:  # noqa: BLE001 - the refusal is what is recorded
        return f"{type(e).__name__}: {e}"
    raise AssertionError("not refused")


async def first(generator):
    return await generator.__anext__()


def main(job_path: str, out: str, steps: int) -> None:
    job = yaml.safe_load(Path(job_path).read_text())
    import_external_libs(MODULE)  # verl's import of custom_backend_module, on every worker and the driver
    engine_cls = CheckpointEngineRegistry.get(BACKEND)
    kwargs = {"job": job_path}
    plain = lambda: CheckpointEngineRegistry.new(BACKEND, bucket_size=BUCKET, **kwargs)  # noqa: E731 - a rollout's
    refusals = {
        "send_before_init": refused(plain, lambda e: e.send_weights(iter(()), global_steps=1)),
        "receive_before_init": refused(plain, lambda e: first(e.receive_weights(global_steps=1))),
        "init_before_prepare": refused(plain, lambda e: e.init_process_group(role="trainer", rank=1, address=None)),
        "finalize_before_send": refused(plain, lambda e: e.finalize()),
        "master_without_job": refused(lambda: None, lambda _: CheckpointEngineRegistry.new(
            BACKEND, is_master=True, bucket_size=BUCKET)),
    }
    workers = Workers(job, kwargs)
    updates = []
    began = time.monotonic()
    for step in range(1, steps + 1):
        metadata = workers.call("prepare", [None] * 4)
        if step == 1:
            refusals["actor_world_size"] = refused(lambda: None, lambda _: engine_cls.build_topology(1, 3, metadata))
            refusals["metadata_count"] = refused(lambda: None, lambda _: engine_cls.build_topology(2, 3, metadata))
        workers.call("init_process_group", shares_of(*engine_cls.build_topology(2, 2, metadata)))
        moved = move(workers, step)
        workers.call("finalize", [None] * 4)
        sent = moved[0]["tensors"]
        same_actors = all(torch.equal(sent[n], t) for n, t in moved[1]["tensors"].items())
        for j in (2, 3):
            got = moved[j]["tensors"]
            dtype = next(iter(got.values())).dtype
            mismatched = [n for n, t in got.items()
                          if not torch.equal(t.view(torch.int16), sent[n].to(dtype).view(torch.int16))]
            updates.append({"step": step, "rollout": j - 2, "received": sorted(got), "sent": sorted(sent),
                            "dtype": str(dtype), "mismatched": mismatched, "actors_agree": same_actors,
                            "metrics": [moved[0]["metrics"], moved[1]["metrics"]]})
    seconds = time.monotonic() - began
    # one update more, whose bytes a trainer changes on the way (the test's CORRUPT_ENV names its
    # version): refused by the rollouts before verl is handed any of it, and the job fails
    corrupted = failing_update(workers, engine_cls, steps + 1, steps + 1)
    exits = workers.call("close", [None] * 4)
    # a run of its own whose rollouts verl asks for another global step than the actors publish
    workers = Workers(job, kwargs)
    wrong_step = failing_update(workers, engine_cls, 1, 2)
    wrong_step_exit = workers.call("close", [None] * 4)[0]
    about = {"version": verl.__version__, "weight_sync": importlib.util.find_spec("verl.checkpoint_engine.weight_sync")
             is not None}
    Path(out).write_text(json.dumps({"verl": about, "refusals": refusals, "updates": updates, "corrupted": corrupted,
                                     "controller_exit": exits[0], "wrong_step": wrong_step,
                                     "wrong_step_exit": wrong_step_exit, "seconds": seconds}, indent=1))


def failing_update(workers: Workers, engine_cls, actor_step: int, rollout_step: int) -> list[str | None]:
    """One update in verl's order, the actors publishing at `actor_step`, the rollouts asked for
    `rollout_step`; what each worker's send or receive raised (None: nothing)."""
    metadata = workers.call("prepare", [None] * 4)
    workers.call("init_process_group", shares_of(*engine_cls.build_topology(2, 2, metadata)))
    for i, conn in enumerate(workers.conns):
        conn.send(("send_weights", actor_step) if i < 2 else ("receive_weights", rollout_step))
    return [value if kind == "error" else None for kind, value in (conn.recv() for conn in workers.conns)]


def shares_of(actor: dict, rollout: dict) -> list[dict]:
    """Each worker's init_process_group arguments from build_topology's two dicts of lists, as
    verl's execute_checkpoint_engine dispatches them: the actors' first."""
    return [{k: v[i] for k, v in group.items()} for group in (actor, rollout) for i in range(len(next(iter(group.values()))))]


def move(workers: Workers, step: int) -> list:
    """send_weights on the actors beside receive_weights on the rollouts, as one verl update."""
    for i, conn in enumerate(workers.conns):
        conn.send(("send_weights" if i < 2 else "receive_weights", step))
    replies = [conn.recv() for conn in workers.conns]
    errors = [value for kind, value in replies if kind == "error"]
    if errors:
        raise RuntimeError(f"update at global step {step}: {errors[0]}")
    return [value for _, value in replies]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
