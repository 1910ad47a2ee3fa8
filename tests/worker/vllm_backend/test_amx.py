"""On a CPU with AMX tiles, every vLLM process may use them once it loaded weightsync's plugin
(vllm_backend.allow_amx_tiles): vLLM's CPU build runs its bfloat16 attention and MoE kernels on
the tiles without asking Linux for their state, and a process that has not asked dies of SIGILL at
its first tile instruction. Shown in vLLM's own environment, through vLLM's own plugin loader, by
reading the process's permitted state (arch_prctl ARCH_GET_XCOMP_PERM) before and after, in the
process and in a child forked from it as vLLM forks its workers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.vllm import vllm_python

pytestmark = pytest.mark.slow

XTILEDATA = 1 << 18  # the tile data's bit in the xstate features (Linux: XFEATURE_XTILEDATA)
HAS_AMX = "amx_tile" in Path("/proc/cpuinfo").read_text().split()

SCRIPT = """
import ctypes, json, multiprocessing, os

def permitted():
    mask = ctypes.c_uint64()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(158, 0x1022, ctypes.byref(mask)) != 0:  # SYS_arch_prctl, ARCH_GET_XCOMP_PERM
        raise OSError(ctypes.get_errno(), "arch_prctl(ARCH_GET_XCOMP_PERM)")
    return mask.value

def child(queue):
    queue.put(permitted())

if __name__ == "__main__":
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
    print(json.dumps({"amx": torch.cpu._is_amx_tile_supported(), "before": before, "after": after,
                      "forked": forked}))
"""


@pytest.fixture(scope="module")
def masks(tmp_path_factory) -> dict:
    script = tmp_path_factory.mktemp("amx") / "amx.py"
    script.write_text(SCRIPT)
    done = subprocess.run([vllm_python(), str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["amx"] == HAS_AMX, f"torch and /proc/cpuinfo disagree on AMX tiles: {found}"
    return found


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX tiles (lscpu: amx_tile); vLLM's kernels use none here")
def test_on_an_amx_cpu_the_plugin_gives_each_vllm_process_the_tiles(masks):
    assert masks["after"] & XTILEDATA, f"the plugin loaded, and this process may not use AMX tiles: {masks}"
    assert masks["forked"] & XTILEDATA, f"a forked worker may not use AMX tiles: {masks}"


@pytest.mark.skipif(HAS_AMX, reason="this CPU has AMX tiles: the test above applies")
def test_without_amx_tiles_the_plugin_asks_for_nothing(masks):
    assert masks["after"] == masks["before"] and not masks["after"] & XTILEDATA, masks
