"""A vLLM server that is a Ray actor (vLLM's LLM, its CPU build), driven through vLLM's own
RayVLLMWeightSyncClient by a trainer with no job file (integrations/vllm.py, vllm_actor.py): the
user's torchrun of examples/integrations/vllm_trainer_api.py, two FSDP2 ranks, --ray-actor. Trainer
rank 0 holds the client, runs the job's controller and drives the actor's updates through its
methods; the actor's worker claims its rank under the name the signed init gave it.

What is checked (support/vllm_ray.py runs it in vLLM's environment and says what it saw): after
each send_weights() the actor holds what vLLM's own reload of that step's checkpoint from disk
holds (its workers' checksums, vLLM's weight checker's, the same before and after the reload; the
same greedy tokens), other weights than it started on, and its weight_version, in get_weight_version
and in its outputs, is the version's number; each trainer rank sent about half of every version.
And what trainer_init refuses of Ray clients, on one line before anything joins: a client over
several actors, one actor twice, a client that is neither vLLM's HTTP nor its Ray client, a Ray
client with a job's join variables (whose controller could not reach the actor).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
from pathlib import Path

import pytest
import torch
from support.vllm import LLAMA, save_checkpoint, vllm_python
from transformers import AutoConfig, AutoModelForCausalLM

from weightsync.job import TORCHRUN_VARS
from weightsync.job.join import JoinEnv

pytestmark = pytest.mark.slow  # a Ray cluster, a vLLM engine and two trainer ranks as processes

HARNESS = Path(__file__).resolve().parents[2] / "support" / "vllm_ray.py"
RUN_TIMEOUT = 900.0


def ray_in(python: str) -> None:
    """Skips, saying why, where vLLM's environment has no Ray (`make vllm-env` installs it)."""
    found = subprocess.run([python, "-c", "import ray"], capture_output=True, text=True)
    if found.returncode:
        reason = f"Ray is not installed in vLLM's environment ({python}); `make vllm-env` installs it"
        print(reason)
        pytest.skip(reason)


def test_a_trainer_on_vllms_api_drives_a_vllm_ray_actor_through_vllms_ray_client(tmp_path):
    python = vllm_python()
    ray_in(python)
    with torch.random.fork_rng():  # whatever this process's generator was seeded with before (the trainers seed 0)
        torch.manual_seed(1)  # the actor starts on other weights than any version
        start = save_checkpoint(dict(AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA)).state_dict()),
                                LLAMA, tmp_path / "start")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_") and k not in TORCHRUN_VARS}
    env.update({JoinEnv.TOKEN: secrets.token_hex(32), "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_USAGE_STATS_ENABLED": "0"})
    run = subprocess.run([python, "-P", str(HARNESS), str(start), str(tmp_path), json.dumps(LLAMA)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=RUN_TIMEOUT)
    log = (tmp_path / "trainers.log").read_text(errors="replace") if (tmp_path / "trainers.log").exists() else ""
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-5000:], log[-5000:])
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["trainers"] == 0, log[-5000:]

    versions = got["versions"]
    assert [v["version"] for v in versions] == [0, 1, 2]
    for v in versions:
        assert v["mismatches"] == [], f"version {v['version']}: other weights than vLLM's reload from disk"
        assert v["tokens"] == v["reloaded_tokens"], f"version {v['version']}: other greedy tokens"
        assert v["label"] == str(v["version"]) and v["output_labels"] == [str(v["version"])], \
            {k: v[k] for k in ("version", "label", "output_labels")}
    # on the CPU vLLM repacks its linear layers' weights for its kernels, leaving those parameters
    # empty: the checksums cover the others (embeddings, norms), and the greedy tokens all of them
    assert got["start"] != versions[0]["checksums"] and versions[0]["checksums"] != versions[1]["checksums"]

    records = [json.loads(line) for line in log.splitlines() if line.startswith('{"event": "transfer"')]
    assert [(r["version"], r["inference_ranks"]) for r in records] == [(0, 1), (1, 1), (2, 1)], records
    shares = {int(rank): int(sent) / int(total) for rank, sent, total in
              re.findall(r"trainer rank (\d+)\] attached on cpu.*; sends (\d+) of (\d+) bytes per version", log)}
    assert sorted(shares) == [0, 1] and all(0.35 < share < 0.65 for share in shares.values()), (shares, log[-3000:])
    assert "the vLLM server at ray-actor-0 claimed inference rank 0" in log, log[-5000:]
    assert "1 vLLM servers (1 of them Ray actors, driven from this process)" in log, log[-5000:]

    refused = got["refusals"]
    assert refused["several"] == ("RayVLLMWeightSyncClient over 2 actors: weightsync drives each server on its own; "
                                  "give one RayVLLMWeightSyncClient(handle) per actor (a list of them)")
    assert refused["twice"] == "an actor is named twice among the clients: one RayVLLMWeightSyncClient per actor"
    assert refused["own"].startswith("OwnClient: weightsync drives each vLLM server over its HTTP routes or through "
                                     "its Ray actor: pass HTTPVLLMWeightSyncClient(url) or RayVLLMWeightSyncClient")
    assert refused["job"].startswith("a RayVLLMWeightSyncClient names no server a job's controller could reach"), refused
    print(f"the actor was up in {got['up_seconds']:.1f}s; the whole run took {got['seconds']:.1f}s; versions: "
          + ", ".join(f"{r['version']} in {r['seconds']:.3f}s" for r in records))
