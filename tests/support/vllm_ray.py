"""Run in vLLM's environment (it needs vLLM and Ray), for test_vllm_ray.py: a Ray cluster of this
process, vLLM's LLM (its CPU build) hosted by a named Ray actor on a checkpoint, with weightsync's
backend and the secret in its environment; then what trainer_init refuses of Ray clients (in this
process, each before anything joins), and the user's torchrun of examples/integrations/
vllm_trainer_api.py with --ray-actor, its rank 0 held before each next version. While held, and
after the run, the actor is asked what it holds: its weight_version, its workers' checksums (vLLM's
weight checker's) and greedy tokens, then the same after vLLM's own reload of the step's checkpoint
from disk. Writes WORKDIR/result.json: what the test checks.

    python -P vllm_ray.py CHECKPOINT WORKDIR CONFIG_JSON  # -P: not this folder first (its vllm.py is not vLLM)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "integrations" / "vllm_trainer_api.py"
ACTOR, NAMESPACE = "vllm-server", "vllm"
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
RUN_TIMEOUT = 600.0
PAUSE = "trainer-0-before-ready-v{}"


def checksums(llm) -> dict[str, str]:
    import ray

    merged: dict[str, str] = {}
    for worker in ray.get(llm.collective_rpc.remote("compute_weight_checksums"), timeout=120):
        merged.update(worker)
    return merged


def greedy(llm) -> tuple[list[int], list[str]]:
    """Eight greedy tokens of PROMPT, and the weight versions the output says sampled them."""
    import ray
    from vllm import SamplingParams

    out = ray.get(llm.generate.remote([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0),
                                      use_tqdm=False), timeout=120)[0]
    completion = out.outputs[0]
    return list(completion.token_ids), [span.version for span in completion.weight_versions or []]


def held(llm, version: int, checkpoint: Path) -> dict:
    """What the actor holds at `version`, against vLLM's reload of the step's `checkpoint`."""
    import ray

    label = ray.get(llm.get_weight_version.remote(), timeout=60)
    sums, (tokens, labels) = checksums(llm), greedy(llm)
    ray.get(llm.collective_rpc.remote("reload_weights", kwargs={"weights_path": str(checkpoint)}), timeout=300)
    again, (reloaded, _) = checksums(llm), greedy(llm)
    return {"version": version, "label": label, "output_labels": labels, "checksums": sums,
            "mismatches": sorted(k for k in sums.keys() | again.keys() if sums.get(k) != again.get(k)),
            "tokens": tokens, "reloaded_tokens": reloaded}


def refusals(llm) -> dict[str, str]:
    """What trainer_init says of Ray clients it cannot drive, each in this process before anything joins."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo

    config = json.loads(sys.argv[3])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    source = ModuleSource(model)

    class OwnClient:  # vLLM's client protocol is structural: any object with its methods
        def init_weight_transfer_engine(self, init_info): ...

    def said(client, **env) -> str:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            WeightTransferTrainerFactory.trainer_init(WeightsyncTrainerInitInfo(rank=0), client=client, source=source)
        except ValueError as e:
            return str(e)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        return "accepted"

    ray_client = RayVLLMWeightSyncClient(llm)
    return {"several": said(RayVLLMWeightSyncClient([llm, llm])),
            "twice": said([ray_client, RayVLLMWeightSyncClient(llm)]),
            "own": said(OwnClient()),
            "job": said(ray_client, WEIGHTSYNC_CONTROLLER="127.0.0.1:1", WEIGHTSYNC_JOB_ID="default/other")}


def wait_for(point: Path, trainers: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not point.with_suffix(".reached").exists():
        if trainers.poll() is not None:
            raise SystemExit(f"the trainers exited before {point.name}:\n{log.read_text()[-5000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{point.name} was not reached within {RUN_TIMEOUT:.0f}s")
        time.sleep(0.1)


def main() -> None:
    import ray
    from vllm import LLM

    from weightsync.runtime.faults import PAUSE_DIR_ENV, PAUSE_LIMIT_ENV

    start, work, config = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    pause, checkpoints, log = work / "pause", work / "checkpoints", work / "trainers.log"
    pause.mkdir()
    for version in (1, 2):  # trainer rank 0 holds before each next version while the actor is asked
        (pause / f"{PAUSE.format(version)}.arm").touch()
    began = time.monotonic()
    # the actor's processes inherit this environment (the secret, vLLM's small KV cache)
    ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False, num_cpus=4,
             object_store_memory=100 * 2**20)
    llm = ray.remote(LLM).options(name=ACTOR).remote(
        model=str(start), dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, gpu_memory_utilization=0.05,
        max_model_len=256, max_num_seqs=4, weight_transfer_config={"backend": "weightsync"})
    result: dict = {"start": checksums(llm), "up_seconds": time.monotonic() - began, "refusals": refusals(llm)}
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, PAUSE_DIR_ENV: str(pause),
           PAUSE_LIMIT_ENV: str(RUN_TIMEOUT)}
    script = [str(EXAMPLE), "--config", config, "--steps", "4", "--send-every", "2", "--ray-actor", ACTOR,
              "--ray-namespace", NAMESPACE, "--checkpoints", str(checkpoints)]
    trainers = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                 *script], env=env, cwd=work, stdout=log.open("w"), stderr=subprocess.STDOUT)
    versions = []
    try:
        for version in (1, 2):
            point = pause / PAUSE.format(version)
            wait_for(point, trainers, log)
            versions.append(held(llm, version - 1, checkpoints / f"step-{2 * (version - 1)}"))
            point.with_suffix(".release").touch()
        trainers.wait(RUN_TIMEOUT)
        if trainers.returncode == 0:
            versions.append(held(llm, 2, checkpoints / "step-4"))
    finally:
        if trainers.poll() is None:
            trainers.kill()
        ray.shutdown()
    result.update(versions=versions, trainers=trainers.returncode, seconds=time.monotonic() - began)
    (work / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
