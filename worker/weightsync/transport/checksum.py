"""The checksum every transport carries with a range, computed where its bytes lie.

- Host bytes: xxh3_64, over byte views, in chunks of CHUNK bytes so that each chunk is hashed
  while it is still in cache (the sender while it sends or casts, the receiver while it lands
  them).
- GPU bytes (the nccl and uccl transports, whose both ends hold the range in GPU memory):
  ws64, computed on the GPU by a few elementwise kernels and one reduction, on whatever stream is
  current, with no copy to the host. xxh3 is sequential and would need every byte on the host.
  ws64 is defined on the bytes alone, so the CPU computes the same value (device_checksum on a
  host tensor), which is how the tests pin it.

It sits below the transports and transfer.py, which all hash the same bytes the same way.

ws64 of n bytes: pad them with zeros to whole little-endian 64-bit words w_0..w_k-1; then
  h = sum over i of mix(w_i + (i + 1) * GOLDEN)   (mod 2^64)
  ws64 = mix(h + n * GOLDEN)
where mix is splitmix64's finalizer (xor-shift, multiply, xor-shift, multiply, xor-shift). Each
word goes through a bijection keyed by its position, so a changed, moved or swapped word changes
the sum, and the sum is the same in any order of addition (a GPU reduction's order is not fixed).
"""

from __future__ import annotations

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
    """ws64 (see above) of a tensor's bytes, computed on its device on the current stream.
    Returns a 0-dim int64 tensor there (int() of it waits for that stream only; & U64 makes
    it the unsigned value that ranges carry)."""
    import torch

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
    total += _signed64(n * GOLDEN % (1 << 64))
    return _mix(total.view(1)).view(())
