"""The checksum every transport carries with a range, computed where its bytes lie.

- Host bytes: xxh3_64, over byte views, in chunks of CHUNK bytes so that each chunk is hashed
  while it is still in cache (the sender while it sends or casts, the receiver while it lands
  them).
- GPU bytes (the nccl, uccl and ipc transports, whose both ends hold the range in GPU memory):
  ws64, computed on the GPU in one pass over the bytes (ws64_fused below, a Triton kernel), on
  whatever stream is current, with no copy to the host. xxh3 is sequential and would need every
  byte on the host. ws64 is defined on the bytes alone, so the CPU computes the same value
  (device_checksum on a host tensor: torch's elementwise kernels and one reduction), which is how
  the tests pin it.

It sits below the transports and transfer/, which all hash the same bytes the same way.

ws64 of n bytes: pad them with zeros to whole little-endian 64-bit words w_0..w_k-1; then
  h = sum over i of mix(w_i + (i + 1) * GOLDEN)   (mod 2^64)
  ws64 = mix(h + n * GOLDEN)
where mix is splitmix64's finalizer (xor-shift, multiply, xor-shift, multiply, xor-shift). Each
word goes through a bijection keyed by its position, so a changed, moved or swapped word changes
the sum, and the sum is the same in any order of addition (a GPU reduction's order is not fixed).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from weightsync.transport.base import Filling

# bytes sent, or received, at a time and hashed at once, while they are still in cache (sizes
# measured best with `weightsync bench`)
CHUNK = 1 << 20


def checksum_of(views: list) -> int:
    """xxh3_64 of the concatenated bytes."""
    if len(views) == 1:
        return xxhash.xxh3_64_intdigest(views[0])
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def as_views(data: Any) -> list[memoryview]:
    """Byte views of what a caller hands to send(): bytes-like objects, CPU tensors, or lists."""
    if isinstance(data, (list, tuple)):
        return [v for d in data for v in as_views(d)]
    if hasattr(data, "data_ptr"):  # a torch tensor
        if data.device.type != "cpu":
            raise ValueError("the TCP transport sends host memory: stage device tensors into a host buffer first")
        import torch

        if not data.is_contiguous():
            raise ValueError("send a contiguous tensor (its bytes go out as they lie in memory)")
        return [memoryview(data.detach().reshape(-1).view(torch.uint8).numpy())]
    return [memoryview(data).cast("B")]


def bucket_checksum(data, filling: Filling | None = None) -> int:
    """The checksum of a bucket: its producer's once it is whole, when it has one (a Filling);
    else computed where it lies (xxh3_64 of host memory, ws64 of device memory)."""
    if filling is not None:
        return filling.result()
    if hasattr(data, "data_ptr") and data.device.type != "cpu":
        return int(device_checksum(data)) & U64
    return checksum_of(as_views(data))


U64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
# words hashed at a time: bounds the temporaries (a few times 8 bytes per word) on the device
WORDS_AT_ONCE = 1 << 24


def _signed64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _mix(z):
    """splitmix64's finalizer on int64 tensors, in place; int64 arithmetic wraps like uint64 and
    a logical right shift is an arithmetic one masked to the bits that stay."""
    for shift, multiplier in ((30, MIX[0]), (27, MIX[1]), (31, None)):
        z ^= (z >> shift) & ((1 << (64 - shift)) - 1)
        if multiplier is not None:
            z *= _signed64(multiplier)
    return z


def device_checksum(data):
    """ws64 (see above) of a tensor's bytes, computed on its device on the current stream: on a
    GPU by the fused kernel, on the CPU as the definition reads. Returns a 0-dim int64 tensor
    there (int() of it waits for that stream only; & U64 makes it the unsigned value that ranges
    carry)."""
    import torch

    if data.device.type == "cuda":
        return ws64_fused(data)

    raw = data.detach().reshape(-1).view(torch.uint8)
    n = raw.numel()
    whole = n // 8 * 8
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    words = raw[:whole].view(torch.int64) if whole else raw.new_empty(0).view(torch.int64)
    if whole < n:  # the last partial word, zero-padded
        tail = torch.zeros(8, dtype=torch.uint8, device=raw.device)
        tail[:n - whole] = raw[whole:]
        words = torch.cat([words, tail.view(torch.int64)])
    for first in range(0, words.numel(), WORDS_AT_ONCE):
        part = words[first:first + WORDS_AT_ONCE]
        position = torch.arange(first + 1, first + 1 + part.numel(), dtype=torch.int64, device=raw.device)
        position *= _signed64(GOLDEN)
        total += _mix(position.add_(part)).sum()
    return _finish(total, n)


def _finish(total, n: int):
    """ws64 from the sum of the mixed words (an int64 tensor) and the length in bytes."""
    return _mix((total + _signed64(n * GOLDEN % (1 << 64))).view(1)).view(())


# ws64 in one pass: the definition's torch form above runs a dozen elementwise kernels over the
# words and one reduction, each reading and writing the whole range, many times a read of the
# bytes on a GPU. Each program of the kernel reads its block of bytes once, assembles the
# little-endian words in registers (the last one zero-padded; any start address, as the range is
# read as bytes), mixes each with its position and sums the block; the per-block sums (64 Ki for
# 1 GiB) are then added and finalized. Addition mod 2^64 is the same in any order, so the value is
# the definition's. Triton compiles it for the GPU a tensor is on; on a CPU tensor it runs in
# Triton's interpreter (in a process where TRITON_INTERPRET=1 was set before Triton's first
# import), which is how the tests check its logic where no GPU is.
BLOCK_WORDS = 2048  # words a program reads (16 KiB)


@functools.cache
def _kernel():
    """The kernel, made at its first use: Triton is imported only where a GPU checksum is asked
    for. Its constants come as constexpr arguments: a kernel reads no other globals."""
    import triton
    import triton.language as tl

    @triton.jit
    def block_sums(raw, sums, n, block_words: tl.constexpr, golden: tl.constexpr, mix0: tl.constexpr,
                   mix1: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        word = block * block_words + tl.arange(0, block_words).to(tl.int64)  # the words' positions, from 0
        byte = word[:, None] * 8 + tl.arange(0, 8).to(tl.int64)[None, :]
        b = tl.load(raw + byte, mask=byte < n, other=0).to(tl.uint64)  # past the end: the zero padding
        w = tl.sum(b << (tl.arange(0, 8).to(tl.uint64) * 8)[None, :], axis=1)  # little-endian words
        z = w + (word.to(tl.uint64) + 1) * golden
        z = (z ^ (z >> 30)) * mix0
        z = (z ^ (z >> 27)) * mix1
        z = z ^ (z >> 31)
        z = tl.where(word * 8 < n, z, tl.zeros_like(z))  # only the words the bytes fill, some partly
        tl.store(sums + block, tl.sum(z, axis=0).to(tl.int64, bitcast=True))

    return block_sums


def ws64_fused(data):
    """ws64 of a tensor's bytes as a 0-dim int64 tensor on its device, like device_checksum,
    computed by the fused kernel on the current stream."""
    import torch

    raw = data.detach().reshape(-1).view(torch.uint8)
    n = raw.numel()
    blocks = -(-n // (8 * BLOCK_WORDS))
    sums = torch.zeros(max(blocks, 1), dtype=torch.int64, device=raw.device)
    if blocks:
        _kernel()[(blocks,)](raw, sums, n, block_words=BLOCK_WORDS, golden=GOLDEN, mix0=MIX[0], mix1=MIX[1])
    return _finish(sums.sum(), n)
