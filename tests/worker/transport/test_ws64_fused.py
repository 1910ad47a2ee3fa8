"""The fused ws64 kernel (ws64_fused in transport/checksum.py) gives the definition's value (device_checksum
on the CPU, pinned to the definition in test_checksum.py) for every length and start address,
run here by Triton's interpreter on CPU tensors; and it compiles for the GPUs it is for (sm_90:
H100, H200) on this machine, GPU-less, with the compiler Triton ships. On a GPU, test_checksum.py
compares it with the host's value."""

import os
import subprocess
import sys

import pytest
import torch

from weightsync.transport import checksum
from weightsync.transport.checksum import BLOCK_WORDS, U64, device_checksum, ws64_fused

BLOCK = 8 * BLOCK_WORDS  # bytes a program reads


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel made under Triton's interpreter, for CPU tensors; made again afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    checksum._kernel.cache_clear()
    yield
    checksum._kernel.cache_clear()


def definition(t: torch.Tensor) -> int:
    return int(device_checksum(t.clone())) & U64  # a clone: a fresh, aligned copy of the bytes


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 4097, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 13])
@pytest.mark.parametrize("start", [0, 3, 8])
def test_the_fused_kernel_gives_the_definitions_value_for_any_length_and_start(interpreted, n, start):
    raw = torch.randint(0, 256, (start + n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    t = raw[start:]  # starts `start` bytes into the buffer: not on a word's boundary for 3
    assert int(ws64_fused(t)) & U64 == definition(t)


def test_the_fused_kernel_reads_any_dtype_as_its_bytes_and_sees_a_flipped_bit(interpreted):
    x = torch.randn(BLOCK + 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert int(ws64_fused(x)) & U64 == definition(x.view(torch.uint8))
    flipped = x.view(torch.uint8).clone()
    flipped[BLOCK + 3] ^= 1  # in the second of three programs' blocks
    assert int(ws64_fused(flipped)) != int(ws64_fused(x))


COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from weightsync.transport.checksum import BLOCK_WORDS, GOLDEN, MIX, _kernel

constants = {"block_words": BLOCK_WORDS, "golden": GOLDEN, "mix0": MIX[0], "mix1": MIX[1]}
signature = {"raw": "*u8", "sums": "*i64", "n": "i64", **dict.fromkeys(constants, "constexpr")}
source = triton.compiler.ASTSource(fn=_kernel(), signature=signature, constexprs=constants)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
print(len(compiled.asm["cubin"]), "ld.global" in compiled.asm["ptx"])
"""


def test_the_fused_kernel_compiles_for_the_gpus_it_is_for(tmp_path):
    """In a process of its own, with a cache of its own: Triton compiles nothing correctly in a
    process where its interpreter ran, and a cached build would hide a kernel that no longer
    compiles."""
    pytest.importorskip("triton", reason="Triton comes with torch's CUDA builds; this torch has none")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    size, loads = out.stdout.split()
    assert int(size) > 0 and loads == "True", out.stdout  # machine code for sm_90 that reads global memory
