"""The fused ws64 kernels (transport/ws64_kernels.py) give the definition's value (ws64.definition,
pinned to the definition's text in test_checksum.py), run by Triton's interpreter on CPU tensors:
a whole range of any length and start address, by 64-bit word loads where the start is 8-byte
aligned and by bytes elsewhere; and a trainer's bucket cast and hashed in one pass (the packers'
fill_checksummed, of runs of the flat layout and of boxes over slices), whose bytes are the host
cast's and whose ws64 is that of those bytes. The
kernels compile for the GPUs they are for (sm_90: H100, H200) on this machine, GPU-less, with the
compiler Triton ships, and the word path's machine code loads 64-bit words. On a GPU,
test_checksum.py and the transports' GPU tests compare them with the host's values.

Each runs in a Python of its own: Triton's interpreter works only where TRITON_INTERPRET was set
before Triton's first import (its library's own kernels are made then), and Triton compiles
nothing correctly in a process where the interpreter ran."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from support import ws64_cases

from weightsync.transfer.pack import RangePacker
from weightsync.transport.ws64 import U64, definition
from weightsync.transport.ws64_kernels import BLOCK_WORDS

pytest.importorskip("triton", reason="Triton comes with torch's CUDA builds (PyPI's default torch); this torch has none")

BLOCK = 8 * BLOCK_WORDS  # bytes a program reads
LENGTHS = [0, 1, 7, 8, 9, 63, 127, 128, 129, 4097, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 13]
STARTS = [0, 3, 8, 16]  # bytes into a buffer: 3 is no word's boundary, 8 no 16-byte one

INTERPRETED = """
import json, sys
import torch, xxhash
from support import ws64_cases
from weightsync.transfer.pack import RangePacker
from weightsync.transport.ws64 import U64
from weightsync.transport.ws64_kernels import ws64_fused

def data(n, start):
    return torch.randint(0, 256, (start + n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))[start:]

