"""weightsync in vLLM's own environment, both checks in one Python (a vLLM import costs half a
minute of the machine):

- On a CPU with AMX tiles, every vLLM process may use them once it loaded weightsync's plugin
  (vllm_backend.allow_amx_tiles): vLLM's CPU build runs its bfloat16 attention and MoE kernels on
  the tiles without asking Linux for their state, and a process that has not asked dies of SIGILL
  at its first tile instruction. Shown through vLLM's own plugin loader, by reading the process's
  permitted state (arch_prctl ARCH_GET_XCOMP_PERM) before and after, in the process and in a child
  forked from it as vLLM forks its workers.
- vLLM's trainer-side factory finds weightsync's trainer engine (vllm_backend/trainer.py) by its
  init info's class once that module is imported, however often; and what cannot work is refused
  on one line before anything joins: a source other than vLLM's ModuleSource, a world size that
  is not torchrun's, and a process with no job in its environment. (A whole job, two FSDP2 ranks
  into a vLLM server: test_external_vllm.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.vllm import vllm_python

pytestmark = pytest.mark.slow

XTILEDATA = 1 << 18  # the tile data's bit in the xstate features (Linux: XFEATURE_XTILEDATA)
HAS_AMX = "amx_tile" in Path("/proc/cpuinfo").read_text().split()

SCRIPT = """
import ctypes, importlib, json, multiprocessing, os

def permitted():
    mask = ctypes.c_uint64()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(158, 0x1022, ctypes.byref(mask)) != 0:  # SYS_arch_prctl, ARCH_GET_XCOMP_PERM
        raise OSError(ctypes.get_errno(), "arch_prctl(ARCH_GET_XCOMP_PERM)")
    return mask.value

def child(queue):
    queue.put(permitted())

def tiles():
    before = permitted()
    import torch
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    after = permitted()
    queue = multiprocessing.get_context("fork").Queue()
    process = multiprocessing.get_context("fork").Process(target=child, args=(queue,))
    process.start()
    forked = queue.get(timeout=60)
    process.join(60)
    return {"amx": torch.cpu._is_amx_tile_supported(), "before": before, "after": after, "forked": forked}

def trainer_engine():
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    import weightsync.vllm_backend.trainer as trainer
    importlib.reload(trainer)  # imported again: registered once, no error

    def refusal(source, **info):
        try:
            WeightTransferTrainerFactory.trainer_init(trainer.WeightsyncTrainerInitInfo(rank=0, **info),
                                                      client=HTTPVLLMWeightSyncClient("http://127.0.0.1:1"),
                                                      source=source)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "accepted"

    class Listed(WeightSource):
        def metadata(self):
            return []
        def __iter__(self):
            return iter(())

    model = torch.nn.Linear(4, 4)
    return {
        "registered": "weightsync" in WeightTransferTrainerFactory._registry,
        "engine": WeightTransferTrainerFactory._registry["weightsync"]().__name__,
        "other source": refusal(Listed()),
        "world": refusal(ModuleSource(model), world_size=3),
        "no job": refusal(ModuleSource(model)),
    }

if __name__ == "__main__":
    print(json.dumps({"tiles": tiles(), "trainer": trainer_engine()}))
"""


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    script = tmp_path_factory.mktemp("plugin") / "plugin.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    env["WORLD_SIZE"] = "2"
    done = subprocess.run([vllm_python(), str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX tiles (lscpu: amx_tile); vLLM's kernels use none here")
def test_on_an_amx_cpu_the_plugin_gives_each_vllm_process_the_tiles(found):
    masks = found["tiles"]
    assert masks["amx"], f"/proc/cpuinfo has amx_tile, torch sees none: {masks}"
    assert masks["after"] & XTILEDATA, f"the plugin loaded, and this process may not use AMX tiles: {masks}"
    assert masks["forked"] & XTILEDATA, f"a forked worker may not use AMX tiles: {masks}"


@pytest.mark.skipif(HAS_AMX, reason="this CPU has AMX tiles: the test above applies")
def test_without_amx_tiles_the_plugin_asks_for_nothing(found):
    masks = found["tiles"]
    assert not masks["amx"], f"torch sees AMX tiles that /proc/cpuinfo does not list: {masks}"
    assert masks["after"] == masks["before"] and not masks["after"] & XTILEDATA, masks


def test_the_factory_finds_the_trainer_engine_and_refuses_what_cannot_work(found):
    engine = found["trainer"]
    assert engine["registered"] and engine["engine"] == "WeightsyncTrainerEngine", engine
    assert engine["other source"] == ("TypeError: weightsync's trainer engine sends a module's own parameters: pass "
                                      "source=ModuleSource(model), not Listed"), engine
    assert engine["world"] == ("ValueError: WeightsyncTrainerInitInfo(world_size=3), but torchrun's WORLD_SIZE=2: "
                               "give the init info the world size this script runs at"), engine
    assert engine["no job"].startswith("JoinError: weightsync.attach() finds no job in this process's environment: "
                                       "set WEIGHTSYNC_CONTROLLER"), engine
