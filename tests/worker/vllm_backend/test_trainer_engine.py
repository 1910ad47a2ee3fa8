"""weightsync as vLLM's trainer-side engine (vllm_backend/trainer.py), in vLLM's own environment
and through vLLM's own factory: importing the init info's module registers the engine, once
however often it is imported; the factory picks it by the init info's class; and what cannot work
is refused on one line before anything joins: a source other than vLLM's ModuleSource, a world
size that is not torchrun's, and a process with no job in its environment. (A whole job, two FSDP2
ranks into a vLLM server: test_external_vllm.py.)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from support.vllm import vllm_python

pytestmark = pytest.mark.slow

SCRIPT = """
import importlib, json, os, sys
import torch
from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
import weightsync.vllm_backend.trainer as trainer
importlib.reload(trainer)  # imported again: registered once, no error

def refusal(source, **info):
    try:
        WeightTransferTrainerFactory.trainer_init(trainer.WeightsyncTrainerInitInfo(rank=0, **info),
                                                  client=HTTPVLLMWeightSyncClient("http://127.0.0.1:1"), source=source)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"

class Listed(WeightSource):
    def metadata(self):
        return []
    def __iter__(self):
        return iter(())

model = torch.nn.Linear(4, 4)
print(json.dumps({
    "registered": "weightsync" in WeightTransferTrainerFactory._registry,
    "engine": WeightTransferTrainerFactory._registry["weightsync"]().__name__,
    "other source": refusal(Listed()),
    "world": refusal(ModuleSource(model), world_size=3),
    "no job": refusal(ModuleSource(model)),
}))
"""


def test_the_factory_finds_the_engine_and_refuses_what_cannot_work(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    env["WORLD_SIZE"] = "2"
    done = subprocess.run([vllm_python(), str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["registered"] and found["engine"] == "WeightsyncTrainerEngine", found
    assert found["other source"] == ("TypeError: weightsync's trainer engine sends a module's own parameters: pass "
                                     "source=ModuleSource(model), not Listed"), found
    assert found["world"] == ("ValueError: WeightsyncTrainerInitInfo(world_size=3), but torchrun's WORLD_SIZE=2: give the "
                              "init info the world size this script runs at"), found
    assert found["no job"].startswith("JoinError: weightsync.attach() finds no job in this process's environment: set "
                                      "WEIGHTSYNC_CONTROLLER"), found