cases, block = json.loads(sys.argv[1]), int(sys.argv[2])
out = {f"{n},{start}": int(ws64_fused(data(n, start))) & U64 for n, start in cases}
x = torch.randn(block + 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # three programs' bytes
flipped = x.view(torch.uint8).clone()
flipped[block + 3] ^= 1  # in the second program's block
out["bfloat16"], out["flipped"] = (int(ws64_fused(t)) & U64 for t in (x, flipped))
layout = ws64_cases.layout()
packer = RangePacker(layout, ws64_cases.params(layout))
for b in ws64_cases.buckets(layout):
    bucket = torch.full((b.length,), 0xA5, dtype=torch.uint8)  # what a send buffer held before
    out[f"bucket {b.index}"] = [int(packer.fill_checksummed(b, bucket)) & U64, xxhash.xxh3_64_intdigest(bucket.numpy())]
packer, buckets = ws64_cases.sliced()
out["sliced"] = []
for b in buckets:
    bucket = torch.full((b.length,), 0xA5, dtype=torch.uint8)
    out["sliced"].append([int(packer.fill_checksummed(b, bucket)) & U64, xxhash.xxh3_64_intdigest(bucket.numpy())])
print(json.dumps(out))
"""

COMPILE = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from weightsync.transport import ws64_triton as k
from weightsync.transport.ws64_kernels import BLOCK_WORDS, CAST_WORDS, CONSTANTS

def build(fn, signature, block_words, aligned=()):
    # aligned: the arguments Triton is told divide by 16, as it specializes them at a launch
    constants = {"block_words": block_words, **CONSTANTS}
    source = triton.compiler.ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                                       constexprs=constants, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    return [len(compiled.asm["cubin"]), sorted(set(re.findall(r"(?:ld|st)\\.global[.\\w]*", compiled.asm["ptx"])))]

words = {"words": "*i64", "sums": "*i64", "end_word": "i64"}
print(json.dumps({
    "byte_sums": build(k.byte_sums, {"raw": "*u8", "sums": "*i64", "first_word": "i64", "end_word": "i64", "n": "i64"},
                       BLOCK_WORDS),
    "word_sums": build(k.word_sums, words, BLOCK_WORDS),
    "word_sums 16-byte aligned": build(k.word_sums, words, BLOCK_WORDS, aligned=(0, 2)),
    "cast_sums": build(k.cast_sums, {"bits": "*i32", "dst": "*i16", "sums": "*i64", "a": "i64", "b": "i64",
                                     "first_word": "i64", "owned_first": "i64", "owned_end": "i64"}, CAST_WORDS),
}))
"""


def python(script: str, *args: str, tmp_path, **env) -> str:
    """The script's output, run with the worker's package and the tests' support, and a Triton
    cache of its own (a cached build would hide a kernel that no longer compiles)."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = str(Path(__file__).resolve().parents[2])
    environment.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), TRITON_DEFAULT_FP_FUSION="1",
                       PYTHONPATH=os.pathsep.join([tests, *sys.path]), **env)
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=environment,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    cases = json.dumps([[n, start] for n in LENGTHS for start in STARTS])
    return json.loads(python(INTERPRETED, cases, str(BLOCK), tmp_path=tmp_path_factory.mktemp("ws64"),
                             TRITON_INTERPRET="1"))


def value(t: torch.Tensor) -> int:
    return int(definition(t.clone())) & U64  # a clone: a fresh, aligned copy of the bytes


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("start", STARTS)
def test_the_fused_kernel_gives_the_definitions_value_for_any_length_and_start(interpreted, n, start):
    t = torch.randint(0, 256, (start + n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))[start:]
    assert interpreted[f"{n},{start}"] == value(t)


def test_the_fused_kernel_reads_any_dtype_as_its_bytes_and_sees_a_flipped_bit(interpreted):
    x = torch.randn(BLOCK + 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert interpreted["bfloat16"] == value(x.view(torch.uint8))
    assert interpreted["flipped"] != interpreted["bfloat16"]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_bucket_cast_and_hashed_in_one_pass_holds_the_host_casts_bytes_and_their_ws64(interpreted, index):
    """Bucket 0 holds every slot, 1 two runs that start and end inside slots, 2 a run from an odd
    byte; the host's packer (its native or torch's cast) makes the bytes they must hold."""
    layout = ws64_cases.layout()
    bucket = ws64_cases.buckets(layout)[index]
    host = torch.full((bucket.length,), 0xA5, dtype=torch.uint8)
    RangePacker(layout, ws64_cases.params(layout)).fill(bucket, host)
    checksum, content = interpreted[f"bucket {index}"]
    assert content == xxhash.xxh3_64_intdigest(host.numpy())
    assert checksum == value(host)


def test_buckets_over_slices_cast_and_hashed_in_one_pass_hold_the_host_casts_bytes_and_their_ws64(interpreted):
    """Boxes of rows, which the kernel casts, and strided boxes of columns, which torch gathers and
    the kernel reads back."""
    packer, buckets = ws64_cases.sliced()
    expected = []
    for b in buckets:
        host = torch.full((b.length,), 0xA5, dtype=torch.uint8)
        packer.fill(b, host)
        expected.append([value(host), xxhash.xxh3_64_intdigest(host.numpy())])
    assert interpreted["sliced"] == expected


def test_the_fused_kernels_compile_for_the_gpus_they_are_for_with_word_loads(tmp_path):
    built = json.loads(python(COMPILE, tmp_path=tmp_path))
    assert all(size > 0 for size, _ in built.values())  # machine code for sm_90
    assert "ld.global.b8" in built["byte_sums"][1]
    assert any(re.fullmatch(r"ld\.global\.[bu]64", op) for op in built["word_sums"][1]), built["word_sums"]
    assert "ld.global.v2.b64" in built["word_sums 16-byte aligned"][1]  # two words a load
    cast = built["cast_sums"][1]
    assert "ld.global.b32" in cast and "st.global.b16" in cast  # float32 in, bfloat16 out, as lanes
