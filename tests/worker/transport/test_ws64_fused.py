"""The fused ws64 kernel (ws64_fused in transport/checksum.py) gives the definition's value
(device_checksum on the CPU, pinned to the definition in test_checksum.py) for every length and
start address, run by Triton's interpreter on CPU tensors; and it compiles for the GPUs it is for
(sm_90: H100, H200) on this machine, GPU-less, with the compiler Triton ships. On a GPU,
test_checksum.py compares it with the host's value.

Each runs in a Python of its own: Triton's interpreter works only where TRITON_INTERPRET was set
before Triton's first import (its library's own kernels are made then), and Triton compiles
nothing correctly in a process where the interpreter ran."""

import json
import os
import subprocess
import sys

import pytest
import torch

from weightsync.transport.checksum import BLOCK_WORDS, U64, device_checksum

pytest.importorskip("triton", reason="Triton comes with torch's CUDA builds (PyPI's default torch); this torch has none")

BLOCK = 8 * BLOCK_WORDS  # bytes a program reads
LENGTHS = [0, 1, 7, 8, 9, 63, 4097, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 13]
STARTS = [0, 3, 8]  # bytes into a buffer: 3 is no word's boundary

INTERPRETED = """
import json, sys
import torch
from weightsync.transport.checksum import U64, ws64_fused

def data(n, start):
    return torch.randint(0, 256, (start + n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))[start:]

cases, block = json.loads(sys.argv[1]), int(sys.argv[2])
out = {f"{n},{start}": int(ws64_fused(data(n, start))) & U64 for n, start in cases}
x = torch.randn(block + 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # three programs' bytes
flipped = x.view(torch.uint8).clone()
flipped[block + 3] ^= 1  # in the second program's block
out["bfloat16"], out["flipped"] = (int(ws64_fused(t)) & U64 for t in (x, flipped))
print(json.dumps(out))
"""

COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from weightsync.transport.checksum import BLOCK_WORDS, GOLDEN, MIX, _kernel

constants = {"block_words": BLOCK_WORDS, "golden": GOLDEN, "mix0": MIX[0], "mix1": MIX[1]}
signature = {"raw": "*u8", "sums": "*i64", "n": "i64", **dict.fromkeys(constants, "constexpr")}
source = triton.compiler.ASTSource(fn=_kernel(), signature=signature, constexprs=constants)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
print(len(compiled.asm["cubin"]), "ld.global" in compiled.asm["ptx"])
"""


def python(script: str, *args: str, tmp_path, **env) -> str:
    """The script's output, run with the worker's package and a Triton cache of its own (a cached
    build would hide a kernel that no longer compiles)."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), **env)
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=environment,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, int]:
    cases = json.dumps([[n, start] for n in LENGTHS for start in STARTS])
    return json.loads(python(INTERPRETED, cases, str(BLOCK), tmp_path=tmp_path_factory.mktemp("ws64"),
                             TRITON_INTERPRET="1"))


def definition(t: torch.Tensor) -> int:
    return int(device_checksum(t.clone())) & U64  # a clone: a fresh, aligned copy of the bytes


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("start", STARTS)
def test_the_fused_kernel_gives_the_definitions_value_for_any_length_and_start(interpreted, n, start):
    t = torch.randint(0, 256, (start + n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))[start:]
    assert interpreted[f"{n},{start}"] == definition(t)


def test_the_fused_kernel_reads_any_dtype_as_its_bytes_and_sees_a_flipped_bit(interpreted):
    x = torch.randn(BLOCK + 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert interpreted["bfloat16"] == definition(x.view(torch.uint8))
    assert interpreted["flipped"] != interpreted["bfloat16"]


def test_the_fused_kernel_compiles_for_the_gpus_it_is_for(tmp_path):
    size, loads = python(COMPILE, tmp_path=tmp_path).split()
    assert int(size) > 0 and loads == "True"  # machine code for sm_90 that reads global memory
