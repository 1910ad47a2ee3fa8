"""weightsync in vLLM's own environment, both checks in one Python (a vLLM import costs half a
minute of the machine):

- On a CPU with AMX tiles, every vLLM process may use them once it loaded weightsync's plugin
  (vllm_backend.allow_amx_tiles): vLLM's CPU build runs its bfloat16 attention and MoE kernels on
  the tiles without asking Linux for their state, and a process that has not asked dies of SIGILL
  at its first tile instruction. Shown through vLLM's own plugin loader, by reading the process's
  permitted state (arch_prctl ARCH_GET_XCOMP_PERM) before and after, in the process and in a child
  forked from it as vLLM forks its workers.
- vLLM's trainer-side factory finds weightsync's trainer engine (integrations/vllm.py) by its
  init info's class once that module is imported, however often; and what cannot work is refused
  on one line before anything joins: a source that is no vLLM WeightSource, a world size that
  is not torchrun's, a trainer with no job and no secret to share with its servers, several ranks
  with no torch.distributed group to find rank 0's controller through, and send_weights() on an
  engine trainer_init did not make; a WeightSource that breaks vLLM's contract (held names its
  metadata lacks, a tensor yielded in another shape, a pass that yields fewer) is refused on one
  line naming what to fix, and one that keeps it fills the rank's tensors. (Two FSDP2 ranks into
  two vLLM servers with no job file: test_external_vllm.py; the decisions that need no vLLM: integrations/test_vllm_no_job.py.)
- Every internal of vLLM the backend relies on (vllm_backend/internals.py) is there in the vLLM
  installed, and a vLLM without one of them (here one method taken off the class, as a release
  without it would be) is refused when the plugin registers, on one line naming it and the release
  weightsync is tested with; likewise the trainer engine's internals, refused as its module is
  imported.
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
    from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    import weightsync.integrations.vllm as trainer
    from weightsync.integrations.vllm_source import SourceTensors
    importlib.reload(trainer)  # imported again: registered once, no error

    def refusal(source, environ={}, **info):
        os.environ.update(environ)
        try:
            WeightTransferTrainerFactory.trainer_init(trainer.WeightsyncTrainerInitInfo(rank=0, **info),
                                                      client=HTTPVLLMWeightSyncClient("http://127.0.0.1:1"),
                                                      source=source)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        finally:
            for name in environ:
                del os.environ[name]
        return "accepted"

    def sent_first(model):
        engine = trainer.WeightsyncTrainerEngine(client=HTTPVLLMWeightSyncClient("http://127.0.0.1:1"),
                                                 source=ModuleSource(model))
        try:
            engine.send_weights()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "sent"

    class Broken(WeightSource):  # breaks vLLM's WeightSource contract as `how` says
        def __init__(self, how):
            self.how = how
        def metadata(self):
            return [ParamMeta("w", torch.float32, (2, 2)), ParamMeta("b", torch.float32, (2,))]
        def held_names(self):
            return {"w", "x"} if self.how == "held" else None
        def __iter__(self):
            yield "w", torch.zeros(3, 2) if self.how == "shape" else torch.ones(2, 2)
            if self.how != "short":
                yield "b", torch.ones(2)

    def filled(how):
        try:
            tensors = SourceTensors(Broken(how), "cpu")
            tensors.fill()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return {n: t.tolist() for n, t in tensors.named_parameters()}

    model = torch.nn.Linear(4, 4)
    return {
        "registered": "weightsync" in WeightTransferTrainerFactory._registry,
        "engine": WeightTransferTrainerFactory._registry["weightsync"]().__name__,
        "not a source": refusal([model]),
        "held": filled("held"),
        "shape": filled("shape"),
        "short": filled("short"),
        "whole": filled("whole"),
        "world": refusal(ModuleSource(model), world_size=3),
        "no secret": refusal(ModuleSource(model)),
        "no group": refusal(ModuleSource(model), {"WEIGHTSYNC_TOKEN": "s" * 32}),
        "send first": sent_first(model),
    }

def door():
    import weightsync.vllm_backend as backend
    from vllm.model_executor.models.utils import WeightsMapper
    from weightsync.vllm_backend.internals import missing

    found = [i.name for i in missing()]
    del WeightsMapper._map_name_with_shard  # as a vLLM release without it would be
    try:
        backend.register()
    except SystemExit as e:
        return {"missing": found, "refused": str(e.code)}
    return {"missing": found, "refused": None}

def trainer_door():
    import weightsync.integrations.vllm as trainer
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from weightsync.vllm_backend.internals import TRAINER, missing

    found = [i.name for i in missing(TRAINER)]
    del WeightTransferTrainerFactory._registry  # as a vLLM release without it would be
    try:
        importlib.reload(trainer)
    except Exception as e:
        return {"missing": found, "refused": f"{type(e).__name__}: {e}"}
    return {"missing": found, "refused": None}

if __name__ == "__main__":
    print(json.dumps({"tiles": tiles(), "trainer": trainer_engine(), "door": door(), "trainer door": trainer_door()}))
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
    assert engine["not a source"] == ("TypeError: weightsync's trainer engine sends from a vLLM WeightSource "
                                      "(ModuleSource(model), or one of your own), not list"), engine
    assert engine["held"] == ("ValueError: Broken.held_names() names tensors its metadata() does not (x): metadata() "
                              "describes the whole model on every rank"), engine
    assert engine["shape"] == ("ValueError: Broken yielded w as [3, 2] torch.float32; its metadata() says [2, 2] "
                               "torch.float32"), engine
    assert engine["short"] == ("ValueError: Broken yielded 1 of the 2 tensors this rank holds: one pass of iter(source) "
                               "yields every tensor metadata() names"), engine
    assert engine["whole"] == {"w": [[1.0, 1.0], [1.0, 1.0]], "b": [1.0, 1.0]}, engine
    assert engine["world"] == ("ValueError: WeightsyncTrainerInitInfo(world_size=3), but torchrun's WORLD_SIZE=2: "
                               "give the init info the world size this script runs at"), engine
    assert engine["no secret"] == (
        "ValueError: no secret for the servers: set WEIGHTSYNC_TOKEN (or WEIGHTSYNC_TOKEN_FILE, a file holding it) in "
        "every trainer rank's and every vLLM server's environment, the same long random value (openssl rand -hex 32): "
        "vLLM's HTTP client sends no credentials, so a server takes only an init proven with it"), engine
    assert engine["no group"] == ("ValueError: 2 trainer ranks and no torch.distributed group: call init_process_group "
                                  "(as FSDP2 or DDP needs) before trainer_init, which finds rank 0's controller through "
                                  "it"), engine
    assert engine["send first"] == (
        "RuntimeError: send_weights() before trainer_init(): make the engine with WeightTransferTrainerFactory."
        "trainer_init(WeightsyncTrainerInitInfo(rank=...), client=..., source=ModuleSource(model)) on every rank"), engine


def test_the_installed_vllm_has_every_internal_and_one_without_is_refused_on_one_line(found):
    door = found["door"]
    assert door["missing"] == [], door
    refused = door["refused"]
    assert refused is not None and "\n" not in refused, door
    assert refused.startswith("weightsync: weightsync's vLLM backend is tested with vLLM 0.32.0; this is vLLM "), door
    assert "it lacks WeightsMapper._map_name_with_shard, which weightsync relies on" in refused, door
    assert refused.endswith("; use vLLM 0.32.0"), door


def test_the_trainer_engine_is_refused_on_one_line_by_a_vllm_without_an_internal_it_reads(found):
    door = found["trainer door"]
    assert door["missing"] == [], door
    refused = door["refused"]
    assert refused is not None and "\n" not in refused, door
    assert refused.startswith("IncompatibleVllm: weightsync's vLLM trainer engine is tested with vLLM 0.32.0; this is "
                              "vLLM "), door
    assert "it lacks WeightTransferTrainerFactory._registry, which weightsync relies on" in refused, door
    assert refused.endswith("; use vLLM 0.32.0"), door
